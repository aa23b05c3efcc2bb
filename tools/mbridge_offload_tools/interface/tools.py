"""The parameters of every MCP tool, which are the flags of its subcommand: one declaration per tool, with the
title, the command-list line and the one description both show.

To add a parameter to a tool and its subcommand, add one ``Param`` below: the CLI flag, the MCP schema and the docs
follow. The planner's inputs come from ``PlanInputs`` (:func:`plan_params`).
"""

from __future__ import annotations

import typing
from dataclasses import replace
from typing import Any, Literal

from mbridge_offload.actions.diagnose.diagnose import SYMPTOMS
from mbridge_offload.actions.diagnose.sizing import input_names
from mbridge_offload.config.rules.base import DEFAULT_TARGET
from mbridge_offload.plan.inputs.fields import PlanInputs, cli_aliases, config_key, group_of
from mbridge_offload_tools.interface.param import BOUND_NAMES, JSON_FLAG, CliOnly, Param, Tool, bounds

_METAVARS = {int: "N", float: "X", str: "TEXT"}


def plan_param(name: str, **changes: Any) -> Param:
    """The planner input ``name`` as a parameter: type, bounds, help, group and older spellings from ``PlanInputs``."""
    info = PlanInputs.model_fields[name]
    kinds = [a for a in typing.get_args(info.annotation) if a is not type(None)] or [info.annotation]
    found = tuple(
        (attr, getattr(meta, attr))
        for meta in info.metadata
        for attr in BOUND_NAMES
        if getattr(meta, attr, None) is not None
    )
    key, described = config_key(name), info.description or ""
    if key is not None and key not in described:  # one name per setting, with the config key shown beside it
        described += f" (config: {key})"
    param = Param(
        name,
        kinds[0],
        described,
        bounds=found,
        aliases=cli_aliases(name),
        metavar=_METAVARS.get(kinds[0]),
        group=group_of(name),
    )
    return replace(param, **changes)


def plan_params(names: tuple[str, ...] | None = None) -> tuple[Param, ...]:
    """Every planner input (or the ``names`` given), in ``PlanInputs``' order."""
    return tuple(plan_param(n) for n in (names or tuple(PlanInputs.model_fields)))


# ---------------------------------------------------------------------------------------------- shared inputs

OVERRIDES = Param(
    "overrides",
    list[str],
    "Hydra-style overrides applied to the config first, e.g. optimizer.optimizer_offload_fraction=0.5 (the CLI's "
    "--set, repeatable)",
    default=[],
    per_flag=True,
    metavar="KEY=VALUE",
)
MEGATRON_ARGS = Param(
    "megatron_args",
    str,
    "instead of a config: a Megatron-LM pretrain_gpt.py command line, quoted, e.g. '--num-layers 4 "
    "--cpu-offloading-num-layers 4'",
    metavar='"ARGS"',
)
# One declaration for every tool that reads the Transformer Engine release (validate, apply).
TE_VERSION = Param(
    "te_version",
    str,
    "the Transformer Engine release the training cluster runs, e.g. 2.9 or 2.10.0; the TE-dependent rules "
    "(activation offload v1/v2, fine-grained NVTE_CPU_OFFLOAD_V1) read it. Default: 2.17.1 assumed, the release "
    "Megatron Bridge 0.6.2 pins (env.te_version_source says so)",
    metavar="X.Y",
)
MODEL_CONFIG = CliOnly(
    ("--model-config",),
    "the older spelling of CONFIG",
    (("metavar", "FILE"), ("help", "the older spelling of CONFIG")),
    alias_of="config",
)

# ---------------------------------------------------------------------------------------------- the tools

VALIDATE = Tool(
    "validate_config",
    "validate",
    (
        Param(
            "config",
            str,
            "a Bridge YAML/JSON config: a file path, or the YAML/JSON text itself ('-' on the CLI: stdin); or pass "
            "recipe or megatron_args instead",
            positional=True,
        ),
        OVERRIDES,
        Param(
            "target",
            str,
            f"the megatron-core release to check against: megatron-core==0.16.1, megatron-core==0.19.2 or main "
            f"(default: {DEFAULT_TARGET}; for a recipe, the release the installed Bridge imports)",
            metavar="megatron-core==X.Y",
        ),
        Param(
            "upstream",
            bool,
            "run megatron-core itself where it is installed (the target's release: the environment's, or "
            ".mcore/<version> from scripts/setup): its TransformerConfig/MLATransformerConfig, OptimizerConfig and "
            "DistributedDataParallelConfig, and the model build for the layout (every pipeline stage's split, the "
            "first stage built on the meta device), in a warm subprocess; its errors come back verbatim (origin "
            "mcore). --no-upstream / false: the rule catalogue only (fast, no torch); coverage.not_run then names "
            "the checks that did not run",
            default=True,
        ),
        Param(
            "exact",
            bool,
            "require the upstream run: an error (exit 2) when megatron-core cannot run here, where the default "
            "answers from the rule catalogue and says so in coverage",
            default=False,
        ),
        Param(
            "deadline",
            float,
            "time limit of the upstream run, in seconds",
            default=120.0,
            bounds=bounds(gt=0, le=3600),
            metavar="S",
        ),
        Param(
            "recipe",
            str,
            "instead of config: a Megatron Bridge recipe function (e.g. llama3_8b_pretrain_config), built for real "
            "where megatron-bridge is importable",
            metavar="NAME",
        ),
        replace(
            MEGATRON_ARGS,
            help=MEGATRON_ARGS.help + "; fixes then come back as flags (fix: add or set, fix_remove: delete)",
        ),
        TE_VERSION,
        Param(
            "env",
            list[str],
            "facts about the training environment, KEY=VALUE, e.g. NVTE_CPU_OFFLOAD_V1=1 (te_version=X.Y here is the "
            "older spelling of te_version, --te-version on the CLI)",
            default=[],
            per_flag=True,
            metavar="KEY=VALUE",
        ),
    ),
    title="Validate a CPU-offloading config",
    help="check a config's CPU-offloading settings (upstream messages, fixes)",
    description="""\
Check a Megatron Bridge config's offload settings (or a Megatron-LM command line) against every upstream rule.

    Returns findings with the upstream message, the keys involved and the fix: Bridge overrides, or Megatron-LM
    flags (fix_notation='megatron-lm') when megatron_args was given.
    """,
)

ALLOWED_ROOT = CliOnly(
    ("--allowed-root",),
    "MCP writes stay inside the server's roots, set at its start (serve --root), never by an argument",
    (("metavar", "DIR"), ("help", "an extra directory --output may point into")),
)

_CONFIG_OPTIONAL = Param(
    "config",
    str,
    "optional Bridge YAML/JSON config (a path or the text itself); a model preset fills what it lacks",
    positional=True,
)
_PLAN_CLI_ONLY = (MODEL_CONFIG, JSON_FLAG)

ESTIMATE = Tool(
    "estimate_memory",
    "estimate",
    (_CONFIG_OPTIONAL, OVERRIDES, MEGATRON_ARGS, *plan_params()),
    _PLAN_CLI_ONLY,
    title="Estimate memory and step time",
    help="per-GPU memory (worst pipeline stage), host memory and step-time factor",
    description="""\
Predict per-GPU peak memory (worst pipeline stage, GB and GiB), host memory and step-time factor of a
    setting as given (its offload fraction / layers included), with every assumption and its source.
    """,
)
CONFIRM = Param(
    "confirm",
    bool,
    "re-check options[0] with trace (~10-120 s): adds confirm, the trace's peak beside the planner's",
    default=False,
    group="trace",
)
RECOMMEND = Tool(
    "recommend_mode",
    "recommend",
    (_CONFIG_OPTIONAL, OVERRIDES, MEGATRON_ARGS, CONFIRM, *plan_params()),
    _PLAN_CLI_ONLY,
    title="Recommend an offload mode",
    help="the cheapest way to fit: ranked options over recompute, offload, CP, TP and MBS",
    description="""\
Pick the smallest offload that makes the run fit: none, optimizer (with a fraction), activation, both,
    fine-grained (offload_modules; works with PP > 1) or fine-grained+optimizer.

    Takes a preset, a (partial) config, Megatron-LM argv and/or any planner input; what is missing comes from the
    preset (or the error names it). Returns the overrides, per-GPU memory before (the config as given, its offload
    included) / after (GB and GiB) on the stated GPU and count, whether it fits, the step-time factor, why, the
    advice in words when it removes the config's offload, a fallback (the cheapest offload for a headroom) when
    none is needed, and every assumption with its source. Pass measured_peak_gib / measured_step_s /
    measured_log / ooms to anchor the predictions on the user's own run.
    """,
)

TRACE = Tool(
    "trace_memory",
    "trace",
    (
        _CONFIG_OPTIONAL,
        OVERRIDES,
        MEGATRON_ARGS,
        Param(
            "megatron_core",
            Literal["0.16.1", "0.19.2"],
            "the megatron-core release whose model, DDP, optimizer and schedule are traced (this environment's or "
            ".mcore/<version>, as validate --exact finds them); default 0.19.2",
            group="trace",
        ),
        Param(
            "stage",
            int,
            "the pipeline stage to trace (default: the one the planner finds worst)",
            bounds=bounds(ge=0),
            metavar="N",
            group="trace",
        ),
        Param(
            "deadline",
            float,
            "time limit of the traced step, in seconds (a subprocess)",
            default=300.0,
            bounds=bounds(gt=0, le=3600),
            metavar="S",
            group="trace",
        ),
        *plan_params(),
    ),
    _PLAN_CLI_ONLY,
    title="Trace megatron-core's own step",
    help="peak memory of megatron-core's own step for the worst rank, traced on fake tensors",
    description="""\
Trace megatron-core's own GPTModel, DDP buffers, optimizer and schedule for the worst pipeline stage of the
    layout on fake tensors (a fake process group; nothing is computed, every allocation counted) and answer like
    estimate_memory: memory_gib by category (total = the peak), phases, peak_phase, assumptions, plus by_module
    and under_test (the megatron-core release and layer spec). Takes the inputs estimate_memory takes; ~10-120 s.
    """,
)

APPLY_MODES = ("optimizer", "activation", "both", "none", "recommended", "fine-grained")

_APPLY_OWN = (
    Param(
        "config",
        str,
        "a Bridge YAML/JSON config: a file path, or the YAML/JSON text itself ('-' on the CLI: stdin)",
        required=True,
        positional=True,
        bounds=bounds(min_length=1),
    ),
    Param(
        "mode",
        Literal[APPLY_MODES],
        "what to switch on; none switches offload off; fine-grained offloads the modules' activations; "
        "recommended (the default) asks the planner with every planner input below, as recommend takes them; "
        "option N picks its option N",
        default="recommended",
    ),
    Param("fraction", float, "optimizer_offload_fraction (optimizer/both)", bounds=bounds(gt=0, le=1)),
    Param(
        "num_layers",
        int,
        "cpu_offloading_num_layers (activation/both); the model's own layer count comes from the config",
        bounds=bounds(ge=1),
        metavar="N",
    ),
    Param(
        "modules",
        list[str],
        "offload_modules for mode fine-grained, e.g. expert_fc1 or core_attn,attn_proj",
        per_flag=True,
        metavar="M[,M...]",
    ),
    replace(OVERRIDES, help="Hydra-style section.key=VALUE overrides, applied with the mode and written with it"),
    Param("output", str, "write the edited config to this path (inside the server's roots over MCP)", metavar="PATH"),
    Param("in_place", bool, "overwrite the config file (a unique .bak backup is kept)", default=False),
    Param("overwrite", bool, "let output replace an existing file (a unique .bak backup is kept)", default=False),
    Param("format", Literal["yaml", "overrides"], "what a write contains", default="yaml"),
    Param(
        "option",
        int,
        "write recommend's options[N] for the same planner inputs (its recompute, layout and offload changes; 0 = the "
        "recommendation); implies mode recommended, re-validated like every apply",
        bounds=bounds(ge=0),
        metavar="N",
    ),
    replace(
        TE_VERSION,
        help=TE_VERSION.help + "; apply writes env_vars.NVTE_CPU_OFFLOAD_V1 for fine-grained offloading only from "
        "TE 2.10, and judges the edited config with it",
    ),
)
# mode recommended / option: every input recommend takes (evidence, levers, headroom, GPU, count, layout...), so
# option N is recommend's option N. A planner input apply spells its own way is apply's: num_layers is
# cpu_offloading_num_layers (the model's layer count comes from the config; actions.apply.plan.APPLY_OWN_INPUTS).
APPLY_PLANNER = tuple(n for n in PlanInputs.model_fields if n not in {p.name for p in _APPLY_OWN})

APPLY = Tool(
    "apply_offload",
    "apply",
    (*_APPLY_OWN, *plan_params(APPLY_PLANNER)),
    (ALLOWED_ROOT, JSON_FLAG),
    title="Apply an offload mode to a config",
    help="switch an offload mode on/off in a config (dry run unless --output/--in-place)",
    description="""\
Edit a config to enable (or disable) CPU offloading, resolving the conflicts the mode implies.

    Always returns the unified diff, the override list and each change with its reason; writes only with output
    or in_place, atomically, and never a config that fails validation. Comments, key order and every untouched
    byte are preserved. An existing output is replaced only with overwrite=true, and then backed up. With
    mode='recommended' or option=N it takes every input recommend_mode takes (measured_log, ooms, levers,
    headroom_gib, gpu, num_gpus, ...), so option N is recommend_mode's options[N] for the same inputs, written exactly.
    """,
)

TEST = Tool(
    "run_unit_tests",
    "test",
    (
        Param(
            "k",
            str,
            "pytest -k expression, e.g. 'apply or diagnose' (selects from every test); cpu_offload (the upstream "
            "skill's selector) runs the offload suite, as does no k",
            metavar="EXPR",
        ),
        Param(
            "bridge_repo",
            str,
            "a Megatron Bridge checkout: run its offload tests instead of ours (over MCP only when the server was "
            "started with --allow-bridge-repo for it)",
            metavar="PATH",
        ),
        Param(
            "suite",
            Literal["unit", "full", "parity"],
            "unit = the offload suite (tests marked cpu_offload) or what k/path select; full = every test; parity = "
            "tiny-GPT loss parity with vs without offload",
            default="unit",
        ),
        Param("config", str, "parity: the config whose offload settings are trained (path or text)", metavar="CONFIG"),
        Param("steps", int, "parity: training steps per run", bounds=bounds(ge=2, le=500), metavar="N"),
        Param(
            "timeout_s", float, "wall-clock limit, seconds", default=600.0, bounds=bounds(gt=0, le=3600), metavar="S"
        ),
        Param(
            "path",
            str,
            "one test file/folder/node id under tests/ instead of the offload suite, e.g. tests/actions/test_apply.py",
            metavar="PATH",
        ),
    ),
    (
        CliOnly(
            ("--all",),
            "the older spelling of --suite full",
            (("action", "store_true"), ("help", "run every test of tests/ (the older spelling of --suite full)")),
            alias_of="suite",
            value="full",
        ),
        JSON_FLAG,
    ),
    title="Run the offload unit tests",
    help="run the offload tests (ours, a Bridge checkout's, or the parity suite)",
    description="""\
Run tests in a subprocess and report counts, durations, failing node ids with the failure text, and a
    coverage paragraph (what ran, what did not). By default (or k='cpu_offload') the offload suite runs: HDO
    parity and resume, checkpoints, activation schedule, rules; suite='full' runs everything.

    bridge_repo runs a Megatron Bridge checkout's offload tests only when the server was started with
    --allow-bridge-repo for it (running them imports the checkout's conftest.py).

    Progress is reported as each test finishes. A selection that matches nothing is reported as
    nothing_selected (ok=false), never as success.
    """,
)

DIAGNOSE = Tool(
    "diagnose_failure",
    "diagnose",
    (
        Param("error", str, "the error message or traceback", metavar="TEXT"),
        Param(
            "symptom",
            Literal[SYMPTOMS],
            "a failure the run printed no message for, by its id (references/failures.md): slowdown, no_saving, "
            "resume_loss_jump, finetune_stale_masters, fsdp_save_hang, ... or oom (a GPU out-of-memory; the config "
            "decides the reading). diagnose matches upstream's messages in error and log; it does not read prose, so "
            "a symptom the user describes in words is named here",
        ),
        Param(
            "log",
            str,
            "the log of the failing run: a file path (read from its end), or the log text itself",
            metavar="FILE|TEXT",
        ),
        Param("config", str, "the failing run's config (path or text)", metavar="CONFIG"),
        Param("before", str, "the config before the change that broke the run (path or text)", metavar="CONFIG"),
        Param("after", str, "the config after that change (path or text)", metavar="CONFIG"),
        # Size the fix of an OOM, a slowdown or a host OOM with the config, as estimate and recommend take them.
        *plan_params(input_names()),
    ),
    title="Diagnose an offload failure",
    help="explain an offload failure from an error message or log",
    description="""\
Match an error or log against the known offload failure modes: cause, how to confirm, fix as overrides.

    A confirming experiment (e.g. resuming without the optimizer state) is in confirm / confirm_overrides, never in
    fix. When the text cannot decide (a bare CUDA OOM and no config), needs says what to pass. With a config, an OOM,
    slowdown or host-OOM fix is one of the planner's ranked options (options[], sized on gpu / num_gpus with the
    text as measured_log and an OOM in it as ooms; assumptions lists every input with its source), never a guessed
    fraction. With before/after configs it also lists the offload keys that changed and the predicted memory change
    on that GPU and count. log is a file path or the log text itself.
    """,
)

PLOT = Tool(
    "plot_offload",
    "plot",
    (
        _CONFIG_OPTIONAL,
        OVERRIDES,
        MEGATRON_ARGS,
        Param(
            "kind",
            Literal["sweep", "phases", "options"],
            "what to draw: sweep (peak memory per stage and step time at each value of one input), phases (of one "
            "step, per stage), options (recommend's ranked options); default: sweep when sweep is given",
            group="picture",
        ),
        Param(
            "sweep",
            str,
            "the input to vary and its values: KEY=START:STOP:STEP (the stop included) or KEY=V1,V2,..., e.g. "
            "optimizer_offload_fraction=0:1:0.25, micro_batch_size=1,2,4 (any numeric planner input)",
            bounds=bounds(max_length=4096),
            metavar="KEY=START:STOP:STEP",
            group="picture",
        ),
        Param(
            "output",
            str,
            "write the picture here, .svg or .png by its extension (inside the server's roots over MCP; the CLI's "
            "default: ./mbridge-offload-KIND[-KEY].svg, MCP: no file)",
            metavar="FILE",
            group="picture",
        ),
        Param(
            "overwrite",
            bool,
            "let output replace an existing file (a .bak backup is kept)",
            default=False,
            group="picture",
        ),
        Param(
            "format",
            Literal["svg", "png"],
            "svg or png; output's extension decides (default: svg on the CLI, png over MCP, the image content agent "
            "hosts show)",
            group="picture",
        ),
        *plan_params(),
    ),
    (MODEL_CONFIG, ALLOWED_ROOT, JSON_FLAG),
    title="Plot memory and step time",
    help="draw a sweep of one input, the phases of a step, or recommend's options",
    description="""\
Draw the planner's answers and return the picture (image content, PNG unless format='svg') with its points
    (structured content).

    kind='sweep' with sweep='KEY=START:STOP:STEP' (the stop included; or 'KEY=V1,V2,...'), KEY any numeric planner
    input (optimizer_offload_fraction, activation_offload_layers, recompute_num_layers, micro_batch_size, ...): peak
    memory per pipeline stage and step time at each value, with the budget line; each point is estimate_memory at that
    value. kind='phases': the phases of one step per stage and the one that sets the peak. kind='options':
    recommend_mode's ranked options beside the config as given. Takes every input of estimate_memory. Writes a file
    only with output (.svg or .png, inside the server's roots); an existing one only with overwrite=true (backed up).
    """,
)

TOOLS: dict[str, Tool] = {t.name: t for t in (VALIDATE, ESTIMATE, RECOMMEND, TRACE, APPLY, TEST, DIAGNOSE, PLOT)}
BY_COMMAND: dict[str, Tool] = {t.command: t for t in TOOLS.values()}
