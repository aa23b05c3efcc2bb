"""Which key edits a mode implies: ``plan_edits(cfg, raw, mode)`` → ``(resolved mode, {key: (value, why)})``.

Each mode is an entry of ``MODE_EDITS`` (name → the edit planners it runs, in order), so a new mode is one function
and one table row. The constraints of activation offload come from the rule catalogue
(``config.rules.activation``), not from here. Never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mbridge_offload.actions.apply import fine_grained as fge
from mbridge_offload.actions.apply.result import ApplyError
from mbridge_offload.config.rules.activation.layer_offload import activation_mode_edits
from mbridge_offload.config.rules.optimizer.offload import OVERLAP_FROM_FRACTION, overlap_advised
from mbridge_offload.config.schema import OffloadConfig
from mbridge_offload.config.sources import override_value

DEFAULT_FRACTION = 0.5  # the card's "0.5 for balanced"
# Planner inputs (``PlanInputs``) that apply's CLI flags and MCP parameters spell otherwise: apply's ``num_layers`` is
# ``cpu_offloading_num_layers``; the model's own layer count comes from the config (``model.num_layers``). Every
# other planner input is an apply input of the same name (mode=recommended / option).
# ``te_version`` is apply's environment fact as validate describes it; the same value reaches the planner.
APPLY_OWN_INPUTS = frozenset({"num_layers", "te_version"})
Edits = dict[str, tuple[Any, str]]


def _optimizer_mode(cfg: OffloadConfig, fraction: float | None, _layers: int | None, edits: Edits) -> None:
    opt = cfg.optimizer
    edits["optimizer.optimizer_cpu_offload"] = (True, "master switch for HybridDeviceOptimizer")
    if fraction is None:
        fraction = opt.optimizer_offload_fraction if opt.optimizer_offload_fraction > 0 else DEFAULT_FRACTION
        why = (
            "kept the fraction already set"
            if opt.optimizer_offload_fraction > 0
            else f"Bridge's default 0.0 offloads nothing; {DEFAULT_FRACTION} is the balanced starting point "
            "(pass a fraction, or mode=recommended to size it)"
        )
    else:
        why = "the requested share of optimizer states on the CPU"
    edits["optimizer.optimizer_offload_fraction"] = (float(fraction), why)
    if overlap_advised(fraction) and not opt.overlap_cpu_optimizer_d2h_h2d:
        why = f"at fraction >= {OVERLAP_FROM_FRACTION} overlapping D2H/H2D with the CPU step pays (OPT-OVERLAP)"
        edits["optimizer.overlap_cpu_optimizer_d2h_h2d"] = (True, why)
    if not opt.decoupled_weight_decay:
        why = "Megatron Core asserts 'CPU offloading only supported with decoupled_weight_decay enabled (AdamW mode)'"
        edits["optimizer.decoupled_weight_decay"] = (True, why)


def _catalogue_errors(model: Any, num_layers: int | None, rule: str) -> list[str]:
    """The catalogue's message for ``rule`` if it fires with activation offload of ``num_layers`` on ``model``."""
    from mbridge_offload.config.validate import activation_offload_errors

    fields = {
        "num_layers": model.num_layers,
        "pipeline_model_parallel_size": model.pipeline_model_parallel_size,
        "cpu_offloading_num_layers": num_layers,
    }
    return [message for rule_id, message in activation_offload_errors(fields) if rule_id == rule]


def _activation_mode(cfg: OffloadConfig, _fraction: float | None, num_layers: int | None, edits: Edits) -> None:
    model = cfg.model
    pp = model.pipeline_model_parallel_size
    if _catalogue_errors(model, 1, "ACT-PP"):
        raise ApplyError(
            f"activation offloading needs model.pipeline_model_parallel_size=1, but it is {pp}; Megatron Core raises "
            "'Currently there is no support for Pipeline parallelism with CPU offloading'. Changing PP changes the "
            "per-GPU memory of everything else, so it is not done silently: use mode=optimizer (works with PP>1), "
            "or set model.pipeline_model_parallel_size=1 yourself and run again"
        )
    total = None if model.num_layers is None else int(model.num_layers)
    layers: int
    if num_layers is None:
        if model.cpu_offloading_num_layers > 0:
            layers, why = int(model.cpu_offloading_num_layers), "kept the layer count already set"
        elif total:
            layers = max(1, min(total - 1, total // 2))
            why = "half the layers as a starting point (pass num_layers, or mode=recommended to size it)"
        else:
            raise ApplyError(
                "activation offloading needs a layer count: pass num_layers (--num-layers K), "
                "or give model.num_layers in the config so a default can be chosen"
            )
    else:
        layers, why = num_layers, "the requested number of offloaded layers"
    if layers < 1:
        raise ApplyError(f"num_layers is {layers}: offloading 0 layers does nothing; pass at least 1")
    for message in _catalogue_errors(model, layers, "ACT-NUM-LAYERS"):
        raise ApplyError(
            f"num_layers is {layers}, but model.num_layers is {total}: Megatron Core says '{message}'; "
            f"pass at most {(total or 1) - 1}"
        )
    edits["model.cpu_offloading"] = (True, "master switch for layer-level activation offloading")
    edits["model.cpu_offloading_num_layers"] = (int(layers), why)
    # The conflict edits are defined once, beside the rules they resolve (validate's fixes use the same list).
    edits.update({key: (value, reason) for key, value, reason in activation_mode_edits(model)})


def _option_mode(levers: list[str]) -> str:
    """The offload mode an option's levers amount to (what apply's mode table runs before its other keys)."""
    opt, act, fine = "optimizer" in levers, "activation" in levers, "fine-grained" in levers
    if fine:
        return fge.MODE + "+optimizer" if opt else fge.MODE
    return "both" if opt and act else "optimizer" if opt else "activation" if act else "none"


def _recommended(
    cfg: OffloadConfig,
    raw: dict[str, Any],
    planner: dict[str, Any] | None,
    option: int | None = None,
    assumptions: list[dict[str, Any]] | None = None,
) -> tuple[str, list[str], str | None]:
    """The planner's (mode, overrides, advice) on this config: ``recommend``'s own computation with the same
    inputs, so option N here is recommend's option N; its assumptions go into ``assumptions``."""
    try:
        from mbridge_offload.plan import service as plan
    except ImportError as exc:  # pragma: no cover - the planner ships with the package
        raise ApplyError(
            f"mode=recommended needs mbridge_offload.plan.search.planner ({exc}); pick a mode explicitly"
        ) from None
    try:
        rec = plan.recommend_for_config(cfg, raw=raw, **(planner or {}))
    # No model sizes, an unknown preset, a setup Megatron rejects; InputError too (a bound, a levers list, a log).
    except (KeyError, ValueError, TypeError) as exc:
        raise ApplyError(f"mode=recommended: the planner cannot size this config: {str(exc).strip(chr(39))}") from None
    if assumptions is not None:
        assumptions += [a.model_dump(mode="json") for a in rec.assumptions]
    if option is None:
        return str(rec.mode), list(rec.overrides), rec.advice
    if not 0 <= option < len(rec.options):
        raise ApplyError(
            f"option {option}: recommend lists {len(rec.options)} option(s) for this config (0 to "
            f"{len(rec.options) - 1}); run recommend with the same config and flags to see them"
        )
    chosen = rec.options[option]
    return _option_mode(chosen.levers), list(chosen.overrides), f"option {option}: {chosen.why}"


def _recommended_edits(
    cfg: OffloadConfig,
    raw: dict[str, Any],
    planner: dict[str, Any] | None,
    option: int | None,
    modules: list[str] | None,
    notes: list[str] | None,
    assumptions: list[dict[str, Any]] | None = None,
) -> tuple[str, Edits]:
    """Exactly the planner's overrides (its recommendation, or option ``option``): the planner vetted them with the
    rule catalogue on this very config, so nothing is added; each keeps the mode table's reason where it has one."""
    chosen, overrides, advice = _recommended(cfg, raw, planner, option, assumptions)
    if notes is not None:
        notes += [f"the planner chose mode={chosen}", *([advice] if advice else [])]
    wanted = {text.lstrip("+").partition("=")[0]: override_value(text) for text in overrides}
    reasons: Edits = {}
    try:  # the mode table's words for the same keys (its values are not used: the planner's are written)
        if chosen.startswith(fge.MODE):  # fine-grained, fine-grained+optimizer
            fge.fine_grained_edits(cfg, modules or wanted.get("model.offload_modules"), reasons)
        rest = {fge.MODE: None, fge.MODE + "+optimizer": "optimizer"}.get(chosen, chosen)
        if rest is not None:
            fraction = wanted.get("optimizer.optimizer_offload_fraction") if rest in ("optimizer", "both") else None
            layers = wanted.get("model.cpu_offloading_num_layers") if rest in ("activation", "both") else None
            reasons.update(plan_edits(cfg, raw, rest, fraction=fraction, num_layers=layers)[1])
    except ApplyError:
        reasons = {}
    default = "recommended by the planner" if option is None else f"recommend's option {option}"
    return chosen, {key: (value, reasons.get(key, (None, default))[1]) for key, value in wanted.items()}


def requested_edits(overrides: list[str], effective_raw: dict[str, Any]) -> dict[str, Any]:
    """``{section.key: value}`` for the caller's overrides, read back from the overridden config (ApplyError for a
    deletion or a key deeper than ``section.key``: apply cannot write those)."""
    from hydra.core.override_parser.types import OverrideType

    from mbridge_offload.config.sources import parse_overrides

    out: dict[str, Any] = {}
    for override in parse_overrides(list(overrides)):
        parts = override.key_or_group.split(".")
        if override.type == OverrideType.DEL or len(parts) != 2:
            raise ApplyError(
                f"override {override.input_line!r}: apply writes section.key=VALUE overrides into the file; "
                "remove or edit other keys by hand"
            )
        out[override.key_or_group] = effective_raw[parts[0]][parts[1]]
    return out


def plan_edits(
    cfg: OffloadConfig,
    raw: dict[str, Any],
    mode: str,
    *,
    fraction: float | None = None,
    num_layers: int | None = None,
    planner: dict[str, Any] | None = None,
    notes: list[str] | None = None,
    modules: list[str] | None = None,
    option: int | None = None,
    assumptions: list[dict[str, Any]] | None = None,
) -> tuple[str, Edits]:
    """The key edits a mode implies: ``(resolved mode, {dotted key: (new value, why)})``; ApplyError for an unknown
    mode, a fraction or layer count the mode does not take, or activation offload with PP > 1."""
    if mode not in MODES:
        raise ApplyError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if option is not None and (mode != "recommended" or fraction is not None or num_layers is not None):
        raise ApplyError(
            f"option {option} is one of recommend's options: it goes with mode=recommended only, without fraction "
            "or num_layers (the option sets them)"
        )
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise ApplyError(
            f"fraction is {fraction}: optimizer_offload_fraction must be in (0, 1]; 0 offloads nothing "
            "(use mode=none to switch offloading off)"
        )
    if fraction is not None and mode in ("activation", "none", fge.MODE):
        raise ApplyError(
            f"fraction applies to optimizer offloading; mode={mode} does not use it (use mode=optimizer or mode=both)"
        )
    if num_layers is not None and mode in ("optimizer", "none", fge.MODE):
        raise ApplyError(
            f"num_layers applies to activation offloading; mode={mode} does not use it (use "
            "mode=activation or mode=both)"
        )
    edits: Edits = {}
    if mode == "recommended":
        return _recommended_edits(cfg, raw, planner, option, modules, notes, assumptions)
    if modules is not None and mode != fge.MODE:
        raise ApplyError(
            f"modules apply to fine-grained offloading; mode={mode} does not use them (use mode={fge.MODE})"
        )
    if mode == fge.MODE:
        fge.fine_grained_edits(cfg, modules, edits)
    for edit in MODE_EDITS.get(mode, ()):
        edit(cfg, fraction, num_layers, edits)
    return mode, edits


def _off_mode(cfg: OffloadConfig, _fraction: float | None, _layers: int | None, edits: Edits) -> None:
    edits["optimizer.optimizer_cpu_offload"] = (False, "switch optimizer offloading off")
    edits["model.cpu_offloading"] = (False, "switch activation offloading off")
    if cfg.model.fine_grained_activation_offloading:
        edits["model.fine_grained_activation_offloading"] = (False, "switch fine-grained offloading off")


# The mode table: each mode's edit planners, run in order on (cfg, fraction, num_layers, edits). "recommended" is
# resolved to one of these by the planner first. A new mode adds a row (and its name to MODES, CLI and MCP).
ModeEdit = Callable[[OffloadConfig, "float | None", "int | None", Edits], None]
MODE_EDITS: dict[str, tuple[ModeEdit, ...]] = {
    "optimizer": (_optimizer_mode,),
    "activation": (_activation_mode,),
    "both": (_optimizer_mode, _activation_mode),
    "none": (_off_mode,),
}
# fine-grained takes its module list (actions/apply/fine_grained.py), not (fraction, num_layers): its own branch above.
MODES = (*MODE_EDITS, fge.MODE, "recommended")
