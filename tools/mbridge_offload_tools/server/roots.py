"""The MCP client's roots: asked for when the client declares them, followed when it says they changed.

A client of the 2025 protocol revisions that declares the ``roots`` capability (Claude Code, VS Code and others
still send it) tells the server which directories the user opened. :class:`RootsMiddleware` wraps every tool
call: for such a client it asks ``roots/list`` once per connection (again after
``notifications/roots/list_changed``), and runs the call with reads and writes confined to those directories plus
the server's explicit ``--root`` flags (:func:`mbridge_offload.config.reading.using_roots`). A client that declares
no roots, or a 2026-07-28 connection (no server-to-client requests; directories come from the server's
configuration), gets the roots fixed at start: the launch directory, or the ``--root`` flags.

Containment comes from the client and the server's start, never from a tool argument.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from mbridge_offload.config.reading import using_roots
from mbridge_offload_tools.server import guard

logger = logging.getLogger(__name__)

LIST_CHANGED = "notifications/roots/list_changed"
ASK_TIMEOUT_S = 10.0  # a client that declares roots but never answers must not stall the call


def paths_of(uris: Iterable[str]) -> tuple[Path, ...]:
    """The local directories behind ``file://`` root URIs (symlinks resolved); other schemes are skipped.

    Example:
        >>> paths_of(["file:///tmp", "https://example.com"])  # doctest: +SKIP
        (PosixPath('/tmp'),)
    """
    out: list[Path] = []
    for uri in uris:
        parsed = urlparse(str(uri))
        if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
            logger.info("ignoring MCP root %s: not a local file:// directory", uri)
            continue
        out.append(Path(unquote(parsed.path)).resolve())
    return tuple(dict.fromkeys(out))


class _Cache:
    """Per connection: the roots its client declared, or None until asked (and again after list_changed)."""

    def __init__(self) -> None:
        # Keyed by the connection object (one per client) so a closed connection's entry goes with it.
        self._by_connection: weakref.WeakKeyDictionary[Any, tuple[Path, ...]] = weakref.WeakKeyDictionary()

    def get(self, connection: Any) -> tuple[Path, ...] | None:
        return self._by_connection.get(connection)

    def put(self, connection: Any, roots: tuple[Path, ...]) -> None:
        self._by_connection[connection] = roots

    def forget(self, connection: Any) -> None:
        self._by_connection.pop(connection, None)


_cache = _Cache()


def _connection(session: Any) -> Any:
    # The SDK builds a ServerSession per request; the connection under it lives as long as the client.
    return getattr(session, "_connection", session)


def _declares_roots(session: Any) -> bool:
    capabilities = getattr(session, "client_capabilities", None)
    return capabilities is not None and getattr(capabilities, "roots", None) is not None


async def _ask(session: Any) -> tuple[Path, ...] | None:
    """The client's roots, or None when it cannot be asked (no back-channel, an error, no answer in time)."""
    import anyio
    from mcp import types

    try:  # send_request, not the deprecated list_roots wrapper: its warning is not the user's concern
        with anyio.fail_after(ASK_TIMEOUT_S):
            result = await session.send_request(types.ListRootsRequest(), types.ListRootsResult)
    except Exception as exc:  # a 2026-07-28 connection, a client error or a timeout: fall back to the start roots
        logger.info("MCP roots/list failed (%s); using the server's roots", exc)
        return None
    return paths_of(str(root.uri) for root in result.roots)


async def session_roots(session: Any) -> tuple[Path, ...] | None:
    """The roots a tool call of ``session`` is confined to, or None for the server's own (fixed at start).

    The client's declared roots plus the explicit ``--root`` directories. A client that declares roots but lists
    none gets the server's roots, as one that declares none.
    """
    if not _declares_roots(session):
        return None
    connection = _connection(session)
    declared = _cache.get(connection)
    if declared is None:
        declared = await _ask(session)
        if declared is None:
            return None
        _cache.put(connection, declared)
    if not declared:
        return None
    return tuple(dict.fromkeys((*declared, *guard.policy().explicit_roots)))


class RootsMiddleware:
    """Server middleware: confine each ``tools/call`` to its session's roots; forget them on ``list_changed``."""

    async def __call__(self, ctx: Any, call_next: Any) -> Any:
        if ctx.method == LIST_CHANGED:
            _cache.forget(_connection(ctx.session))  # asked again at the next tool call
            return await call_next(ctx)
        if ctx.method != "tools/call":
            return await call_next(ctx)
        roots = await session_roots(ctx.session)
        if roots is None:
            return await call_next(ctx)
        with using_roots(roots):
            return await call_next(ctx)


def install(server: Any) -> None:
    """Add the middleware to an ``MCPServer`` (once)."""
    if not any(isinstance(m, RootsMiddleware) for m in server.middleware):
        server.middleware.append(RootsMiddleware())
