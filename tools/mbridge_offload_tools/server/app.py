"""The ``mbridge-offload`` MCP server: the tools of references/tools.md, each a thin call into the library.

Each tool's parameters, title and description are its declaration's (``interface.tools``) and its body the CLI's
(``interface.calls``); the library's result models are the structured output. Start-up imports only the MCP SDK and
pydantic: the library (and torch, in subprocesses) load inside the tools. Run: ``mbridge-offload-mcp`` or
``mbridge-offload serve``.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import sys
from collections.abc import Callable
from typing import Annotated, Any

from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, ImageContent, TextContent, ToolAnnotations

from mbridge_offload import __version__
from mbridge_offload.actions.apply.result import ApplyResult
from mbridge_offload.actions.diagnose.diagnose import DiagnoseReport
from mbridge_offload.actions.testing.result import TestRunResult

# The library's own result models are the tools' structured output (one schema for library, CLI --json and MCP).
from mbridge_offload.config.validate import Report as ValidateOutput
from mbridge_offload.plan.results import Estimate, Recommendation
from mbridge_offload.plan.service import plan_answer
from mbridge_offload_tools.interface.build import declared
from mbridge_offload_tools.interface.calls import apply_answer, diagnose_answer, validate_answer, validate_seconds
from mbridge_offload_tools.interface.tools import TOOLS
from mbridge_offload_tools.plot.result import PlotResult
from mbridge_offload_tools.server import guard, roots
from mbridge_offload_tools.trace.result import TraceAnswer

logger = logging.getLogger(__name__)

INSTRUCTIONS = """\
CPU offloading for Megatron Bridge / Megatron Core training: optimizer-state offload (HybridDeviceOptimizer,
optimizer.optimizer_cpu_offload + optimizer.optimizer_offload_fraction) and layer-level activation offload
(model.cpu_offloading, needs PP=1, no recompute, no CUDA graphs).
Typical flow: validate_config on the user's YAML -> estimate_memory / recommend_mode for the GPU/parallelism
(answers list every assumption with its source; memory in GB and GiB) -> apply_offload
(dry run shows the diff; pass output or in_place to write) -> run_unit_tests (suite='parity' checks loss
parity on a tiny GPT) -> diagnose_failure with the error text when a run fails. plot_offload draws the planner's
answers as an image with their points: a sweep of one input (sweep='optimizer_offload_fraction=0:1:0.25'), the
phases of a step, or recommend's options.
Configs are a file path or inline YAML/JSON; overrides are Hydra-style, e.g.
optimizer.optimizer_offload_fraction=0.5. Fixes come back as override lists you can pass on a command line."""

mcp = MCPServer("mbridge-offload", version=__version__, instructions=INSTRUCTIONS)
roots.install(mcp)  # a client that declares MCP roots confines each call to them (roots.py)

READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
# Writes a file only when asked, inside the server's roots; may replace one (a backup is kept): destructive.
WRITES = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False)


def _tool(
    name: str, annotations: ToolAnnotations = READ_ONLY, deadline: Callable[..., float] | None = None
) -> Callable[[Callable[..., Any]], Any]:
    """Register ``fn`` as the MCP tool ``name``: its declared parameters, title and description (its subcommand's
    too), run in the guard (pool, deadline, errors)."""
    spec = TOOLS[name]

    def wrap(fn: Callable[..., Any]) -> Any:
        register = mcp.tool(title=spec.title, description=spec.description, annotations=annotations)
        return register(guard.guarded(deadline)(declared(name)(fn)))

    return wrap


@_tool("validate_config", deadline=validate_seconds)
def validate_config(**v: Any) -> ValidateOutput:
    return validate_answer(v)


@_tool("recommend_mode")
def recommend_mode(**v: Any) -> Recommendation:
    from mbridge_offload_tools.trace.confirm import recommend_answer  # its confirm re-checks options[0] with trace

    return recommend_answer(v)


@_tool("estimate_memory")
def estimate_memory(**v: Any) -> Estimate:
    return plan_answer("estimate", v)


# Runs megatron-core in a subprocess on fake tensors; reads the config, writes nothing.
@_tool("trace_memory", deadline=lambda v: float(v.get("deadline") or 300.0) + 30)
def trace_memory(**v: Any) -> TraceAnswer:
    from mbridge_offload_tools.trace.run import trace_answer

    return TraceAnswer.model_validate(trace_answer(v))


# A second identical write is refused: not idempotent.
@_tool("apply_offload", WRITES)
def apply_offload(**v: Any) -> ApplyResult:
    return apply_answer(v, write_roots=guard.policy().write_roots())


# Runs code (pytest in a subprocess; with bridge_repo, a checkout's tests the server was started to allow): not
# read-only, and open-world because that code is not this server's.
@_tool(
    "run_unit_tests",
    ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=True),
    deadline=lambda v: float(v.get("timeout_s") or 600) + 30,
)
def run_unit_tests(ctx: Context, **v: Any) -> TestRunResult:
    import anyio.from_thread

    from mbridge_offload.actions.testing.result import TestSuiteError
    from mbridge_offload.actions.testing.suite import run_tests
    from mbridge_offload.config.sources import ConfigError

    def progress(done: int, total: int | None, message: str) -> None:
        try:
            anyio.from_thread.run(ctx.report_progress, float(done), float(total) if total else None, message)
        except Exception:  # progress is best effort; never fail the run for it
            logger.debug("progress report failed", exc_info=True)

    repo = v.pop("bridge_repo")
    repo = guard.check_bridge_repo(repo) if repo is not None else None
    try:
        return run_tests(**v, bridge_repo=repo, repo_python=guard.policy().bridge_venv, on_progress=progress)
    except (TestSuiteError, ConfigError) as exc:
        raise ToolError(str(exc)) from None


@_tool("diagnose_failure")
def diagnose_failure(**v: Any) -> DiagnoseReport:
    return diagnose_answer(v)


@_tool("plot_offload", WRITES)
def plot_offload(**v: Any) -> Annotated[CallToolResult, PlotResult]:
    from mbridge_offload_tools.plot.run import plot_answer

    # PNG by default: agent hosts show PNG image content to the model.
    result, data = plot_answer(v, guard.policy().write_roots(), default_format="png", default_file=False)
    structured = result.model_dump(mode="json")
    image = ImageContent(type="image", data=base64.b64encode(data).decode("ascii"), mime_type=result.mime_type)
    text = TextContent(type="text", text=json.dumps(structured))  # for clients that read text content only
    return CallToolResult(content=[image, text], structured_content=structured)


# ---------------------------------------------------------------------------------------------- entry points


def run(
    transport: str = "stdio",
    host: str = "127.0.0.1",
    port: int = 8765,
    roots: list[str] | None = None,
    bridge_repos: list[str] | None = None,
    bridge_venv: bool = False,
) -> None:
    """Serve over ``stdio`` or ``streamable-http`` (on ``host:port``, path ``/mcp``), contained as ``guard.configure``
    says (``roots``, ``bridge_repos``, ``bridge_venv``)."""
    if transport not in ("stdio", "streamable-http"):
        raise ValueError(f"transport {transport!r} is not one of stdio, streamable-http")
    guard.configure(roots or [], bridge_repos or [], bridge_venv)
    # validate runs megatron-core itself by default: its warm worker imports torch and megatron-core now, while the
    # client connects, so that a validate_config call costs the check only (docs/benchmarks-validate.md).
    from mbridge_offload_tools.exact.run import start

    start()
    # Started by hand, the server would otherwise look hung. stderr only: on stdio, stdout is the protocol.
    if transport == "stdio":
        sys.stderr.write(
            "mbridge-offload MCP server: waiting for an MCP client on stdio (stdin/stdout carry the protocol; "
            "an MCP client such as Claude Code or the MCP inspector starts this command). Ctrl-C stops it.\n"
        )
        sys.stderr.flush()
        mcp.run("stdio")
    else:
        sys.stderr.write(f"mbridge-offload MCP server: streamable HTTP on http://{host}:{port}/mcp. Ctrl-C stops it.\n")
        sys.stderr.flush()
        mcp.run("streamable-http", host=host, port=port)


def build_parser() -> argparse.ArgumentParser:
    """The ``mbridge-offload-mcp`` command line (the same flags as ``mbridge-offload serve``)."""
    parser = argparse.ArgumentParser(prog="mbridge-offload-mcp", description="MCP server for mbridge-offload")
    guard.add_server_flags(parser)
    parser.add_argument("--version", action="version", version=f"mbridge-offload-mcp {__version__}")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Console script ``mbridge-offload-mcp``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from mbridge_offload.config.errors import InputError

    try:
        run(args.transport, args.host, args.port, args.roots, args.bridge_repos, args.allow_bridge_venv)
    except InputError as exc:
        parser.exit(2, f"mbridge-offload-mcp: error: {exc}\n")


if __name__ == "__main__":
    main()
