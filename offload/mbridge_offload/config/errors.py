"""One family of bad-input errors, and the translation of the failures a bad input can provoke into it.

Every bad input raises an :class:`InputError` with a one-line ``message`` and ``fix``: the CLI's exit code 2, the
MCP server's ``isError``. :func:`as_input_error` translates what only the input can cause (a YAML or pydantic
rejection, the built-in errors a hostile input provokes); anything else is a bug, which :func:`internal_error`
reports as ``kind: "internal"``, exit code 3, still without a traceback.
"""

from __future__ import annotations

import errno
from typing import Any


class InputError(ValueError):
    """Bad input: ``message`` says what is wrong, ``fix`` what to do instead.

    A ``ValueError`` so that callers that caught ``ValueError`` before keep working.
    """

    kind = "bad_input"

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message}; {self.fix}"

    def to_dict(self) -> dict[str, Any]:
        """The one JSON error object: ``{"ok": false, "error": ..., "fix": ..., "kind": ...}``."""
        return {"ok": False, "error": str(self), "fix": self.fix, "kind": self.kind}


class DeadlineError(InputError):
    """A call ran past its deadline (a slow or never-ending input)."""

    kind = "deadline"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""


class BoundsError(InputError):
    """A planning input out of its declared bounds or of the wrong type (``plan.inputs.resolve.validate_inputs``)."""


def as_input_error(exc: BaseException, where: str = "input") -> InputError | None:
    """The :class:`InputError` a caller should see for ``exc``, or None when ``exc`` is a bug, not the input."""
    if isinstance(exc, InputError):
        return exc
    detail = _first_line(exc)
    if _is_parser_rejection(exc):
        return InputError(f"{where}: {detail}", "fix the value it names")
    if isinstance(exc, RecursionError):
        return InputError(f"{where}: nested too deeply to process", "flatten the structure (a config is 2-3 levels)")
    if isinstance(exc, MemoryError):
        return InputError(f"{where}: too large to process in memory", "pass a smaller input")
    if isinstance(exc, ZeroDivisionError):
        return InputError(
            f"{where}: a value that must be positive is 0 ({detail})", "pass positive sizes, counts and bandwidths"
        )
    if isinstance(exc, OverflowError):
        return InputError(f"{where}: a number is too large ({detail})", "pass values of realistic size")
    if isinstance(exc, UnicodeDecodeError):
        return InputError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})", "save the file as UTF-8")
    if isinstance(exc, OSError):
        return _os_error(exc, where, detail)
    return None


def _is_parser_rejection(exc: BaseException) -> bool:
    """A YAML parse error or a pydantic validation error: the text of the input was refused, not our code."""
    import pydantic
    import yaml

    return isinstance(exc, yaml.YAMLError | pydantic.ValidationError)


def _os_error(exc: OSError, where: str, detail: str) -> InputError:
    name = f" {exc.filename}" if exc.filename else ""
    reason = exc.strerror or errno.errorcode.get(exc.errno or 0, "") or detail
    if isinstance(exc, IsADirectoryError):
        return InputError(f"{where}:{name} is a directory", "pass the config file inside it")
    if isinstance(exc, PermissionError):
        return InputError(f"{where}:{name} permission denied", "check the file's permissions")
    if exc.errno == errno.ENOSPC:
        return InputError(f"{where}:{name} no space left on the device; nothing was changed", "free space")
    return InputError(f"{where}:{name} {reason}", "check the path")


def internal_error(exc: BaseException, where: str = "input") -> dict[str, Any]:
    """The one JSON error object for a bug: ``kind: "internal"``, the exception's type and first line."""
    text = f"{where}: internal error ({type(exc).__name__}: {_first_line(exc)})"
    return {"ok": False, "error": f"{text}; please report it", "fix": "please report it", "kind": "internal"}
