"""Shared plumbing of the CLI: one JSON object on stdout with --json, exit codes 0/1/2."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn

EXIT_OK, EXIT_FINDINGS, EXIT_BAD_INPUT = 0, 1, 2


class UsageError(Exception):
    """Bad input or usage: exit code 2 with a one-line message."""


def emit(payload: dict[str, Any], as_json: bool, human: Callable[[dict[str, Any]], str]) -> None:
    """Print ``payload`` as exactly one JSON object (``--json``) or as the human rendering."""
    if as_json:
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    else:
        sys.stdout.write(human(payload).rstrip("\n") + "\n")


def fail(message: str, as_json: bool) -> NoReturn:
    """Report bad input and exit 2. Under --json the error is still one JSON object on stdout."""
    if as_json:
        sys.stdout.write(json.dumps({"ok": False, "error": message}) + "\n")
    sys.stderr.write(f"mbridge-offload: error: {message}\n")
    raise SystemExit(EXIT_BAD_INPUT)
