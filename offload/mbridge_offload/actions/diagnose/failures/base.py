"""What a known failure mode is (:class:`FailureMode`), and the fixes that read the config or the matched text.

Plain Python: no torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from mbridge_offload.actions.apply.plan import DEFAULT_FRACTION
from mbridge_offload.config.rules.optimizer.offload import overlap_advised
from mbridge_offload.config.schema import OffloadConfig

# A fix computed from the config and the upstream message's match (None: the caller named the failure as a symptom).
FixFn = Callable[[OffloadConfig | None, "re.Match[str] | None"], list[str]]


@dataclass(frozen=True)
class FailureMode:
    """A known way an offload run fails, with what to tell the user.

    ``patterns`` match upstream's own output only (an exception's message, a traceback frame, a kernel or launcher
    line); a failure that has no such message (a slowdown, a loss that jumps) is named by the caller as a symptom
    (its ``id``), never read from a sentence.
    """

    id: str
    title: str
    patterns: tuple[str, ...]
    cause: str
    confirm: str
    fix: tuple[str, ...] | FixFn = ()
    actions: tuple[str, ...] = ()
    references: tuple[str, ...] = ()
    # Only match when this holds for the given config (None config: always).
    when: Callable[[OffloadConfig], bool] | None = None
    # Without a config (and without the offload settings a log states), report it on its message alone; False for the
    # OOM readings, which the settings tell apart (a plain OOM is no reading's until then: oom_unattributed).
    without_config: bool = True
    # With a config: the reason it excludes this mode (key and value), or None (``failure_conditions``).
    rules_out: Callable[[OffloadConfig], str | None] | None = None
    # With a config: the cause told with the config's values, instead of ``cause``.
    explain: Callable[[OffloadConfig], str] | None = None
    # Modes this one explains better when both match: (id, why the other one does not apply).
    supersedes: tuple[tuple[str, str], ...] = ()
    # The overrides of the confirming experiment (``confirm``): they show the cause, they do not fix it (e.g.
    # resuming without the optimizer state throws that state away), so they never appear in ``fix``.
    confirm_with: tuple[str, ...] = ()
    # What the report's ``needs`` asks for when this mode matched without a config (or with an empty fix).
    needs: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------- fixes that read the config


def _fraction(cfg: OffloadConfig | None) -> float | None:
    if cfg is None or not cfg.optimizer.optimizer_cpu_offload:
        return None
    return cfg.optimizer.optimizer_offload_fraction


def fraction_overrides(fraction: float) -> list[str]:
    """The fraction, and the overlap switch where the rule catalogue advises it (OPT-OVERLAP's one threshold,
    the same that ``apply`` and the planner use): never overlap advice that ``validate`` would not give."""
    out = [f"optimizer.optimizer_offload_fraction={fraction}"]
    if overlap_advised(fraction):
        out.append("optimizer.overlap_cpu_optimizer_d2h_h2d=true")
    return out


def fix_slowdown(cfg: OffloadConfig | None, _m: re.Match[str] | None) -> list[str]:
    current = _fraction(cfg)
    lower = 0.5 if current is None else max(0.25, round(current - 0.25, 2))
    if cfg is not None and cfg.model.cpu_offloading and not cfg.optimizer.optimizer_cpu_offload:
        layers = max(1, cfg.model.cpu_offloading_num_layers // 2)
        return [f"model.cpu_offloading_num_layers={layers}"]
    return fraction_overrides(lower)


# Megatron-LM's validate_args checks of the offload flags (rule ids, origin megatron-lm); their AssertionError texts
# are matched from the rule catalogue, the one source of their fixes.
_MLM_RULES = ("ACT-MLM-FG-TE-IMPL", "OPT-MLM-FP8-PARAM-GATHER", "OPT-MLM-PRECISION-AWARE")


def mlm_actions() -> tuple[str, ...]:
    from mbridge_offload.config.megatron_lm.fixes import flag_edit
    from mbridge_offload.config.rules.catalogue import get_rule

    out = []
    for rule_id in reversed(_MLM_RULES):  # the check every --optimizer-cpu-offload meets first
        rule = get_rule(rule_id)
        flags = [" ".join(edit[0]) for f in rule.fix or () if (edit := flag_edit(f))]
        out.append(f"if the AssertionError reads {rule.message!r}: add {' '.join(flags)} ({rule_id})")
    return tuple(out)


def fix_layer_range(cfg: OffloadConfig | None, m: re.Match[str] | None) -> list[str]:
    total: int | None = None
    if m is not None and m.groupdict().get("n"):
        total = int(m.group("n"))  # the layer count upstream's message states
    elif cfg is not None and cfg.model.num_layers:
        total = int(cfg.model.num_layers)
    return [f"model.cpu_offloading_num_layers={total - 1}"] if total else []


# PyTorch's own GPU out-of-memory messages (the caching allocator's, the CUDA runtime's).
OOM_PATTERNS = (r"CUDA out of memory", r"OutOfMemoryError", r"CUDA error: out of memory")
# Optimizer offload starts where `apply` starts it (the balanced starting point).
START_FRACTION = DEFAULT_FRACTION
SWITCH_TO_OPTIMIZER = (
    "model.cpu_offloading=false",
    "optimizer.optimizer_cpu_offload=true",
    *fraction_overrides(START_FRACTION),
)
