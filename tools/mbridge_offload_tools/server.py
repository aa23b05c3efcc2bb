"""The ``mbridge-offload`` MCP server: its tools (references/tools.md) over the offload library, for coding agents.

Each tool is a thin call into ``offload/`` with a pydantic output model (structured output) and annotations.
Bad input raises ``ToolError`` with a message that names the key, the value and the fix, so the model can
correct itself. Any other exception is a bug: the guard answers ``isError`` with one line,
``input: internal error (<Type>: <first line>); please report it`` (the CLI's ``kind: "internal"``, exit 3), and
logs the traceback to the server log, never to the client.

Start-up stays fast: this module imports only the MCP SDK and pydantic; the library (and torch, for the
parity suite only, in a subprocess) is imported inside the tools.

Run: ``mbridge-offload-mcp`` (stdio), ``mbridge-offload-mcp --transport streamable-http --port 8765``, or
``mbridge-offload serve``.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
from typing import Annotated, Any, Literal

from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from mbridge_offload import __version__
from mbridge_offload.actions.apply_result import ApplyResult
from mbridge_offload.actions.diagnose import DiagnoseReport
from mbridge_offload.actions.testresult import TestRunResult

# The library's own result models are the tools' structured output (one schema for library, CLI --json and MCP).
from mbridge_offload.config.validate import Report as ValidateOutput
from mbridge_offload.plan.results import Estimate, Recommendation
from mbridge_offload_tools import guard, roots
from mbridge_offload_tools.plot import tool as plot_tool

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

ConfigArg = Annotated[
    str, Field(description="a Bridge YAML/JSON config: a file path, or the YAML/JSON text itself", min_length=1)
]
OverridesArg = Annotated[
    list[str],
    Field(description="Hydra-style overrides applied first, e.g. ['optimizer.optimizer_offload_fraction=0.5']"),
]
TeVersionArg = Annotated[
    str | None,
    Field(
        description="the Transformer Engine release the training cluster runs, e.g. '2.9' or '2.10.0' (the CLI's "
        "--env te_version=X.Y); the TE-dependent rules (activation offload v1/v2, fine-grained NVTE_CPU_OFFLOAD_V1) "
        "read it. Default: assumed 2.18, the release Megatron Bridge 0.6.2 pins (env.te_version_source says so)"
    ),
]


# ---------------------------------------------------------------------------------------------- helpers


def _load(config: str, overrides: list[str] | None, what: str = "config"):
    from mbridge_offload.config.sources import ConfigError, load

    try:
        return load(config, overrides or [])
    except ConfigError as exc:  # the CLI's text, word for word; before/after say which config they mean
        raise ToolError(str(exc) if what == "config" else f"{what}: {exc}") from None


def _plan_input_parameters(exclude: frozenset[str] = frozenset()) -> list[inspect.Parameter]:
    """Every ``PlanInputs`` field as a keyword parameter (type, bounds and description taken from it: one declaration
    for the library, the CLI and MCP); ``exclude`` names those a tool spells otherwise."""
    from mbridge_offload.plan.inputs.fields import PlanInputs, help_text

    # ``Annotated`` built at run time from each field: a type expression for the SDK, not for the checker.
    annotated: Any = Annotated
    return [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=annotated[(info.annotation, *info.metadata, Field(description=help_text(name)))],
        )
        for name, info in PlanInputs.model_fields.items()
        if name not in exclude
    ]


def _plan_parameters() -> list[inspect.Parameter]:
    """The planner tools' parameters: a config, overrides, Megatron-LM argv, and every ``PlanInputs`` field."""
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [
        inspect.Parameter(
            "config",
            kw,
            default=None,
            annotation=Annotated[
                str | None,
                Field(
                    description="optional Bridge config (path or YAML/JSON text); a model preset fills what it lacks"
                ),
            ],
        ),
        inspect.Parameter("overrides", kw, default=[], annotation=OverridesArg),
        inspect.Parameter(
            "megatron_args",
            kw,
            default=None,
            annotation=Annotated[
                str | None, Field(description="Megatron-LM pretrain_gpt.py flags instead of a config")
            ],
        ),
    ]
    return params + _plan_input_parameters()


def _plan(kind: str, args: dict[str, Any]) -> Any:
    """Resolve the planner inputs (one path: preset, config, argv, parameters) and run estimate or recommend."""
    from mbridge_offload.plan.service import plan

    config_, raw, source = _plan_source(args)
    try:
        return plan(kind, args, config_, raw, source)  # type: ignore[arg-type]
    except (ValueError, KeyError) as exc:
        raise ToolError(str(exc).strip("'\"")) from None


def _plan_source(args: dict[str, Any]) -> tuple[Any, Any, Any]:
    """Take ``config``, ``overrides`` and ``megatron_args`` out of a planner tool's arguments and load them:
    ``(config, raw, source)``, or Nones when only planner inputs were given."""
    import shlex

    from mbridge_offload.config.sources import ConfigError, load

    config, overrides, argv = (
        args.pop("config", None),
        args.pop("overrides", None) or [],
        args.pop("megatron_args", None),
    )
    if config is None and argv is None and args.get("model") is None and args.get("num_layers") is None:
        raise ToolError(
            "no model: pass model (a preset such as qwen3-30b-a3b or llama3-8b), config (a Bridge YAML path or "
            "text with the model section), or megatron_args"
        )
    if config is not None and argv is not None:
        raise ToolError("pass either config or megatron_args, not both")
    if overrides and config is None and argv is None:
        raise ToolError("overrides need a config to apply to; pass config (path or YAML text) too")
    try:
        loaded = load(argv=shlex.split(argv), overrides=overrides) if argv is not None else None
        loaded = _load(config, overrides) if config is not None else loaded
    except (ValueError, KeyError, ConfigError) as exc:
        raise ToolError(str(exc).strip("'\"")) from None
    return (loaded.config, loaded.raw, loaded.source) if loaded else (None, None, None)


def _plan_tool(kind: str, output: type, doc: str, title: str) -> None:
    """Register a planner tool whose parameters are generated from ``PlanInputs``."""

    def tool(**kwargs: Any) -> Any:
        return _plan(kind, dict(kwargs))

    tool.__name__ = {"estimate": "estimate_memory", "recommend": "recommend_mode"}[kind]
    tool.__doc__ = doc
    tool.__signature__ = inspect.Signature(_plan_parameters(), return_annotation=output)  # type: ignore[attr-defined]
    mcp.tool(
        title=title,
        annotations=ToolAnnotations(
            read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False
        ),
    )(guard.guarded()(tool))


# ---------------------------------------------------------------------------------------------- tools


@mcp.tool(
    title="Validate a CPU-offloading config",
    annotations=ToolAnnotations(
        read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False
    ),
)
@guard.guarded()
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
            description="also build the real megatron-core configs with the target's megatron-core on the server "
            "(its environment's, or .mcore/<version> from scripts/setup; a subprocess, ~10-30 s) and report every "
            "error it raises verbatim (origin mcore) and the release that ran (MCORE-EXACT-VERSION)"
        ),
    ] = False,
    recipe: Annotated[
        str | None,
        Field(
            description="instead of config: a Megatron Bridge recipe function (e.g. llama3_8b_pretrain_config), "
            "built for real where megatron-bridge is importable; the server keeps its imports warm between calls"
        ),
    ] = None,
    megatron_args: Annotated[
        str | None,
        Field(
            description="instead of config: a Megatron-LM pretrain_gpt.py command line, e.g. '--num-layers 4 "
            "--cpu-offloading-num-layers 4'; fixes then come back as flags (fix: add or set, fix_remove: delete)"
        ),
    ] = None,
    te_version: TeVersionArg = None,
) -> ValidateOutput:
    """Check a Megatron Bridge config's offload settings (or a Megatron-LM command line) against every upstream rule.

    Returns findings with the upstream message, the keys involved and the fix: Bridge overrides, or Megatron-LM
    flags (fix_notation='megatron-lm') when megatron_args was given.
    """
    from mbridge_offload.config.rules.base import parse_target
    from mbridge_offload.config.sources import ConfigError, load
    from mbridge_offload.config.validate import validate

    if sum(x is not None for x in (config, recipe, megatron_args)) != 1:
        raise ToolError(
            "give exactly one of config (a Bridge YAML/JSON path or text), recipe (a recipe name) or megatron_args "
            "(a Megatron-LM command line)"
        )
    if megatron_args is not None:
        loaded = _load_argv(megatron_args, overrides)
    elif recipe is not None:
        try:  # imported once per server process: the second call of a recipe costs its build, not its imports
            loaded = load(None, overrides, recipe=recipe)
        except ConfigError as exc:
            raise ToolError(f"recipe: {exc}") from None
    else:
        assert config is not None  # exactly one of the three was given
        loaded = _load(config, overrides)
    try:  # only the target's own errors are "target" errors: a ValueError from the check itself is not
        parsed_target = parse_target(target)
    except ValueError as exc:
        raise ToolError(f"target {target!r}: {exc}") from None
    _set_te_version(loaded.config, te_version)
    report = validate(loaded.config, loaded.raw, target=parsed_target, source=loaded.source)
    report.source = loaded.source
    if exact:
        from mbridge_offload_tools.exact import ExactUnavailable, exact_report

        try:
            report = exact_report(report, loaded.raw, config=loaded.config)
        except ExactUnavailable as exc:
            raise ToolError(str(exc)) from None
    if megatron_args is not None:
        from mbridge_offload.config.mlm_fixes import megatron_lm_fixes

        report = megatron_lm_fixes(report)
    return report


def _set_te_version(config: Any, te_version: str | None) -> None:
    """The caller's Transformer Engine release into the config's environment facts, as the CLI's --env does."""
    if te_version is None:
        return
    from mbridge_offload.config.validate import check_te_version

    try:
        config.env["te_version"] = check_te_version(te_version)
    except ValueError as exc:
        raise ToolError(str(exc)) from None


def _load_argv(megatron_args: str, overrides: list[str] | None):
    """A Megatron-LM command line, read as the CLI's --megatron-args reads it."""
    import shlex

    from mbridge_offload.config.sources import ConfigError, load

    try:
        return load(None, overrides or [], argv=shlex.split(megatron_args))
    except ConfigError as exc:
        raise ToolError(str(exc)) from None
    except ValueError as exc:  # an unbalanced quote
        raise ToolError(f"megatron_args: cannot read the command line: {exc}") from None


_plan_tool(
    "recommend",
    Recommendation,
    """Pick the smallest offload that makes the run fit: none, optimizer (with a fraction), activation, both,
    fine-grained (offload_modules; works with PP > 1) or fine-grained+optimizer.

    Takes a preset, a (partial) config, Megatron-LM argv and/or any planner input; what is missing comes from the
    preset (or the error names it). Returns the overrides, per-GPU memory before (the config as given, its offload
    included) / after (GB and GiB) on the stated GPU and count, whether it fits, the step-time factor, why, the
    advice in words when it removes the config's offload, a fallback (the cheapest offload for a headroom) when
    none is needed, and every assumption with its source. Pass measured_peak_gib / measured_step_s /
    measured_log / ooms to anchor the predictions on the user's own run.
    """,
    "Recommend an offload mode",
)
_plan_tool(
    "estimate",
    Estimate,
    """Predict per-GPU peak memory (worst pipeline stage, GB and GiB), host memory and step-time factor of a
    setting as given (its offload fraction / layers included), with every assumption and its source.
    """,
    "Estimate memory and step time",
)


# apply_offload's own parameters; every planner input (``PlanInputs``, less ``APPLY_OWN_INPUTS``) follows them.
_APPLY_OWN: list[tuple[str, Any, Any]] = [
    ("config", ConfigArg, inspect.Parameter.empty),
    (
        "mode",
        Annotated[
            Literal["optimizer", "activation", "both", "none", "recommended", "fine-grained"],
            Field(
                description="what to switch on; 'recommended' (the default) asks the planner with every planner "
                "input below, as recommend_mode takes them; option N picks its option"
            ),
        ],
        "recommended",
    ),
    (
        "fraction",
        Annotated[float | None, Field(gt=0, le=1, description="optimizer_offload_fraction (optimizer/both)")],
        None,
    ),
    (
        "num_layers",
        Annotated[
            int | None,
            Field(
                ge=1,
                description="cpu_offloading_num_layers (activation/both); the model's own layer count comes from "
                "the config",
            ),
        ],
        None,
    ),
    (
        "modules",
        Annotated[list[str] | None, Field(description="offload_modules (fine-grained), e.g. ['expert_fc1']")],
        None,
    ),
    ("overrides", OverridesArg, []),
    (
        "output",
        Annotated[str | None, Field(description="write the edited config to this path (inside the server's roots)")],
        None,
    ),
    ("in_place", Annotated[bool, Field(description="overwrite the config file (a unique .bak backup is kept)")], False),
    (
        "overwrite",
        Annotated[bool, Field(description="allow output to replace an existing file (a unique .bak backup is kept)")],
        False,
    ),
    ("format", Annotated[Literal["yaml", "overrides"], Field(description="what a write contains")], "yaml"),
    (
        "option",
        Annotated[
            int | None,
            Field(
                ge=0,
                description="write recommend_mode's options[N] (0 = the recommendation) for the same planner inputs; "
                "implies recommended",
            ),
        ],
        None,
    ),
]


def _apply_parameters() -> list[inspect.Parameter]:
    """apply_offload's own parameters, then every planner input recommend_mode takes (generated, not listed)."""
    from mbridge_offload.actions.apply_plan import APPLY_OWN_INPUTS

    kw = inspect.Parameter.KEYWORD_ONLY
    own = [inspect.Parameter(name, kw, default=default, annotation=ann) for name, ann, default in _APPLY_OWN]
    return own + _plan_input_parameters(APPLY_OWN_INPUTS | {name for name, _, _ in _APPLY_OWN})


def apply_offload(**kwargs: Any) -> ApplyResult:
    """Edit a config to enable (or disable) CPU offloading, resolving the conflicts the mode implies.

    Always returns the unified diff, the override list and each change with its reason; writes only with output
    or in_place, atomically, and never a config that fails validation. Comments, key order and every untouched
    byte are preserved. An existing output is replaced only with overwrite=true, and then backed up. With
    mode='recommended' or option=N it takes every input recommend_mode takes (measured_log, ooms, levers,
    headroom_gib, gpu, num_gpus, ...), so option N is recommend_mode's options[N] for the same inputs, written exactly.
    """
    from mbridge_offload.actions.apply import apply_offload as run_apply

    own = {name: kwargs.pop(name, default) for name, _, default in _APPLY_OWN}
    planner = {k: v for k, v in kwargs.items() if v is not None}
    try:
        from mbridge_offload.plan.inputs.hardware import gpu_preset

        if planner.get("gpu") is not None:
            gpu_preset(planner["gpu"])
    except KeyError as exc:
        raise ToolError(str(exc).strip("'\"")) from None
    return run_apply(
        own["config"],
        own["mode"],
        fraction=own["fraction"],
        num_layers=own["num_layers"],
        modules=own["modules"],
        option=own["option"],
        overrides=own["overrides"],
        output=own["output"],
        in_place=own["in_place"],
        output_format=own["format"],
        overwrite=own["overwrite"],
        write_roots=guard.policy().write_roots(),
        planner=planner or None,
    )


apply_offload.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    _apply_parameters(), return_annotation=ApplyResult
)
mcp.tool(
    title="Apply an offload mode to a config",
    # Writes files (only with output/in_place, inside the server's roots); may replace an existing file when
    # overwrite=true or in_place=true (a backup is kept): destructive. A second identical write is refused.
    annotations=ToolAnnotations(
        read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False
    ),
)(guard.guarded()(apply_offload))


@mcp.tool(
    title="Run the offload unit tests",
    # Runs code (pytest in a subprocess; with bridge_repo, a checkout's tests that the server was started to
    # allow): not read-only, and open-world because that code is not this server's.
    annotations=ToolAnnotations(
        read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=True
    ),
)
@guard.guarded(lambda kwargs: float(kwargs.get("timeout_s") or 600) + 30)
def run_unit_tests(
    ctx: Context,
    k: Annotated[
        str | None,
        Field(
            description="pytest -k expression, e.g. 'apply or diagnose' (selects from every test); 'cpu_offload' "
            "(the upstream skill's selector) runs the offload suite, as does no k"
        ),
    ] = None,
    bridge_repo: Annotated[
        str | None, Field(description="a Megatron Bridge checkout: run its offload tests instead of ours")
    ] = None,
    suite: Annotated[
        Literal["unit", "full", "parity"],
        Field(
            description="unit = the offload suite (tests marked cpu_offload, under a minute on 2 shared cores) or "
            "what k/path select; full = every test (minutes); parity = tiny-GPT loss parity with vs without offload"
        ),
    ] = "unit",
    config: Annotated[str | None, Field(description="parity: the config whose offload settings to train")] = None,
    steps: Annotated[int | None, Field(ge=2, le=500, description="parity: training steps per run")] = None,
    timeout_s: Annotated[float, Field(gt=0, le=3600, description="wall-clock limit")] = 600,
    path: Annotated[
        str | None, Field(description="one test file/folder/node id under tests/, e.g. tests/actions/test_apply.py")
    ] = None,
) -> TestRunResult:
    """Run tests in a subprocess and report counts, durations, failing node ids with the failure text, and a
    coverage paragraph (what ran, what did not). By default (or k='cpu_offload') the offload suite runs: HDO
    parity and resume, checkpoints, activation schedule, rules; suite='full' runs everything.

    bridge_repo runs a Megatron Bridge checkout's offload tests only when the server was started with
    --allow-bridge-repo for it (running them imports the checkout's conftest.py).

    Progress is reported as each test finishes. A selection that matches nothing is reported as
    nothing_selected (ok=false), never as success.
    """
    import anyio.from_thread

    from mbridge_offload.actions.testresult import TestSuiteError
    from mbridge_offload.actions.testsuite import run_tests
    from mbridge_offload.config.sources import ConfigError

    def progress(done: int, total: int | None, message: str) -> None:
        try:
            anyio.from_thread.run(ctx.report_progress, float(done), float(total) if total else None, message)
        except Exception:  # progress is best effort; never fail the run for it
            logger.debug("progress report failed", exc_info=True)

    repo = guard.check_bridge_repo(bridge_repo) if bridge_repo is not None else None
    try:
        result = run_tests(
            k=k,
            bridge_repo=repo,
            repo_python=guard.policy().bridge_venv,
            suite=suite,
            timeout_s=timeout_s,
            on_progress=progress,
            config=config,
            steps=steps,
            path=path,
        )
    except (TestSuiteError, ConfigError) as exc:
        raise ToolError(str(exc)) from None
    return result


def _diagnose_parameters() -> list[inspect.Parameter]:
    """diagnose_failure's parameters: its texts and configs, then the planner inputs it takes (generated from
    ``PlanInputs`` like estimate_memory's, the subset ``diagnose_plan.input_names`` names)."""
    from mbridge_offload.actions.diagnose_plan import input_names

    kw = inspect.Parameter.KEYWORD_ONLY

    def text(name: str, description: str) -> inspect.Parameter:
        return inspect.Parameter(
            name, kw, default=None, annotation=Annotated[str | None, Field(description=description)]
        )

    own = [
        text("error", "the error message or traceback"),
        text("log", "a log excerpt around the failure"),
        text("config", "the failing run's config (path or text)"),
        text("before", "config before the change that broke the run"),
        text("after", "config after that change"),
    ]
    names = set(input_names())
    return own + [p for p in _plan_parameters() if p.name in names]


def diagnose_failure(**kwargs: Any) -> DiagnoseReport:
    """Match an error or log against the known offload failure modes: cause, how to confirm, fix as overrides.

    A confirming experiment (e.g. resuming without the optimizer state) is in confirm / confirm_overrides, never in
    fix. When the text cannot decide (a bare CUDA OOM and no config), needs says what to pass. With a config, an OOM,
    slowdown or host-OOM fix is one of the planner's ranked options (options[], sized on gpu / num_gpus with the
    text as measured_log and an OOM in it as ooms; assumptions lists every input with its source), never a guessed
    fraction. With before/after configs it also lists the offload keys that changed and the predicted memory change
    on that GPU and count.
    """
    from mbridge_offload.actions.diagnose import diagnose
    from mbridge_offload.actions.diagnose_plan import input_names

    error, log, config, before, after = (kwargs.get(k) for k in ("error", "log", "config", "before", "after"))
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
    from mbridge_offload.config.reading import max_bytes

    cap = max_bytes()  # like the CLI's --log: the tail of a huge log or error text, where the failure is
    error, log = (error[-cap:] if error else error), (log[-cap:] if log else log)
    return diagnose(
        error=error,
        log=log,
        config=loaded.config if loaded else None,
        raw=loaded.raw if loaded else None,
        before=b,  # loaded: raw dict and source kept, read as estimate reads them
        after=a,
        source=loaded.source if loaded else None,
        planner={name: kwargs.get(name) for name in input_names()},
    )


diagnose_failure.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    _diagnose_parameters(), return_annotation=DiagnoseReport
)
mcp.tool(
    title="Diagnose an offload failure",
    annotations=ToolAnnotations(
        read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False
    ),
)(guard.guarded()(diagnose_failure))


# The picture tool lives in its own module (mbridge_offload_tools.plot.tool) with the planner tools' parameters.
plot_tool.register(mcp, _plan_parameters(), _plan_source)


# ---------------------------------------------------------------------------------------------- entry points


def run(
    transport: str = "stdio",
    host: str = "127.0.0.1",
    port: int = 8765,
    roots: list[str] | None = None,
    bridge_repos: list[str] | None = None,
    bridge_venv: bool = False,
) -> None:
    """Serve over ``stdio`` or ``streamable-http`` (on ``host:port``, path ``/mcp``).

    Args:
        transport: ``stdio`` or ``streamable-http``.
        host: streamable-http host.
        port: streamable-http port.
        roots: directories tools may read and write, added to the working directory.
        bridge_repos: Bridge checkouts whose tests may run.
        bridge_venv: allow those checkouts' own ``.venv`` Python.

    Raises:
        ValueError: an unknown transport.
    """
    if transport not in ("stdio", "streamable-http"):
        raise ValueError(f"transport {transport!r} is not one of stdio, streamable-http")
    guard.configure(roots or [], bridge_repos or [], bridge_venv)
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
    guard.add_transport_flags(parser)
    guard.add_policy_flags(parser)
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
