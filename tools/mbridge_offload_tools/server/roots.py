"""The MCP client's roots: asked for when the client declares them, followed when it says they changed.

A client that declares the ``roots`` capability is asked ``roots/list`` once per connection (again after
``notifications/roots/list_changed``), and each tool call runs confined to those directories plus the server's
``--root`` flags. A client that declares none, or cannot be asked (a 2026-07-28 connection), gets the roots
fixed at start."""

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
    """The local directories behind ``file://`` root URIs (symlinks resolved); other schemes are skipped."""
    out: list[Path] = []
    for uri in uris:
        parsed = urlparse(str(uri))
        if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
            logger.info("ignoring MCP root %s: not a local file:// directory", uri)
            continue
        out.append(Path(unquote(parsed.path)).resolve())
    return tuple(dict.fromkeys(out))


# Per connection (one per client, so a closed connection's entry goes with it): the roots its client declared.
_cache: weakref.WeakKeyDictionary[Any, tuple[Path, ...]] = weakref.WeakKeyDictionary()


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
    """The roots a tool call of ``session`` is confined to (the client's plus ``--root``), or None for the server's
    own: a client that declares no roots, or lists none."""
    if not _declares_roots(session):
        return None
    connection = _connection(session)
    declared = _cache.get(connection)
    if declared is None:
        declared = await _ask(session)
        if declared is None:
            return None
        _cache[connection] = declared
    if not declared:
        return None
    return tuple(dict.fromkeys((*declared, *guard.policy().explicit_roots)))


class RootsMiddleware:
    """Server middleware: confine each ``tools/call`` to its session's roots; forget them on ``list_changed``."""

    async def __call__(self, ctx: Any, call_next: Any) -> Any:
        if ctx.method == LIST_CHANGED:
            _cache.pop(_connection(ctx.session), None)  # asked again at the next tool call
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
