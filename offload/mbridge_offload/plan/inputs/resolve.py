"""One resolution of the planner's inputs: defaults < model preset (its recipe) < config < flags.

A preset, a Bridge YAML, Megatron-LM argv and flags all become ``PlanInputs`` values here, each with its source;
the same effective settings give the same ``Resolved`` whichever way they came in. Every value the answer
depends on is listed as an ``Assumption`` (name, value, source, note) so that an agent can check it. Never
imports torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from mbridge_offload import upstream_layers as reach
from mbridge_offload.config import errors, parallel_sizes
from mbridge_offload.config.effective import Effective
from mbridge_offload.config.effective import resolve as resolve_config
from mbridge_offload.config.errors import BoundsError as InputError
from mbridge_offload.config.schema import OffloadConfig
from mbridge_offload.plan.inputs import family, fields, implied
from mbridge_offload.plan.inputs.config_facts import (
    expandable_segments,
    hybrid_optimizer_note,
    manual_gc,
    model_notes,
    moe_step_settings,
    raw_section,
    with_layout,
)
from mbridge_offload.plan.inputs.fields import ARCHITECTURE, FIELDS, PlanInputs, flag_name, group_of
from mbridge_offload.plan.inputs.hardware import GpuPreset, gpu_preset, with_overrides
from mbridge_offload.plan.inputs.vocab import tokenizer_vocab
from mbridge_offload.plan.model.architecture import ModelSpec
from mbridge_offload.plan.model.layout import layout_text
from mbridge_offload.plan.model.run import Setup, check_setup
from mbridge_offload.plan.time import host_profile
from mbridge_offload.plan.time.host_profile import HostProfile
from mbridge_offload.plan.time.step import cpu_adam_rate_source

# Every input's config key and fallback is declared once, on its field (``fields.PlanInputs``); these are views.
CONFIG_KEYS = fields.CONFIG_KEYS
DEFAULTS = fields.fallbacks()
FINE_GRAINED_DEFAULTS = fields.fallbacks("fine_grained")  # listed (and used) only when fine-grained offloading is on
LOSS_FUSION_DEFAULTS = fields.fallbacks("loss_fusion")  # listed (and used) only when the fused cross entropy is on
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")
# The estimator lists every local expert of every layer (HDO splits whole tensors): keep that list to a size it
# walks in well under a second. Published MoEs: DeepSeek-V3 61 x 256, Kimi K2 61 x 384 (at EP 1).
MAX_LOCAL_EXPERT_LAYERS = 32_768
# Not listed as assumptions: how to read the inputs, not settings of the run.
_NOT_ASSUMPTIONS = {"measured_log", "calibration", "host_profile", "model", "levers", "measured_settings"}


class Assumption(BaseModel):
    """One value the answer depends on, where it came from (config, argv, preset, default, flag, derived)."""

    name: str
    value: Any
    source: str
    note: str | None = None


def catalogue_keys(s: Setup, num_layers: int) -> dict[str, Any]:
    """The ``model.*`` keys of ``s`` that the rule catalogue's offload rules read: the section of a config built to
    ask it about a setup (no config given, or one setting probed)."""
    names = ("recompute_granularity", "recompute_method", "recompute_num_layers")
    return {"num_layers": num_layers, "pipeline_model_parallel_size": s.pp, **{n: getattr(s, n) for n in names}}


# The inputs outside ``Setup`` that decide whether layer-level activation offload is allowed (model.* keys of the
# same name): Constraints carries their values.
CONSTRAINT_INPUTS = ("cuda_graph_impl", "fine_grained_activation_offloading", "moe_paged_stash")


@dataclass
class Constraints:
    """Config facts outside ``Setup`` that decide whether layer-level activation offload is allowed."""

    keys: dict[str, object] = field(default_factory=dict)  # CONSTRAINT_INPUTS' values
    # A hybrid (Mamba) stack: megatron-core accepts layer-level offload there and offloads nothing (not a config key).
    hybrid_stack: bool = False

    def model_keys(self) -> dict[str, object]:
        """These facts as ``model.*`` config values."""
        return dict(self.keys)

    def model_config(self) -> dict[str, Any]:
        """:meth:`model_keys` for the fine-grained rules, which switch fine-grained offloading on themselves."""
        return {k: v for k, v in self.keys.items() if k != "fine_grained_activation_offloading"}

    def activation_blockers(self, s: Setup, num_layers: int) -> list[str]:
        """Why upstream would refuse layer-level activation offload for this setup, empty when it allows it.

        Not a second copy of upstream's checks: the rule catalogue is run on the setup with activation offload
        switched on, and every error it raises about ``model.cpu_offloading`` is returned with its message.
        """
        from mbridge_offload.config.validate import activation_offload_errors

        model = {**catalogue_keys(s, max(num_layers, 2)), **self.model_keys()}
        out = [f"activation offloading: {message} ({rule})" for rule, message in activation_offload_errors(model)]
        if self.hybrid_stack and not reach.applies("cpu_offloading", "hybrid"):
            out.append(
                "activation offloading: model.cpu_offloading has no effect on a hybrid stack: "
                f"{reach.because('cpu_offloading', 'hybrid')} (ACT-HYBRID-LAYER-OFFLOAD)"
            )
        return out


@dataclass(frozen=True)
class Call:
    """The arguments of one ``resolve`` call: the config (after any overrides), the flags, and which flags ask for
    another run than the one the config (or, without one, the other flags) describes (a plot's swept input)."""

    flags: dict[str, Any]
    config: OffloadConfig | None
    raw: dict[str, Any] | None
    source: str | None
    asked: frozenset[str] = frozenset()


@dataclass
class Resolved:
    """The merged inputs and what the models are built from."""

    inputs: PlanInputs
    sources: dict[str, str]
    model: ModelSpec
    setup: Setup
    gpu: GpuPreset
    constraints: Constraints
    assumptions: list[Assumption] = field(default_factory=list)
    raw_config: dict[str, Any] | None = None  # the user's config as read, for the rule catalogue
    effective: Effective | None = None  # the config's one resolution (config.effective), None without a config
    host_profile: HostProfile | None = None  # the profile the caller named (host_profile / calibration), read once
    call: Call | None = None  # what resolve() was given: the measured run is rebuilt from it (plan/evidence/runs.py)

    @property
    def source(self) -> str | None:
        """Where the config came from, as ``config.effective`` read it (a recipe is a Bridge config)."""
        return self.effective.source if self.effective is not None else None

    @property
    def overlap(self) -> bool:
        return bool(self.inputs.overlap)

    def time_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``timing.estimate_time`` from the inputs."""
        i = self.inputs
        return {
            "cpu_threads": i.cpu_threads or 1,
            "cpu_params_per_s_per_core": self.cpu_adam_rate_source()[0],
            "baseline_s": i.baseline_step_s,
            "mfu": i.mfu,
        }

    def cpu_adam_rate_source(self) -> tuple[float, str]:
        """The per-core CPU AdamW rate in force and its source: the flag, the named host profile, the GPU
        preset's host figure, the measured default; in that order."""
        if self.inputs.cpu_adam_params_per_s is None and self.host_profile is not None:
            return self.host_profile.rate_per_core, "host-profile"
        return cpu_adam_rate_source(self.inputs.cpu_adam_params_per_s, self.gpu.cpu_adam_params_per_s_per_core)


# ------------------------------------------------------------------------------------------- given


# Inputs that describe the job, the machine and the evidence, not the run's settings: the same in the run a user's
# evidence measured and the run asked about (``plan/evidence/runs.py``).
_SHARED_GROUPS = {"model", "hardware", "time", "decision", "measured"}
# In those groups but settings of the run (config keys the caller may change).
_RUN_SETTINGS_THERE = {"overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap"}


def shared(name: str) -> bool:
    """``name`` describes the job and the machine (both runs), not a setting the caller may change. The GPU count is
    the job's: a flag gives it to both runs (``measured_settings`` or a log's world size may say otherwise)."""
    return name == "num_gpus" or (group_of(name) in _SHARED_GROUPS and name not in _RUN_SETTINGS_THERE)


def measured_settings(items: list[str] | None) -> dict[str, Any]:
    """``measured_settings`` (``NAME=VALUE`` items) as planner input values, checked like the inputs themselves.

    Raises:
        InputError: an item without ``=``, a name that is no planner input or not a setting of the run, a value the
            input refuses.
    """
    out: dict[str, Any] = {}
    for item in items or []:
        name, sep, text = (part.strip() for part in item.partition("="))
        if not sep or name not in PlanInputs.model_fields:
            raise InputError(
                f"measured_settings {item!r}: expected NAME=VALUE with NAME a planner input, e.g. micro_batch_size=1 "
                "or seq_length=4096 (CLI: --measured-settings micro_batch_size=1)"
            )
        if shared(name) and name != "num_gpus":
            raise InputError(
                f"measured_settings {item!r}: {name} is the same in the measured and the asked run (the model, the "
                f"hardware, the evidence); pass it as {flag_name(name)}"
            )
        value: Any = [v for v in text.split(",") if v] if name in ("recompute_modules", "offload_modules") else text
        out[name] = getattr(validate_inputs({name: value}, {name: "measured_settings"}), name)
    return out


def _message(err: ErrorDetails, where: dict[str, str], keys: dict[str, str]) -> str:
    name = str(err["loc"][0]) if err["loc"] else "input"
    value = err.get("input")
    source = where.get(name, "flag")
    shown = flag_name(name) if name in PlanInputs.model_fields and source == "flag" else name
    if source in ("config", "argv") and name in keys:
        shown = keys[name]  # the config's own key: model.tensor_model_parallel_size, not tp
    text = err["msg"]
    if isinstance(value, float) and not math.isfinite(value):
        text = "must be a finite number"
    return f"{shown} = {value!r} ({source}): {text[0].lower() + text[1:]}"


def validate_inputs(
    values: dict[str, Any], where: dict[str, str] | None = None, keys: dict[str, str] | None = None
) -> PlanInputs:
    """``PlanInputs`` from a dict of values; one readable line per violated bound.

    Args:
        values: input name → value (unknown names are refused).
        where: input name → source (``flag``, ``config``, ``preset``...), named in the message.
        keys: input name → the dotted config key, named instead of the input where the config gave the value.

    Raises:
        InputError: the first three problems, each with the input, its value and the bound.
    """
    try:
        return PlanInputs.model_validate(values)
    except ValidationError as exc:
        errors = exc.errors()
        lines = [_message(e, where or {}, keys or {}) for e in errors[:3]]
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise InputError("; ".join(lines) + more) from None


# ------------------------------------------------------------------------------------------- layers


def config_values(eff: Effective) -> dict[str, Any]:
    """The inputs the config decides (``Effective.given``): written, from ``mixed_precision``, Bridge's
    ``finalize()`` or derived from what is written. Keys only a frontend default decides stay unset, so presets
    and the planner's defaults apply."""
    out: dict[str, Any] = {}
    for name, dotted in {**CONFIG_KEYS, **fields.EFFECTIVE_KEYS}.items():
        given, value = eff.given(dotted)
        if given:
            out[name] = value
    etp = eff.values.get("model.expert_tensor_parallel_size")
    if etp is not None and etp.source.startswith("derived:"):
        del out["etp"]  # ETP = TP is decided on the final TP (a --tp flag may change it): resolve() derives it
    if "recompute_granularity" in out:
        out["recompute_granularity"] = out["recompute_granularity"] or "none"
    tokenizer = raw_section(eff.raw, "tokenizer")
    if out.get("vocab_size") is None:  # Bridge keeps it with the tokenizer when the tokenizer decides it
        for key in ("padded_vocab_size", "vocab_size"):  # the padded one is what the embedding is built with
            if isinstance(tokenizer.get(key), int) and not isinstance(tokenizer.get(key), bool):
                out["vocab_size"] = tokenizer[key]
                break
    if out.get("vocab_size") is None and (known := tokenizer_vocab(tokenizer)) is not None:
        out["vocab_size"] = known[1].vocab_size  # the tokenizer decides it at start-up: the shipped table says
    if "pipeline_layout" in out:
        from mbridge_offload.plan.model.layout import layout_text

        out["pipeline_layout"] = layout_text(out["pipeline_layout"])
    if "fsdp_main_grads_dtype" in out:
        from mbridge_offload.config.schema import normalize_dtype

        out["fsdp_main_grads_dtype"] = normalize_dtype(out["fsdp_main_grads_dtype"])
    return {k: v for k, v in out.items() if v is not None}


# ------------------------------------------------------------------------------------------- resolve


def _merge(layers: list[tuple[str, dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, str]]:
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    for source, layer in layers:
        for name, value in layer.items():
            if value is not None:
                values[name] = value
                where[name] = source
    return values, where


def _model_spec(values: dict[str, Any], base: ModelSpec | None, extras: dict[str, Any]) -> ModelSpec:
    missing = [name for name in REQUIRED if values.get(name) is None]
    if missing:
        lead = "no model: " if len(missing) == len(REQUIRED) else ""
        raise InputError(
            f"{lead}model sizes missing: {', '.join(missing)} (give a model preset, e.g. --model / model= "
            "qwen3-30b-a3b, or a Bridge config with a model section, or the sizes as inputs; a Bridge config whose "
            "Hugging Face tokenizer decides the vocabulary leaves it null: pass --vocab-size / vocab_size)"
        )
    hidden, heads = int(values["hidden_size"]), int(values["num_attention_heads"])
    arch = {
        "ffn_hidden_size": 4 * hidden,
        "num_query_groups": heads,
        "kv_channels": max(1, hidden // heads),
        **{k: values[k] for k in ARCHITECTURE if values.get(k) is not None},
    }
    arch["seq_length"] = int(values.get("seq_length") or (base.seq_length if base else 4096))
    if base is None:
        return ModelSpec(name=str(values.get("model") or "config"), **arch, **extras)
    return replace(base, **arch, **extras)


# Inputs Setup carries under their own name (``_setup``); the others build the model (ARCHITECTURE), the GPU (_gpu),
# the constraints, the time model's rates, the decision or the evidence. tests/plan/test_inputs.py fails on an input
# that lands in neither, so adding one the planner reads is its field on PlanInputs and its attribute on Setup.
SETUP_INPUTS = tuple(f.name for f in dataclasses.fields(Setup) if f.name in PlanInputs.model_fields)


def _setup(values: dict[str, Any]) -> Setup:
    """Setup from the merged inputs: each of SETUP_INPUTS as given (unset: Setup's default), then the few whose shape
    differs settled in this one place ("none" is None, lists are tuples, the layout text is parsed)."""
    s = Setup(**{n: values[n] for n in SETUP_INPUTS if values.get(n) is not None})
    fp8 = None if s.fp8_recipe == "none" else s.fp8_recipe
    fine_grained = bool(values.get("fine_grained_activation_offloading"))
    s = replace(
        s,
        recompute_granularity=None if s.recompute_granularity == "none" else s.recompute_granularity,
        recompute_modules=tuple(s.recompute_modules),
        fp8_recipe=fp8,
        fp8_param=s.fp8_param and fp8 is not None,
        offload_modules=tuple(s.offload_modules) if fine_grained else (),
    )
    return with_layout(s, values["pipeline_layout"]) if values.get("pipeline_layout") else s


def _check_size(m: ModelSpec, s: Setup) -> None:
    if m.is_moe and s.ep >= 1:
        work = m.num_layers * (m.experts // s.ep)
        if work > MAX_LOCAL_EXPERT_LAYERS:
            raise InputError(
                f"num_layers × num_moe_experts / ep = {m.num_layers} × {m.num_moe_experts} / {s.ep} = {work}: at "
                f"most {MAX_LOCAL_EXPERT_LAYERS} (the estimator lists every local expert of every layer); raise ep"
            )


def _default_gpus(s: Setup, m: ModelSpec) -> int:
    """Smallest multiple of both TP·PP·CP and PP·EP·ETP that is at least 8 (one node)."""
    unit = math.lcm(s.tp * s.pp * s.cp, s.pp * s.ep * s.resolved_etp(m))
    return unit * max(1, math.ceil(8 / unit))


# The hardware inputs that replace the GPU preset's figure of the same name.
_GPU_FIGURES = tuple(n for n in FIELDS if group_of(n) == "hardware" and n in GpuPreset.__dataclass_fields__)


def _gpu(values: dict[str, Any]) -> GpuPreset:
    capacity = values.get("gpu_memory_gb")
    return with_overrides(
        gpu_preset(values["gpu"]),
        hbm_gb=capacity,
        capacity_gib=capacity * 1e9 / 2**30 if capacity is not None else None,
        **{n: values.get(n) for n in _GPU_FIGURES},
    )


def _effective_notes(eff: Effective | None, where: dict[str, str], cfg_source: str) -> dict[str, str]:
    """For a value the config decided other than by writing it (mixed_precision, Bridge's finalize(), derived):
    the effective config's source, so the assumption says what ``effective`` says."""
    if eff is None:
        return {}
    out = {}
    for name, dotted in {**CONFIG_KEYS, **fields.EFFECTIVE_KEYS}.items():
        entry = eff.values.get(dotted)
        if entry is not None and where.get(name) == cfg_source and entry.source != cfg_source:
            out[name] = f"effective {dotted}: {entry.source}"
    return out


def _assumptions(values: dict[str, Any], where: dict[str, str], notes: dict[str, str]) -> list[Assumption]:
    out = []
    for name in FIELDS:
        if name in _NOT_ASSUMPTIONS or values.get(name) is None:
            continue
        out.append(Assumption(name=name, value=values[name], source=where.get(name, "default"), note=notes.get(name)))
    return out


def _batch_assumptions(s: Setup, where: dict[str, str]) -> list[Assumption]:
    """The global batch and micro-batches per step behind every step time (``implied.batch``)."""
    rows = implied.batch(s, where.get("global_batch_size"))
    return [Assumption(name=n, value=v, source=src, note=note) for n, v, src, note in rows]


def resolve(
    flags: dict[str, Any] | None = None,
    config: OffloadConfig | None = None,
    raw: dict[str, Any] | None = None,
    source: str | None = None,
    asked: Collection[str] = (),
) -> Resolved:
    """Merge defaults, the model preset's recipe, a config and flags; validate; build the models' inputs.

    Args:
        flags: input name → value given directly (CLI flags, MCP parameters); ``None`` values are ignored.
        config: a loaded Bridge config or Megatron-LM argv (``sources.load``), or None.
        raw: the config's raw dict (tells which keys it sets).
        source: where the config came from (``recipe:NAME`` marks a Bridge recipe for ``config.effective``).
        asked: names of ``flags`` that describe another run than the one measured (a plot's swept input); the
            user's evidence is moved to them, never anchored at them (``plan/evidence/runs.py``).

    Returns:
        The merged ``PlanInputs``, the source of each value, the model, setup, GPU and constraints.

    Raises:
        InputError: a value out of bounds, or model sizes missing (the message names them).
        KeyError: an unknown model or GPU preset.
        ValueError: a setup Megatron rejects.
    """
    from mbridge_offload.plan.inputs.presets import model_extras, model_preset, recipe_values

    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    validate_inputs(flags)  # bounds of what was given directly, named as flags
    cfg_source = "argv" if config is not None and config.env.get("frontend") == "megatron-lm" else "config"
    if config is not None:
        parallel_sizes.check(raw, cfg_source)  # a size of 0 or below: no run to size (every tool refuses it)
    eff = resolve_config(config, raw, source=source) if config is not None else None
    cfg = config_values(eff) if eff is not None else {}
    name = flags.get("model")
    base = model_preset(name) if name else None
    preset = recipe_values(name) if name else {}
    defaults = {k: v for k, (v, _) in DEFAULTS.items()}
    _check_measured_settings(flags)
    printed = _log_settings(flags.get("measured_log"))
    layers = [("default", defaults), ("preset", preset), ("log", printed), (cfg_source, cfg), ("flag", flags)]
    values, where = _merge(layers)
    inputs = validate_inputs(values, where, CONFIG_KEYS)
    values = inputs.model_dump()
    # Non-input architecture facts (norms, bias, MLA, dense layers) a config states.
    extras = model_extras(config, raw if raw is not None else config.model_dump(), base) if config is not None else {}
    tying_note = _tying(values, where, config, raw, name)
    m = replace(_model_spec(values, base, extras), tied_embeddings=bool(values["share_embeddings_and_output_weights"]))
    if values.get("pipeline_layout") and not m.mtp_num_layers:
        from mbridge_offload.plan.model.layout import mtp_layers

        # megatron-core asserts that the layout's MTP layers are mtp_num_layers: the layout alone says how many
        m = replace(m, mtp_num_layers=mtp_layers(layout_text(values["pipeline_layout"]) or ""))
    notes = {k: note for k, (_, note) in DEFAULTS.items() if where.get(k) == "default"}
    notes["share_embeddings_and_output_weights"] = tying_note
    notes.update({k: "printed by the measured log about its own run" for k in printed if where.get(k) == "log"})
    _derive(values, where, notes, m.seq_length, "preset" if base else "default")
    s = replace(_setup(values), manual_gc=manual_gc(config, raw), **moe_step_settings(config, raw, values))
    notes.update(model_notes(values, s, raw))
    notes["hybrid_optimizer"] = hybrid_optimizer_note(s)
    notes = {**_effective_notes(eff, where, cfg_source), **notes}
    _check_size(m, s)
    if values.get("num_gpus") is None:
        values["num_gpus"], where["num_gpus"] = _default_gpus(s, m), "derived"
        notes["num_gpus"] = "smallest multiple of TP·PP·CP and PP·EP·ETP that is at least 8"
    s = replace(s, num_gpus=values["num_gpus"])
    check_setup(m, replace(s, optimizer_offload_fraction=0.0, activation_offload_layers=0))
    constraints = Constraints({k: values[k] for k in CONSTRAINT_INPUTS}, hybrid_stack=m.layer_pattern is not None)
    final = PlanInputs.model_validate({k: values.get(k) for k in FIELDS})
    assumptions = _assumptions(values, where, notes) + _batch_assumptions(s, where)
    raw_config = raw if raw is not None else (config.model_dump(mode="json") if config is not None else None)
    s = replace(s, expandable_segments=expandable_segments(raw_config))
    profile = _host_profile(final)
    call = Call(flags, config, raw, source, frozenset(asked))
    return Resolved(final, where, m, s, _gpu(values), constraints, assumptions, raw_config, eff, profile, call)


def _check_measured_settings(flags: dict[str, Any]) -> None:
    """``measured_settings`` read as inputs, and only beside evidence of the run they describe.

    Raises:
        InputError: an item that is not NAME=VALUE of a run setting, or no evidence to go with them.
    """
    if not measured_settings(flags.get("measured_settings")):
        return
    evidence = ("measured_log", "measured_peak_gib", "measured_step_s", "ooms")
    if not any(flags.get(k) not in (None, False) for k in evidence):
        raise InputError(
            "measured_settings describe the run a measurement comes from, and none is given",
            "pass measured_log, measured_peak_gib, measured_step_s or ooms with them, or drop measured_settings",
        )


def _log_settings(log: str | None) -> dict[str, Any]:
    """What the measured log printed about its own run (``plan/evidence/settings.py``): it fills what neither the
    config nor a flag states, above a preset's guesses. Where the config or a flag says otherwise, the asked run keeps
    theirs and the measured run the log's (``plan/evidence/runs.py``)."""
    if not log:
        return {}
    from mbridge_offload.plan.evidence.read import read_log
    from mbridge_offload.plan.evidence.settings import parse_settings

    return parse_settings(read_log(log)).as_inputs()


def _derive(
    values: dict[str, Any], where: dict[str, str], notes: dict[str, str], seq_length: int, seq_source: str
) -> None:
    """The inputs upstream derives from others when they are not given (ETP, the sequence, fine-grained defaults)."""
    if values.get("etp") is None:
        values["etp"], where["etp"] = values["tp"], "default"
        notes["etp"] = "megatron-core default: expert_tensor_parallel_size = TP"
    if values.get("seq_length") is None:
        values["seq_length"], where["seq_length"] = seq_length, seq_source
    if values.get("offload_modules") and where.get("fine_grained_activation_offloading", "default") == "default":
        values["fine_grained_activation_offloading"] = True
        where["fine_grained_activation_offloading"] = "derived"
        notes["fine_grained_activation_offloading"] = "on because offload_modules is given"
    if values.get("fine_grained_activation_offloading") and values.get("offload_modules"):
        for name, (value, note) in FINE_GRAINED_DEFAULTS.items():  # assumptions only where they matter
            if values.get(name) is None:
                values[name], where[name], notes[name] = value, "default", note
    if values.get("cross_entropy_loss_fusion"):
        for name, (value, note) in LOSS_FUSION_DEFAULTS.items():
            if values.get(name) is None:
                values[name], where[name], notes[name] = value, "default", note


def _tying(
    values: dict[str, Any], where: dict[str, str], config: OffloadConfig | None, raw: dict[str, Any] | None, preset: Any
) -> str:
    """Decide ``share_embeddings_and_output_weights`` where no input did (``values`` and ``where`` updated): the
    model's family, else the frontend's default (``plan/inputs/family.py``). Returns the assumption's note."""
    key = "share_embeddings_and_output_weights"
    worth = family.output_layer_note(int(values["vocab_size"] or 0), int(values["hidden_size"] or 0), values["pp"])
    if where.get(key, "default") == "preset":
        return f"the {preset} preset (its config.json); {worth}"
    if where.get(key) == "argv":
        return f"Megatron-LM ties them unless --untie-embeddings-and-output-weights is given; {worth}"
    if where.get(key, "default") != "default":
        return worth
    frontend = None if config is None else str(config.env.get("frontend", "bridge"))
    names = raw if raw is not None else (config.model_dump(mode="json") if config is not None else None)
    values[key], where[key], note = family.tying({k: values[k] for k in family.SIZES}, names, frontend)
    return f"{note}; {worth}"


def _host_profile(i: PlanInputs) -> HostProfile | None:
    """The host profile the caller named, or None: nothing is looked up unless asked for (no HOME default).

    Raises:
        InputError: both ``host_profile`` and ``calibration`` given, or the profile cannot be read.
    """
    if i.host_profile is not None and i.calibration is not None and i.host_profile != i.calibration:
        raise errors.InputError(
            "pass host_profile or calibration, not both", "use --host-profile NAME|FILE (calibration is its old name)"
        )
    ref = i.host_profile or i.calibration
    return host_profile.load(ref) if ref else None
