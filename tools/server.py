"""The ``mbridge-offload`` MCP server: five tools over the offload library, for coding agents.

Each tool is a thin call into ``offload/`` with a pydantic output model (structured output) and annotations.
Bad input raises ``ToolError`` with a message that names the key, the value and the fix, so the model can
correct itself; other exceptions are bugs and the SDK hides their text.

Start-up stays fast: this module imports only the MCP SDK and pydantic; the library (and torch, for the
parity suite only, in a subprocess) is imported inside the tools.

Run: ``mbridge-offload-mcp`` (stdio), ``mbridge-offload-mcp --transport streamable-http --port 8765``, or
``mbridge-offload serve``.
"""

from __future__ import annotations

import argparse
import logging
from typing import Annotated, Any, Literal

from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

from mbridge_offload import __version__

# The library's own result models are the tools' structured output (one schema for library, CLI --json and MCP).
from mbridge_offload.config.validate import Finding as FindingModel
from mbridge_offload.config.validate import Report as ValidateOutput

logger = logging.getLogger(__name__)

INSTRUCTIONS = """\
CPU offloading for Megatron Bridge / Megatron Core training: optimizer-state offload (HybridDeviceOptimizer,
optimizer.optimizer_cpu_offload + optimizer.optimizer_offload_fraction) and layer-level activation offload
(model.cpu_offloading, needs PP=1, no recompute, no CUDA graphs).
Typical flow: validate_config on the user's YAML -> recommend_mode for the GPU/parallelism -> apply_offload
(dry run shows the diff; pass output or in_place to write) -> run_unit_tests (suite='parity' checks loss
parity on a tiny GPT) -> diagnose_failure with the error text when a run fails.
Configs are a file path or inline YAML/JSON; overrides are Hydra-style, e.g.
optimizer.optimizer_offload_fraction=0.5. Fixes come back as override lists you can pass on a command line."""

mcp = MCPServer("mbridge-offload", version=__version__, instructions=INSTRUCTIONS)

ConfigArg = Annotated[
    str, Field(description="a Bridge YAML/JSON config: a file path, or the YAML/JSON text itself", min_length=1)
]
OverridesArg = Annotated[
    list[str],
    Field(description="Hydra-style overrides applied first, e.g. ['optimizer.optimizer_offload_fraction=0.5']"),
]


# ---------------------------------------------------------------------------------------------- models


class MemoryBreakdown(BaseModel):
    weights: float | None = None
    gradients: float | None = None
    optimizer: float | None = None
    activations: float | None = None
    other: float | None = None
    total: float | None = None


class MemoryBeforeAfter(BaseModel):
    before: MemoryBreakdown
    after: MemoryBreakdown


class RecommendOutput(BaseModel):
    mode: Literal["none", "optimizer", "activation", "both"]
    overrides: list[str]
    memory_gb: MemoryBeforeAfter
    fits: bool
    step_time_factor: float
    rationale: list[str]


class ChangeModel(BaseModel):
    key: str
    old: Any = None
    new: Any = None
    why: str


class ApplyOutput(BaseModel):
    ok: bool = Field(description="the edited config passes validation")
    mode: str = Field(description="the mode applied (the planner's choice for mode=recommended)")
    changes: list[ChangeModel]
    findings: list[FindingModel]
    written: str | None = Field(description="the path written, or null for a dry run / refusal")
    backup: str | None = None
    diff: str = Field(description="unified diff of the config")
    overrides: list[str] = Field(description="the same edit as command-line overrides")
    refused: str | None = Field(None, description="why nothing was written although a write was asked for")
    notes: list[str] = []


class TestResultModel(BaseModel):
    nodeid: str
    outcome: str
    duration_s: float = 0.0


class FailureModel(BaseModel):
    nodeid: str
    message: str | None = None


class TestRunOutput(BaseModel):
    ok: bool = Field(description="everything selected passed and at least one test ran")
    suite: str
    passed: int
    failed: int
    skipped: int
    errors: int
    selected: int | None
    duration_s: float
    nothing_selected: bool = Field(description="true when the selection matched no test (pytest exit 5)")
    timed_out: bool
    tests: list[TestResultModel]
    failures: list[FailureModel]
    command: list[str]
    notes: list[str]
    details: dict[str, Any] | None = Field(None, description="parity suite: loss delta, split, bytes, step ratio")


class MatchModel(BaseModel):
    failure: str = Field(description="failure-mode id")
    title: str
    cause: str
    confirm: str = Field(description="how to confirm this is the cause")
    fix: list[str] = Field(description="overrides that fix it (may be empty when the fix is not a config key)")
    actions: list[str] = Field(description="other steps: upgrades, environment changes, alternatives")
    evidence: str | None = None
    source: str
    references: list[str] = []


class DiagnoseOutput(BaseModel):
    matches: list[MatchModel]
    findings: list[FindingModel]
    comparison: dict[str, Any] | None = Field(
        None, description="with before/after: changed offload keys and predicted per-GPU memory"
    )
    notes: list[str]


# ---------------------------------------------------------------------------------------------- helpers


def _load(config: str, overrides: list[str] | None, what: str = "config"):
    from mbridge_offload.config.sources import ConfigError, load

    try:
        return load(config, overrides or [])
    except ConfigError as exc:
        raise ToolError(f"{what}: {exc}") from None


def _tool_errors(fn):
    """Turn the library's bad-input exceptions into ToolError so their message reaches the model."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from mbridge_offload.actions.testsuite import TestSuiteError
        from mbridge_offload.config.sources import ConfigError

        try:
            return fn(*args, **kwargs)
        except ToolError:
            raise
        except (ConfigError, TestSuiteError) as exc:
            raise ToolError(str(exc)) from None

    return wrapper


def _recommend(loaded: Any, flags: dict[str, Any]) -> dict[str, Any]:
    from mbridge_offload.plan import planner as plan

    rec = plan.recommend_for_inputs(
        config=loaded.config if loaded else None, raw=loaded.raw if loaded else None, **flags
    )
    return rec.to_json()


# ---------------------------------------------------------------------------------------------- tools


@mcp.tool(
    title="Validate a CPU-offloading config",
    annotations=ToolAnnotations(
        read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False
    ),
)
@_tool_errors
def validate_config(
    config: Annotated[
        str | None,
        Field(description="a Bridge YAML/JSON config: a file path, or the YAML/JSON text itself (or pass recipe)"),
    ] = None,
    overrides: OverridesArg = [],  # noqa: B006 - pydantic copies defaults
    target: Annotated[str, Field(description="megatron-core release to check against")] = "megatron-core==0.19.2",
    exact: Annotated[
        bool,
        Field(
            description="also build the real megatron-core configs with the megatron-core installed on the server "
            "(a subprocess, ~10-30 s) and report every error it raises verbatim (origin mcore)"
        ),
    ] = False,
    recipe: Annotated[
        str | None,
        Field(
            description="instead of config: a Megatron Bridge recipe function (e.g. llama3_8b_pretrain_config), "
            "built for real where megatron-bridge is importable; the server keeps its imports warm between calls"
        ),
    ] = None,
) -> ValidateOutput:
    """Check a Megatron Bridge config's offload settings against every upstream rule.

    Returns findings with the upstream message, the keys involved and the fix as overrides.
    """
    from mbridge_offload.config.sources import ConfigError, load
    from mbridge_offload.config.validate import validate

    if (config is None) == (recipe is None):
        raise ToolError("give exactly one of config (a Bridge YAML/JSON path or text) or recipe (a recipe name)")
    if recipe is not None:
        try:  # imported once per server process: the second call of a recipe costs its build, not its imports
            loaded = load(None, overrides, recipe=recipe)
        except ConfigError as exc:
            raise ToolError(f"recipe: {exc}") from None
    else:
        loaded = _load(config, overrides)
    try:
        report = validate(loaded.config, loaded.raw, target=target)
    except ValueError as exc:
        raise ToolError(f"target {target!r}: {exc}") from None
    report.source = loaded.source
    if exact:
        from mbridge_offload_tools.exact import ExactUnavailable, exact_report

        try:
            report = exact_report(report, loaded.raw)
        except ExactUnavailable as exc:
            raise ToolError(str(exc)) from None
    return report


@mcp.tool(
    title="Recommend an offload mode",
    annotations=ToolAnnotations(
        read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False
    ),
)
@_tool_errors
def recommend_mode(
    config: Annotated[
        str | None, Field(description="optional config (path or text); its model and parallelism are used")
    ] = None,
    overrides: OverridesArg = [],  # noqa: B006
    model: Annotated[str | None, Field(description="model preset, e.g. qwen3-30b-a3b, llama3-8b")] = None,
    gpu: Annotated[str | None, Field(description="GPU preset, e.g. h100-80gb, h200-141gb")] = None,
    gpu_memory_gb: Annotated[float | None, Field(gt=0, description="GPU memory instead of a preset")] = None,
    num_gpus: Annotated[int | None, Field(ge=1)] = None,
    tp: Annotated[int | None, Field(ge=1)] = None,
    pp: Annotated[int | None, Field(ge=1)] = None,
    ep: Annotated[int | None, Field(ge=1)] = None,
    etp: Annotated[int | None, Field(ge=1)] = None,
    cp: Annotated[int | None, Field(ge=1)] = None,
    vpp: Annotated[int | None, Field(ge=1)] = None,
    seq_length: Annotated[int | None, Field(ge=1)] = None,
    micro_batch_size: Annotated[int | None, Field(ge=1)] = None,
) -> RecommendOutput:
    """Pick the smallest offload that makes the run fit: none, optimizer (with a fraction), activation, or both.

    Returns the overrides, per-GPU memory before/after, whether it fits, the step-time factor and why.
    """
    flags = {
        "model": model,
        "gpu": gpu,
        "gpu_memory_gb": gpu_memory_gb,
        "num_gpus": num_gpus,
        "tp": tp,
        "pp": pp,
        "ep": ep,
        "etp": etp,
        "cp": cp,
        "vpp": vpp,
        "seq_length": seq_length,
        "micro_batch_size": micro_batch_size,
    }
    if config is None and model is None:
        raise ToolError(
            "no model: pass model (a preset such as qwen3-30b-a3b or llama3-8b) or config (a Bridge "
            "YAML path or text with the model section)"
        )
    loaded = _load(config, overrides) if config is not None else None
    if loaded is None and overrides:
        raise ToolError("overrides need a config to apply to; pass config (path or YAML text) too")
    try:
        data = _recommend(loaded, {k: v for k, v in flags.items() if v is not None})
    except (ValueError, KeyError) as exc:
        raise ToolError(str(exc).strip("'\"")) from None
    return RecommendOutput.model_validate(data)


@mcp.tool(
    title="Apply an offload mode to a config",
    annotations=ToolAnnotations(
        read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=False
    ),
)
@_tool_errors
def apply_offload(
    config: ConfigArg,
    mode: Annotated[
        Literal["optimizer", "activation", "both", "none", "recommended"],
        Field(description="what to switch on; 'recommended' asks the planner"),
    ],
    fraction: Annotated[
        float | None, Field(gt=0, le=1, description="optimizer_offload_fraction (optimizer/both)")
    ] = None,
    num_layers: Annotated[int | None, Field(ge=1, description="cpu_offloading_num_layers (activation/both)")] = None,
    overrides: OverridesArg = [],  # noqa: B006
    output: Annotated[str | None, Field(description="write the edited config to this new path")] = None,
    in_place: Annotated[bool, Field(description="overwrite the config file (a .bak backup is kept)")] = False,
    format: Annotated[Literal["yaml", "overrides"], Field(description="what a write contains")] = "yaml",
    gpu: Annotated[str | None, Field(description="mode=recommended: GPU preset, e.g. h100-80gb")] = None,
    gpu_memory_gb: Annotated[float | None, Field(gt=0, description="mode=recommended: GPU memory (GB)")] = None,
    num_gpus: Annotated[int | None, Field(ge=1, description="mode=recommended: number of GPUs")] = None,
    allowed_root: Annotated[
        str | None,
        Field(
            description="an extra directory writes may go to (by default only "
            "the config's directory and the working directory)"
        ),
    ] = None,
) -> ApplyOutput:
    """Edit a config to enable (or disable) CPU offloading, resolving the conflicts the mode implies.

    Always returns the unified diff, the override list and each change with its reason; writes only with output
    or in_place, atomically, and never a config that fails validation. Comments and key order are preserved.
    """
    from mbridge_offload.actions.apply import apply_offload as run_apply

    planner = {"gpu": gpu, "gpu_memory_gb": gpu_memory_gb, "num_gpus": num_gpus}
    try:
        from mbridge_offload.plan.hardware import gpu_preset

        if gpu is not None:
            gpu_preset(gpu)
    except KeyError as exc:
        raise ToolError(str(exc).strip("'\"")) from None
    result = run_apply(
        config,
        mode,
        fraction=fraction,
        num_layers=num_layers,
        overrides=overrides,
        output=output,
        in_place=in_place,
        output_format=format,
        allowed_root=allowed_root,
        planner={k: v for k, v in planner.items() if v is not None} or None,
    )
    data = result.to_dict()
    data.pop("why", None)
    return ApplyOutput.model_validate(data)


@mcp.tool(
    title="Run the offload unit tests",
    annotations=ToolAnnotations(
        read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False
    ),
)
def run_unit_tests(
    ctx: Context,
    k: Annotated[str | None, Field(description="pytest -k expression, e.g. 'apply or diagnose'")] = None,
    bridge_repo: Annotated[
        str | None, Field(description="a Megatron Bridge checkout: run its offload tests instead of ours")
    ] = None,
    suite: Annotated[
        Literal["unit", "parity"],
        Field(description="unit = pytest; parity = tiny-GPT loss parity with vs without offload"),
    ] = "unit",
    config: Annotated[str | None, Field(description="parity: the config whose offload settings to train")] = None,
    steps: Annotated[int | None, Field(ge=2, le=500, description="parity: training steps per run")] = None,
    timeout_s: Annotated[float, Field(gt=0, le=3600, description="wall-clock limit")] = 600,
    path: Annotated[
        str | None, Field(description="one test file/folder/node id under tests/, e.g. tests/actions/test_apply.py")
    ] = None,
) -> TestRunOutput:
    """Run tests in a subprocess and report counts, durations and failing node ids with the failure text.

    Progress is reported as each test finishes. A selection that matches nothing is reported as
    nothing_selected (ok=false), never as success.
    """
    import anyio.from_thread

    from mbridge_offload.actions.testsuite import TestSuiteError, run_tests
    from mbridge_offload.config.sources import ConfigError

    def progress(done: int, total: int | None, message: str) -> None:
        try:
            anyio.from_thread.run(ctx.report_progress, float(done), float(total) if total else None, message)
        except Exception:  # progress is best effort; never fail the run for it
            logger.debug("progress report failed", exc_info=True)

    try:
        result = run_tests(
            k=k,
            bridge_repo=bridge_repo,
            suite=suite,
            timeout_s=timeout_s,
            on_progress=progress,
            config=config,
            steps=steps,
            path=path,
        )
    except (TestSuiteError, ConfigError) as exc:
        raise ToolError(str(exc)) from None
    return TestRunOutput.model_validate(result.to_dict())


@mcp.tool(
    title="Diagnose an offload failure",
    annotations=ToolAnnotations(
        read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False
    ),
)
@_tool_errors
def diagnose_failure(
    error: Annotated[str | None, Field(description="the error message or traceback")] = None,
    log: Annotated[str | None, Field(description="a log excerpt around the failure")] = None,
    config: Annotated[str | None, Field(description="the failing run's config (path or text)")] = None,
    before: Annotated[str | None, Field(description="config before the change that broke the run")] = None,
    after: Annotated[str | None, Field(description="config after that change")] = None,
) -> DiagnoseOutput:
    """Match an error or log against the known offload failure modes: cause, how to confirm, fix as overrides.

    With before/after configs it also lists the offload keys that changed and the predicted memory change.
    """
    from mbridge_offload.actions.diagnose import diagnose

    if not any((error, log, config, before, after)):
        raise ToolError(
            "nothing to diagnose: pass error (the message), log (an excerpt), and/or config, or "
            "before and after configs"
        )
    if (before is None) != (after is None):
        raise ToolError("pass both before and after (two configs around the change), or neither")
    loaded = _load(config, None) if config else None
    b = _load(before, None, "before") if before else None
    a = _load(after, None, "after") if after else None
    report = diagnose(
        error=error,
        log=log,
        config=loaded.config if loaded else None,
        raw=loaded.raw if loaded else None,
        before=b.config if b else None,
        after=a.config if a else None,
    )
    return DiagnoseOutput.model_validate(report.to_dict())


# ---------------------------------------------------------------------------------------------- entry points


def run(transport: str = "stdio", host: str = "127.0.0.1", port: int = 8765) -> None:
    """Serve over ``stdio`` or ``streamable-http`` (on ``host:port``, path ``/mcp``)."""
    if transport == "stdio":
        mcp.run("stdio")
    elif transport == "streamable-http":
        mcp.run("streamable-http", host=host, port=port)
    else:
        raise ValueError(f"transport {transport!r} is not one of stdio, streamable-http")


def main(argv: list[str] | None = None) -> None:
    """Console script ``mbridge-offload-mcp``."""
    parser = argparse.ArgumentParser(prog="mbridge-offload-mcp", description="MCP server for mbridge-offload")
    parser.add_argument("--transport", choices=("stdio", "streamable-http"), default="stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--version", action="version", version=f"mbridge-offload-mcp {__version__}")
    args = parser.parse_args(argv)
    run(args.transport, args.host, args.port)


if __name__ == "__main__":
    main()
