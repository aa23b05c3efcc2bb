"""Every subcommand and option of ``mbridge-offload`` and ``mbridge-offload-mcp`` says what it is for."""

from __future__ import annotations

import argparse

from mbridge_offload_tools.cli.main import build_parser
from mbridge_offload_tools.server.app import build_parser as server_parser


def _undocumented(parser: argparse.ArgumentParser, path: list[str]) -> list[str]:
    """Walk the argparse tree: a subcommand needs help and a description, an option or argument needs help."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                where = " ".join([*path, name])
                if not helps.get(name):
                    missing.append(f"{where}: no help in the subcommand list")
                if not sub.description:
                    missing.append(f"{where}: no description")
                missing += _undocumented(sub, [*path, name])
        elif not action.help or action.help == argparse.SUPPRESS:
            missing.append(f"{' '.join(path) or '(top)'} {'/'.join(action.option_strings) or action.dest}: no help")
    return missing


def test_every_subcommand_and_option_has_help_text() -> None:
    assert _undocumented(build_parser(), ["mbridge-offload"]) == []


def test_every_option_of_the_mcp_server_command_has_help_text() -> None:
    assert _undocumented(server_parser(), ["mbridge-offload-mcp"]) == []


def test_the_walk_finds_a_missing_help() -> None:
    parser = argparse.ArgumentParser(prog="x", description="d")
    sub = parser.add_subparsers(dest="command")
    child = sub.add_parser("bare")
    child.add_argument("--quiet", action="store_true")
    assert _undocumented(parser, ["x"]) == [
        "x bare: no help in the subcommand list",
        "x bare: no description",
        "x bare --quiet: no help",
    ]
