"""``mbridge-offload`` — the command line; every subcommand also answers ``--json``.

Subcommands are registered by the modules that own them (``add_parsers(subparsers)``); each handler
returns an exit code. Heavy imports (torch, megatron, mcp) happen inside handlers, never here.
"""

from __future__ import annotations

import argparse
import sys

from mbridge_offload import __version__
from mbridge_offload_tools.common import EXIT_BAD_INPUT, UsageError, fail


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line (and one JSON object under --json) on usage errors."""

    def error(self, message: str):  # type: ignore[override]
        fail(f"{self.prog}: {message}", "--json" in sys.argv)


SUBCOMMAND_MODULES = (
    "mbridge_offload_tools.cli_validate",
    "mbridge_offload_tools.cli_plan",
    "mbridge_offload_tools.cli_agent",
)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = _Parser(
        prog="mbridge-offload",
        description="Validate, plan, apply and verify CPU offloading for Megatron Bridge / Megatron Core. "
        "Every subcommand takes --json and then prints exactly one JSON object; exit 0 = ok, 1 = errors found, "
        "2 = bad input.",
    )
    parser.add_argument("--version", action="version", version=f"mbridge-offload {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parsers(sub)
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
