"""One family of bad-input errors, and the translation of Python's own failures into it.

Every bad input anywhere in the project (an unreadable config, a wrong type, an edit that cannot be made, an
unsafe test selection, a CLI usage mistake) raises a subclass of :class:`InputError`. It carries one-line
``message`` (what is wrong) and ``fix`` (what to do). The CLI turns it into exit code 2 and exactly one JSON
object; the MCP server into ``isError`` with the same text. :func:`as_input_error` does the same for the
built-in exceptions that a hostile input can provoke (RecursionError, ZeroDivisionError, OverflowError, OSError,
UnicodeDecodeError, MemoryError), so no caller ever sees a traceback.
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


def as_input_error(exc: BaseException, where: str = "input") -> InputError:
    """The :class:`InputError` a caller should see for ``exc`` (an InputError is returned unchanged).

    Args:
        exc: any exception raised while handling one call.
        where: what was being handled, for the message (``"config"``, ``"apply"``, ...).

    Returns:
        An InputError whose message names the cause in plain words; unexpected exceptions are reported as
        ``internal error`` with their type, never with a traceback.
    """
    if isinstance(exc, InputError):
        return exc
    detail = _first_line(exc)
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
        name = f" {exc.filename}" if exc.filename else ""
        reason = exc.strerror or errno.errorcode.get(exc.errno or 0, "") or detail
        if isinstance(exc, IsADirectoryError):
            return InputError(f"{where}:{name} is a directory", "pass the config file inside it")
        if isinstance(exc, PermissionError):
            return InputError(f"{where}:{name} permission denied", "check the file's permissions")
        if exc.errno == errno.ENOSPC:
            return InputError(f"{where}:{name} no space left on the device; nothing was changed", "free space")
        return InputError(f"{where}:{name} {reason}", "check the path")
    if isinstance(exc, ValueError | TypeError | KeyError | IndexError | AttributeError | AssertionError):
        return InputError(f"{where}: invalid value ({type(exc).__name__}: {detail})", "check the input")
    error = InputError(f"{where}: internal error ({type(exc).__name__}: {detail})", "please report it")
    error.kind = "internal"
    return error
