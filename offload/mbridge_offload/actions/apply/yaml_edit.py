"""Edit only the lines of the keys that change in a YAML config; every other byte stays as the user wrote it.

A YAML round trip through a parser rewrites what it does not understand the user's way (``False`` becomes
``false``, an empty value ``null``, comment-only files lose their comments). Here a change to
``section.key`` rewrites that key's line (its comment kept), or inserts one line, or appends a section; then the
result is parsed again and must equal the old config plus exactly the changes. When the layout is one this
cannot edit line by line (flow style, a multi-line value, a duplicated section), :func:`line_edit` returns None
and the caller falls back to the round-trip writer.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-/]*")
_RESERVED = {"null", "true", "false", "yes", "no", "on", "off", "y", "n", "~"}


def scalar(value: Any) -> str:
    """``value`` as a YAML scalar that reads back as the same value (``null``, ``true``, ``0.5``, ``none``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value)
    if _PLAIN.fullmatch(text) and text.lower() not in _RESERVED:
        return text
    return json.dumps(text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _content(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


def _nested(line: str, width: int) -> bool:
    return _indent(line) > width or (_indent(line) == width and line.lstrip().startswith("- "))


def _section_block(lines: list[str], section: str) -> tuple[int, int] | Literal[False] | None:
    """``(header index, end index)`` of ``section:``; None if absent; False if not line-editable."""
    pattern = re.compile(rf"^{re.escape(section)}:[ \t]*(#.*)?$")
    hits = [i for i, line in enumerate(lines) if pattern.match(line.rstrip("\r\n"))]
    if len(hits) > 1 or any(line.startswith(f"{section}:") for line in lines if not pattern.match(line.rstrip("\r\n"))):
        return False  # duplicated, or `section: {flow}` / `section: value`
    if not hits:
        return None
    start = hits[0]
    end = start + 1
    last = start
    while end < len(lines):
        line = lines[end]
        if _content(line) and _indent(line) == 0:
            break
        if _content(line):
            last = end
        end += 1
    return start, last + 1


def _split_value(rest: str) -> tuple[str, str]:
    """``(value, trailing comment with its leading space)`` of what follows ``key:`` on a line."""
    body = rest.rstrip("\r\n")
    if body.lstrip().startswith(("'", '"')):
        quote = body.lstrip()[0]
        close = body.find(quote, body.find(quote) + 1)
        cut = body.find(" #", close) if close != -1 else -1
    else:
        cut = body.find(" #")
    if cut == -1:
        return body.strip(), ""
    return body[:cut].strip(), body[len(body[:cut].rstrip()) :]


def _edit_one(lines: list[str], key: str, value: Any, neighbour: str | None, nl: str) -> bool:
    section, _, leaf = key.partition(".")
    block = _section_block(lines, section)
    if block is False:
        return False
    if block is None:
        if lines and not lines[-1].endswith(("\n", "\r")):
            lines[-1] += nl
        lines.extend([f"{section}:{nl}", f"  {leaf}: {scalar(value)}{nl}"])
        return True
    start, end = block
    children = [i for i in range(start + 1, end) if _content(lines[i])]
    width = _indent(lines[children[0]]) if children else 2
    pad = " " * width
    key_re = re.compile(rf"^{pad}{re.escape(leaf)}:(?=[ \t]|$)(.*)$", re.S)
    where = {}
    for i in children:
        if _indent(lines[i]) != width:
            continue
        match = key_re.match(lines[i])
        name = lines[i].strip().split(":", 1)[0]
        where[name] = i
        if match:
            old, comment = _split_value(match.group(1))
            if not old or old.startswith(("|", ">", "&", "*", "[", "{")):
                return False  # a nested block, a block scalar, an anchor or a flow collection
            ending = lines[i][len(lines[i].rstrip("\r\n")) :] or nl
            lines[i] = f"{pad}{leaf}: {scalar(value)}{comment}{ending}"
            return True
    after = where.get(neighbour) if neighbour else None
    position = (after if after is not None else (children[-1] if children else start)) + 1
    while position < end and (not _content(lines[position]) or _nested(lines[position], width)):
        position += 1  # past a nested value of the neighbour (a deeper block, or a list at its own indentation)
    while position - 1 > start and not _content(lines[position - 1]):
        position -= 1  # but not past blank or comment lines that belong to what follows
    if not lines[position - 1].endswith(("\n", "\r")):
        lines[position - 1] += nl
    lines.insert(position, f"{pad}{leaf}: {scalar(value)}{nl}")
    return True


def line_edit(text: str, changes: list[tuple[str, Any]], neighbours: dict[str, str], parse: Any) -> str | None:
    """``text`` with only the changed keys' lines edited, verified to parse to the old config plus exactly the
    changes; None when that is not safe. ``neighbours``: the key a new key goes after.
    """
    nl = "\r\n" if "\r\n" in text else "\n"
    lines = text.splitlines(keepends=True)
    for key, value in changes:
        if not _edit_one(lines, key, value, neighbours.get(key), nl):
            return None
    new_text = "".join(lines)
    expected = parse(text)
    for key, value in changes:
        section, _, leaf = key.partition(".")
        if not isinstance(expected.get(section), dict):
            expected[section] = {}
        expected[section][leaf] = value
    try:
        return new_text if parse(new_text) == expected else None
    except ValueError:
        return None
