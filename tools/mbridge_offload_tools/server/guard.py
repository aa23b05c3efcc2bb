"""What the MCP server may touch, fixed when it starts, and the guard every tool call runs through.

Containment never comes from a tool argument (docs/security.md). The guard: a bounded thread pool, a deadline, and
every failure as one ``ToolError`` in the CLI's words.

``roots``: the launch directory plus ``--root``/``$MBRIDGE_OFFLOAD_ROOTS`` (a client's declared MCP roots replace the
launch directory per session: ``roots.py``); ``bridge_repos``: checkouts whose tests may run (importing their
``conftest.py`` runs code); ``bridge_venv``: run those with the checkout's own ``.venv`` Python.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mbridge_offload.config.errors import DeadlineError
from mbridge_offload_tools.cli.common import EXIT_INTERNAL, error_payload

ROOTS_ENV = "MBRIDGE_OFFLOAD_ROOTS"
BRIDGE_REPOS_ENV = "MBRIDGE_OFFLOAD_BRIDGE_REPOS"
BRIDGE_VENV_ENV = "MBRIDGE_OFFLOAD_ALLOW_BRIDGE_VENV"
WORKERS = 4  # tool calls running at once; more wait for a slot (and for their deadline)


@dataclass(frozen=True)
class Policy:
    """What this server may touch. ``roots`` None = the working directory of each call (in-process use only)."""

    roots: tuple[Path, ...] | None = None
    bridge_repos: tuple[Path, ...] = ()
    bridge_venv: bool = False
    explicit_roots: tuple[Path, ...] = ()  # --root / MBRIDGE_OFFLOAD_ROOTS: kept when a client declares roots

    def write_roots(self) -> list[Path]:
        """Where a tool may write now: the calling session's roots (:mod:`roots`), else the server's."""
        from mbridge_offload.config.reading import read_roots

        current = read_roots()
        if current is not None:
            return list(current)
        return list(self.roots) if self.roots is not None else [Path.cwd().resolve()]


_policy = Policy()


def _paths(items: Iterable[str]) -> tuple[Path, ...]:
    out = []
    for item in items:
        path = Path(item).expanduser().resolve()
        if not path.is_dir():
            from mbridge_offload.config.errors import InputError

            raise InputError(f"serve: {item} is not a directory", "pass an existing directory")
        out.append(path)
    return tuple(out)


def configure(roots: Iterable[str] = (), bridge_repos: Iterable[str] = (), bridge_venv: bool = False) -> Policy:
    """Fix the policy at server start from the flags and the environment; reading is contained to the roots."""
    from mbridge_offload.config.reading import set_read_roots

    global _policy
    env_roots = [r for r in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if r]
    env_repos = [r for r in os.environ.get(BRIDGE_REPOS_ENV, "").split(os.pathsep) if r]
    explicit = _paths([*roots, *env_roots])
    chosen = tuple(dict.fromkeys((Path.cwd().resolve(), *explicit)))  # the launch directory plus the explicit ones
    _policy = Policy(
        roots=chosen,
        explicit_roots=explicit,
        bridge_repos=_paths([*bridge_repos, *env_repos]),
        bridge_venv=bridge_venv or os.environ.get(BRIDGE_VENV_ENV, "") == "1",
    )
    set_read_roots(chosen)
    return _policy


def policy() -> Policy:
    """The policy in force."""
    return _policy


def check_bridge_repo(repo: str) -> Path:
    """``repo`` resolved, if the server was started allowing it (else InputError)."""
    from mbridge_offload.config.errors import InputError

    resolved = Path(repo).expanduser().resolve()
    if resolved not in _policy.bridge_repos:
        allowed = ", ".join(str(p) for p in _policy.bridge_repos) or "none"
        raise InputError(
            f"bridge_repo {repo}: this server may not run that checkout's tests (allowed: {allowed}); running "
            "them imports its conftest.py",
            "ask the user to restart the server with --allow-bridge-repo DIR, or run `mbridge-offload test "
            "--bridge-repo DIR` in a shell",
        )
    return resolved


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """How the server is reached, and what it may touch (``mbridge-offload serve`` and ``mbridge-offload-mcp``)."""
    parser.add_argument(
        "--transport",
        choices=("stdio", "streamable-http"),
        default="stdio",
        help="stdio (default; what agent clients start) or streamable-http (served at http://HOST:PORT/mcp)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="streamable-http: address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8765, help="streamable-http: port (default 8765)")
    parser.add_argument(
        "--root",
        dest="roots",
        action="append",
        default=[],
        metavar="DIR",
        help=f"a directory tools may read configs from and write to (repeatable; also ${ROOTS_ENV}; "
        "added to the launch directory, or to the roots an MCP client declares)",
    )
    parser.add_argument(
        "--allow-bridge-repo",
        dest="bridge_repos",
        action="append",
        default=[],
        metavar="DIR",
        help="a Megatron Bridge checkout whose tests run_unit_tests may run (imports its conftest.py; repeatable; "
        f"also ${BRIDGE_REPOS_ENV})",
    )
    parser.add_argument(
        "--allow-bridge-venv",
        action="store_true",
        help=f"run an allowed checkout's tests with its own .venv/bin/python (also ${BRIDGE_VENV_ENV}=1)",
    )


# ---------------------------------------------------------------------------------------------- the guard

_limiter: Any = None


def _pool():
    global _limiter
    if _limiter is None:
        import anyio

        _limiter = anyio.CapacityLimiter(WORKERS)
    return _limiter


def guarded(deadline: Callable[[dict[str, Any]], float] | None = None):
    """Decorator: run a sync tool in the bounded pool under ``deadline(kwargs)`` seconds (default
    ``MBRIDGE_OFFLOAD_DEADLINE_S``); every failure becomes one ToolError."""

    def wrap(fn):
        @functools.wraps(fn)
        async def tool(*args: Any, **kwargs: Any) -> Any:
            import anyio
            from mcp.server.mcpserver.exceptions import ToolError

            from mbridge_offload.config.reading import DEADLINE_ENV, deadline_s

            stdin = [k for k in ("config", "before", "after") if kwargs.get(k) == "-"]
            if stdin:  # on the CLI '-' reads stdin; a server's stdin may be the protocol itself
                raise ToolError(f"{stdin[0]} '-' (stdin) is the CLI's; over MCP pass the file's path or the YAML text")
            try:
                seconds = deadline(kwargs) if deadline else deadline_s()
                with anyio.fail_after(seconds):
                    return await anyio.to_thread.run_sync(
                        functools.partial(fn, *args, **kwargs), limiter=_pool(), abandon_on_cancel=True
                    )
            except ToolError:
                raise
            except TimeoutError:
                error = DeadlineError(
                    f"{fn.__name__}: no answer within {seconds:g} s", f"pass a smaller input, or raise {DEADLINE_ENV}"
                )
                raise ToolError(str(error)) from None
            except Exception as exc:  # the one place any failure becomes the one error shape
                payload, code = error_payload(exc, "input")
                if code == EXIT_INTERNAL:  # a bug: the caller gets one line, the server log the traceback
                    logging.getLogger(__name__).error("%s failed", fn.__name__, exc_info=exc)
                raise ToolError(payload["error"]) from None  # the CLI's words

        return tool

    return wrap
