"""Shared plumbing of the CLI: one JSON object on stdout with --json, exit codes 0/1/2, one error shape."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from mbridge_offload.config.errors import InputError, as_input_error

EXIT_OK, EXIT_FINDINGS, EXIT_BAD_INPUT = 0, 1, 2


class UsageError(InputError):
    """Bad input or usage: exit code 2 with a one-line message."""


def emit(payload: dict[str, Any], as_json: bool, human: Callable[[dict[str, Any]], str]) -> None:
    """Print ``payload`` as exactly one JSON object (``--json``) or as the human rendering."""
    if as_json:
        text = json.dumps(payload, indent=2, default=str, allow_nan=False)
        sys.stdout.write(text + "\n")
    else:
        sys.stdout.write(human(payload).rstrip("\n") + "\n")


def fail(message: str | BaseException, as_json: bool) -> NoReturn:
    """Report bad input and exit 2: one JSON object on stdout under --json, one line on stderr always.

    ``message`` may be an exception: any exception becomes the project's one error shape
    (:func:`mbridge_offload.config.errors.as_input_error`), never a traceback.
    """
    error = as_input_error(message, "input") if isinstance(message, BaseException) else InputError(message)
    if as_json:
        sys.stdout.write(json.dumps(error.to_dict()) + "\n")
    sys.stderr.write(f"mbridge-offload: error: {error}\n")
    sys.stdout.flush()
    raise SystemExit(EXIT_BAD_INPUT)
