"""The parameters of every MCP tool, which are the flags of its subcommand: one declaration per tool.

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
    "(activation offload v1/v2, fine-grained NVTE_CPU_OFFLOAD_V1) read it. Default: 2.18 assumed, the release "
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
    "estimate_memory", "estimate", (_CONFIG_OPTIONAL, OVERRIDES, MEGATRON_ARGS, *plan_params()), _PLAN_CLI_ONLY
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

APPLY = Tool("apply_offload", "apply", (*_APPLY_OWN, *plan_params(APPLY_PLANNER)), (ALLOWED_ROOT, JSON_FLAG))

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
)

TOOLS: dict[str, Tool] = {t.name: t for t in (VALIDATE, ESTIMATE, RECOMMEND, TRACE, APPLY, TEST, DIAGNOSE, PLOT)}
BY_COMMAND: dict[str, Tool] = {t.command: t for t in TOOLS.values()}
