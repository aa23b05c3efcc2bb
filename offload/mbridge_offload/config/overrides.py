"""How a value is written in a Hydra-style override: the one formatter that rules, planner and apply use.

``true``/``false`` (YAML booleans, not Python's ``True``), ``null`` for None, lists as ``[a,b]``, numbers and strings
as they print.
Never imports torch.
"""

from __future__ import annotations

from typing import Any


def format_value(value: Any) -> str:
    """A value as a Hydra override writes it: ``true``, ``null``, ``0.5``, ``none``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):  # no spaces: one shell word, as Hydra reads ``[a,b]``
        return "[" + ",".join(format_value(v) for v in value) + "]"
    return str(value)


def format_override(key: str, value: Any) -> str:
    """``key=value`` with :func:`format_value`."""
    return f"{key}={format_value(value)}"
