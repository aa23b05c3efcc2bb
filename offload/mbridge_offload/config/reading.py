"""The one bounded reader behind every config source (file, stdin, inline; YAML or JSON).

A hostile or careless input is refused with a one-line InputError instead of hanging, eating memory or crashing:
only regular files (opened ``O_NONBLOCK`` and checked with ``fstat`` before any read, so a FIFO never blocks), a
size cap, depth and node caps after alias expansion (a "billion laughs" stops early), JSON ``NaN`` refused
(non-finite YAML numbers are read: Bridge's own defaults use ``.inf``), and read roots a server may fix or narrow
per MCP session. No torch.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import re
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from mbridge_offload.config.errors import InputError

MAX_BYTES_ENV = "MBRIDGE_OFFLOAD_MAX_CONFIG_BYTES"
MAX_DEPTH_ENV = "MBRIDGE_OFFLOAD_MAX_DEPTH"
MAX_NODES_ENV = "MBRIDGE_OFFLOAD_MAX_NODES"
DEFAULT_MAX_BYTES = 2 * 1024 * 1024
DEFAULT_MAX_DEPTH = 32
DEFAULT_MAX_NODES = 100_000

_read_roots: tuple[Path, ...] | None = None
# The roots of the MCP session whose tool call is running (its client's declared roots): a context variable, so
# concurrent sessions of one HTTP server each see their own; anyio copies it into the worker thread of the call.
_session_roots: contextvars.ContextVar[tuple[Path, ...] | None] = contextvars.ContextVar(
    "mbridge_offload_session_roots", default=None
)


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise InputError(f"{name}={text!r} is not an integer", "unset it or give a positive integer") from None
    if value < 1:
        raise InputError(f"{name}={value} must be at least 1", "unset it or give a positive integer")
    return value


def max_bytes() -> int:
    """The size cap in bytes (``MBRIDGE_OFFLOAD_MAX_CONFIG_BYTES``, default 2 MiB)."""
    return _env_int(MAX_BYTES_ENV, DEFAULT_MAX_BYTES)


def max_depth() -> int:
    """The nesting limit (``MBRIDGE_OFFLOAD_MAX_DEPTH``, default 32)."""
    return _env_int(MAX_DEPTH_ENV, DEFAULT_MAX_DEPTH)


def max_nodes() -> int:
    """The value-count limit after alias expansion (``MBRIDGE_OFFLOAD_MAX_NODES``, default 100 000)."""
    return _env_int(MAX_NODES_ENV, DEFAULT_MAX_NODES)


# ---------------------------------------------------------------------------------------------- containment


def set_read_roots(roots: Iterable[str | os.PathLike[str]] | None) -> None:
    """Fix the directories configs may be read from (a server sets this once at start; None = anywhere)."""
    global _read_roots
    _read_roots = None if roots is None else tuple(Path(r).resolve() for r in roots)


def read_roots() -> tuple[Path, ...] | None:
    """The directories reads are confined to now: this session's roots, else the server's, else None (anywhere)."""
    session = _session_roots.get()
    return session if session is not None else _read_roots


@contextlib.contextmanager
def using_roots(roots: Iterable[Path]) -> Iterator[None]:
    """Confine reads (and the server's writes) to ``roots`` for the calls made inside the block."""
    token = _session_roots.set(tuple(roots))
    try:
        yield
    finally:
        _session_roots.reset(token)


def check_inside(path: Path, roots: Iterable[Path], what: str) -> Path:
    """``path`` resolved (symlinks followed); InputError when it is outside every root."""
    resolved = path.resolve()
    roots = list(roots)
    if not any(resolved == root or resolved.is_relative_to(root) for root in roots):
        raise InputError(
            f"{path}: outside the directories this server may {what} ({', '.join(str(r) for r in roots)})",
            "use a path inside them, or add its directory as a root: declare it in the MCP client's roots, or "
            "restart the server with --root DIR",
        )
    return resolved


# ---------------------------------------------------------------------------------------------- reading


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{where}: not UTF-8 text (byte {exc.start}: {exc.reason})", "save the config as UTF-8"
        ) from None


def read_text_file(path: str | os.PathLike[str], what: str = "config", tail: bool = False) -> str:
    """The text of a regular file, at most :func:`max_bytes` long, never blocking on a FIFO or device.

    ``tail`` (a log) keeps the last :func:`max_bytes` bytes instead of refusing a larger file and replaces bytes that
    are not UTF-8. Raises InputError: missing, not regular, too large, unreadable, not UTF-8, outside the read roots.
    """
    where = str(path)
    p = Path(path)
    roots = read_roots()
    if roots is not None:
        check_inside(p, roots, "read")
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        kind = f"{what} file (YAML or JSON)" if what == "config" else f"{what} file"
        raise InputError(f"{where}: no such file", f"pass an existing {kind}") from None
    except IsADirectoryError:
        raise InputError(f"{where}: is a directory", f"pass the {what} file inside it") from None
    except PermissionError:
        raise InputError(f"{where}: permission denied", "make it readable (chmod u+r) or pass another file") from None
    except OSError as exc:
        raise InputError(f"{where}: cannot be opened ({exc.strerror or exc})", "pass a regular file") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"{where}: is {_kind(info.st_mode)}, not a regular file", f"pass a {what} file")
        cap = max_bytes()
        if tail and info.st_size > cap:
            os.lseek(fd, info.st_size - cap, os.SEEK_SET)
        elif info.st_size > cap:
            raise InputError(
                f"{where}: {info.st_size} bytes is over the {cap}-byte limit for a {what}",
                f"pass a smaller file, or raise {MAX_BYTES_ENV}",
            )
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > cap and tail:
                break
            if total > cap:  # the file grew while we read it
                raise InputError(f"{where}: over the {cap}-byte limit", f"raise {MAX_BYTES_ENV}")
    except BlockingIOError:
        raise InputError(f"{where}: would block (not a regular file)", f"pass a {what} file") from None
    except OSError as exc:
        raise InputError(f"{where}: cannot be read ({exc.strerror or exc})", "pass a readable file") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    return data[-cap:].decode("utf-8", errors="replace") if tail else _decode(data, where)


def read_stream(stream: Any, where: str = "<stdin>") -> str:
    """At most :func:`max_bytes` of a text or binary stream (InputError: more, or not UTF-8)."""
    cap = max_bytes()
    buffer = getattr(stream, "buffer", None)
    data = (buffer or stream).read(cap + 1)
    if isinstance(data, bytes):
        data = _decode(data, where)
    if len(data) > cap:
        raise InputError(f"{where}: over the {cap}-byte limit", f"pass a smaller config, or raise {MAX_BYTES_ENV}")
    return data


def check_text(text: str, where: str) -> None:
    """Refuse (InputError) inline text longer than :func:`max_bytes`."""
    cap = max_bytes()
    if len(text) > cap:
        raise InputError(f"{where}: {len(text)} characters is over the {cap}-byte limit", f"raise {MAX_BYTES_ENV}")


# ---------------------------------------------------------------------------------------------- bounded tree


def refuse_json_constant(name: str) -> Any:
    """``json.loads(parse_constant=...)``: NaN and Infinity are not JSON numbers a config may hold (InputError)."""
    raise InputError(f"JSON constant {name} is not allowed in a config", "write a finite number")


def check_number(value: Any, path: str) -> None:
    """Refuse (InputError) a NaN or infinite float at ``path``, a key that takes only finite numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(
            f"{path or '<top>'} = {value}: not a finite number", "write a finite number, or remove the key"
        )


class Budget:
    """Counts values while a tree is walked; refuses too many (alias bombs) or too deep (nesting bombs)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.nodes = 0
        self.max_nodes = max_nodes()
        self.max_depth = max_depth()

    def visit(self, depth: int) -> None:
        """Account for one value at ``depth`` (InputError: over the value count or the depth limit)."""
        self.nodes += 1
        if self.nodes > self.max_nodes:
            raise InputError(
                f"{self.where}: more than {self.max_nodes} values after expanding YAML aliases",
                f"a config has far fewer; remove alias chains, or raise {MAX_NODES_ENV}",
            )
        if depth > self.max_depth:
            raise InputError(
                f"{self.where}: nested deeper than {self.max_depth} levels",
                f"a config is a few levels deep; flatten it, or raise {MAX_DEPTH_ENV}",
            )


DEADLINE_ENV = "MBRIDGE_OFFLOAD_DEADLINE_S"
DEFAULT_DEADLINE_S = 60


def deadline_s() -> int:
    """Seconds one CLI command or MCP tool call may take (``MBRIDGE_OFFLOAD_DEADLINE_S``, default 60).

    Test runs have their own ``timeout``; they get that plus a margin instead.
    """
    return _env_int(DEADLINE_ENV, DEFAULT_DEADLINE_S)


_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def check_flow_depth(text: str, where: str) -> None:
    """Refuse YAML flow nesting (``[[[[...``) deeper than :func:`max_depth` before a parser recurses into it.

    The YAML parser is recursive and slow on deep flow collections; this count is linear and conservative (brackets
    inside quoted strings count too, which no real config needs by the dozen).
    """
    limit, depth = max_depth(), 0
    for char in _NOT_BRACKET.sub("", text):
        depth = depth + 1 if char in "[{" else max(0, depth - 1)
        if depth > limit:
            raise InputError(
                f"{where}: nested deeper than {limit} levels",
                f"a config is a few levels deep; flatten it, or raise {MAX_DEPTH_ENV}",
            )
