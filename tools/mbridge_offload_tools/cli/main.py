"""``mbridge-offload`` — the command line; every subcommand also answers ``--json``.

Each module in ``SUBCOMMAND_MODULES`` adds its subcommands; heavy imports happen inside the handlers, never here.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn

from mbridge_offload import __version__
from mbridge_offload.config.errors import DeadlineError
from mbridge_offload_tools.cli.common import EXIT_BAD_INPUT, fail
from mbridge_offload_tools.interface.build import finish

# Commands with their own time limit (test: --timeout) or none by nature (serve).
# trace: its subprocess has its own deadline (--deadline), longer than the default call's.
_NO_DEADLINE = ("serve", "test", "calibrate", "trace")


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line (and one JSON object under --json) on usage errors."""

    as_json = False  # set by main() from the command line it parses

    def error(self, message: str) -> NoReturn:
        fail(f"{self.prog}: {message}", _Parser.as_json)


SUBCOMMAND_MODULES = (
    "mbridge_offload_tools.cli.validate",
    "mbridge_offload_tools.cli.plan",
    "mbridge_offload_tools.cli.agent",
    "mbridge_offload_tools.plot.cli",
    "mbridge_offload_tools.trace.cli",
    "mbridge_offload_tools.cli.mcp_config",
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


@contextlib.contextmanager
def _deadline(args: argparse.Namespace) -> Iterator[None]:
    """Stop a command that runs past ``MBRIDGE_OFFLOAD_DEADLINE_S`` (a stdin that never ends, a huge input), or
    past ``--deadline`` and a margin for ``validate --exact`` (the same limit the MCP tool gets)."""
    from mbridge_offload.config.reading import DEADLINE_ENV
    from mbridge_offload_tools.interface.build import values
    from mbridge_offload_tools.interface.calls import validate_seconds

    command = args.command
    usable = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if command in _NO_DEADLINE or not usable:
        yield
        return
    seconds = math.ceil(validate_seconds(values(args, "validate_config") if command == "validate" else {}))

    def _expired(_signum, _frame):
        raise DeadlineError(
            f"{command}: no answer within {seconds} s", f"pass a smaller input, or raise {DEADLINE_ENV}"
        )

    previous = signal.signal(signal.SIGALRM, _expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def main(argv: list[str] | None = None) -> None:
    """Run one command; a failure ends as one error object (the one place that does this), never a traceback:
    exit 2 for bad input, 3 for a bug of ours (``kind: "internal"``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    _Parser.as_json = "--json" in argv
    try:
        args = build_parser().parse_args(argv)
        finish(args)  # older spellings folded in, every value held to the bounds the MCP schema declares
        with _deadline(args):
            code = args.handler(args)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        code = EXIT_BAD_INPUT
    except Exception as exc:  # the one place any failure becomes one JSON error: 2 input, 3 bug
        fail(exc, _Parser.as_json)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
