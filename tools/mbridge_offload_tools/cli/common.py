"""Shared plumbing of the CLI: one JSON object on stdout with --json, exit codes 0/1/2/3, one error shape."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from mbridge_offload.config.errors import InputError, as_input_error, internal_error

# 3: a bug of ours, not the caller's input (the design's 0/1/2 are success, findings, bad input).
EXIT_OK, EXIT_FINDINGS, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3


class UsageError(InputError):
    """Bad input or usage: exit code 2 with a one-line message."""


def emit(payload: dict[str, Any], as_json: bool, human: Callable[[dict[str, Any]], str]) -> None:
    """Print ``payload`` as exactly one JSON object (``--json``) or as the human rendering."""
    if as_json:
        text = json.dumps(payload, indent=2, default=str, allow_nan=False)
        sys.stdout.write(text + "\n")
    else:
        sys.stdout.write(human(payload).rstrip("\n") + "\n")


def error_payload(exc: BaseException, where: str = "input") -> tuple[dict[str, Any], int]:
    """The one JSON error object for ``exc`` and its exit code: 2 for bad input, 3 for a bug."""
    error = as_input_error(exc, where)  # None: a bug (see ``config.errors``)
    return (error.to_dict(), EXIT_BAD_INPUT) if error is not None else (internal_error(exc, where), EXIT_INTERNAL)


def fail(message: str | BaseException, as_json: bool) -> NoReturn:
    """Report a failure and exit: one JSON object on stdout under --json, one line on stderr always.

    A string or an input error exits 2; any other exception is a bug and exits 3 (``kind: "internal"``).
    Never a traceback.
    """
    if isinstance(message, BaseException):
        payload, code = error_payload(message)
    else:
        payload, code = InputError(message).to_dict(), EXIT_BAD_INPUT
    if as_json:
        sys.stdout.write(json.dumps(payload) + "\n")
    sys.stderr.write(f"mbridge-offload: error: {payload['error']}\n")
    sys.stdout.flush()
    raise SystemExit(code)
