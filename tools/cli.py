"""``mbridge-offload`` — the command line; every subcommand also answers ``--json``.

Subcommands are registered by the modules that own them (``add_parsers(subparsers)``); each handler
returns an exit code. Heavy imports (torch, megatron, mcp) happen inside handlers, never here.
"""

from __future__ import annotations

import argparse
import sys

from offload import __version__
from tools.common import EXIT_BAD_INPUT, UsageError, fail


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line (and one JSON object under --json) on usage errors."""

    def error(self, message: str):  # type: ignore[override]
        fail(f"{self.prog}: {message}", "--json" in sys.argv)


SUBCOMMAND_MODULES = ("tools.cli_validate", "tools.cli_plan", "tools.cli_agent")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = _Parser(prog="mbridge-offload", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"mbridge-offload {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a missing dependency inside the module is a real error
                raise
            continue  # a subcommand module not written yet (parallel development): its commands are absent
        module.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = args.handler(args)
    except UsageError as exc:
        fail(str(exc), getattr(args, "json", False))
    except KeyboardInterrupt:
        code = EXIT_BAD_INPUT
    raise SystemExit(code)


if __name__ == "__main__":
    main()
