"""What the planner checks and adds around its search: catalogue vetting, the as-given comparison, a fallback.

- ``Vetter``: a candidate offload is proposed only if the rule catalogue raises no error *and no warning* on it
  that the config without offload does not already raise (e.g. TE's ACT-NO-OVERLAP at ``num_layers − 1``).
- ``given_mode`` / ``advice_sentence``: ``before`` is the config as given, offload included; when the advice is to
  switch an offload off, the answer says so in words.
- ``headroom_bytes``: the headroom a fallback must free (``options.fallback`` finds the cheapest offload that frees it).

Never imports torch.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

from mbridge_offload.config.overrides import format_override
from mbridge_offload.plan.inputs.resolve import catalogue_keys
from mbridge_offload.plan.model.architecture import GiB
from mbridge_offload.plan.model.run import Setup
from mbridge_offload.plan.search import fine_grained_plan

# Without a headroom asked for (--headroom-gib), a fallback frees this share of the allocatable budget.
DEFAULT_HEADROOM_SHARE = 0.10


def overrides_for(s: Setup, overlap: bool = True) -> list[str]:
    """The Hydra-style overrides that switch on the offload settings of ``s`` (``config.overrides`` format)."""
    out = []
    if s.optimizer_offload_fraction > 0:
        out += [
            format_override("optimizer.optimizer_cpu_offload", True),
            format_override("optimizer.optimizer_offload_fraction", round(s.optimizer_offload_fraction, 4)),
            format_override("optimizer.overlap_cpu_optimizer_d2h_h2d", overlap),
        ]
    if s.activation_offload_layers > 0:
        out += [
            format_override("model.cpu_offloading", True),
            format_override("model.cpu_offloading_num_layers", s.activation_offload_layers),
            format_override("model.cpu_offloading_activations", True),
            format_override("model.cpu_offloading_weights", False),
        ]
    return out + fine_grained_plan.overrides(s)


def mode_of(s: Setup) -> str:
    """none, optimizer, activation, both, fine-grained or fine-grained+optimizer: which offloads ``s`` switches on."""
    opt, act = s.optimizer_offload_fraction > 0, s.activation_offload_layers > 0
    if s.offload_modules:
        return fine_grained_plan.MODE_WITH_OPTIMIZER if opt else fine_grained_plan.MODE
    return "both" if opt and act else "optimizer" if opt else "activation" if act else "none"


def switch_off_overrides(given: Setup, kept: Setup | None = None) -> list[str]:
    """The overrides that remove the offloads of the config as given that ``kept`` does not use (what
    ``apply --mode none`` writes when ``kept`` is None)."""
    out = []
    if given.optimizer_offload_fraction > 0 and not (kept and kept.optimizer_offload_fraction > 0):
        out.append(format_override("optimizer.optimizer_cpu_offload", False))
    if given.activation_offload_layers > 0 and not (kept and kept.activation_offload_layers > 0):
        out.append(format_override("model.cpu_offloading", False))
    return out


def advice_sentence(
    given: Setup, mode: str, given_factor: float | None = None, instead: str | None = None
) -> str | None:
    """The advice in words when it changes the offload the config already has; None when it has none.

    ``given_factor``: the predicted step-time factor of the config as given (over the same run without its offload).
    ``instead``: the recommended option when it pulls a lever other than offload (recompute, TP, CP, MBS)."""
    had = mode_of(given)
    if had == "none":
        return None
    what = []
    if given.optimizer_offload_fraction > 0:
        what.append(f"optimizer offload at fraction {given.optimizer_offload_fraction:g}")
    if given.activation_offload_layers > 0:
        what.append(f"activation offload of {given.activation_offload_layers} layers")
    if given.offload_modules:  # fine-grained offloading: without it the sentence would read "has ;"
        what.append(f"fine-grained activation offload of {', '.join(given.offload_modules)}")
    has = " and ".join(what) or f"{had} offload"
    cost = f" (predicted step time x{given_factor:.2f} with it)" if given_factor is not None else ""
    if instead is not None:
        return f"the config as given has {has}{cost}; the advice is {instead} ('after'; options[0])"
    if mode == "none":
        return (
            f"the config as given has {has}{cost}; it fits without: the advice is to switch that offload off "
            "(apply --mode recommended does; 'before' is the config as given, 'after' the advice)"
        )
    return f"the config as given has {has}; 'before' is that config, 'after' the advised {mode} offload"


# ------------------------------------------------------------------------------------------- rule catalogue


def _synthesized(s: Setup, num_layers: int, extra: dict[str, Any]) -> dict[str, Any]:
    """A config with the setup's keys the catalogue reads, when the user gave no config (presets and flags)."""
    model = {**catalogue_keys(s, num_layers), **extra}
    if s.pp > 1:
        model["pipeline_dtype"] = "bf16"  # Bridge fills it in
    dist = s.distributed_optimizer
    return {
        "model": model,
        "optimizer": {"use_distributed_optimizer": dist},
        "ddp": {"use_distributed_optimizer": dist},
    }


_ALL_OFF = (format_override("optimizer.optimizer_cpu_offload", False), format_override("model.cpu_offloading", False))


@dataclass
class Vetter:
    """Runs the rule catalogue on candidate overrides: on the user's config when there is one, else on the setup."""

    raw: dict[str, Any] | None
    num_layers: int
    extra: dict[str, Any] = field(default_factory=dict)
    _baseline: set[str] | None = None
    _cache: dict[tuple[str, ...], list[str]] = field(default_factory=dict)
    rejected: dict[str, list[str]] = field(default_factory=dict)  # mode → why its fitting candidates were refused
    source: str | None = None  # the config's source: a recipe is a Bridge config (config.effective reads it so)
    # The setup the candidates change (recommend's base): a candidate's recompute and layout changes from it are
    # vetted with its offload (levers.lever_overrides); None: offload keys only.
    base: Setup | None = None

    def _findings(self, s: Setup, overrides: list[str]) -> list[Any]:
        from mbridge_offload.config import sources
        from mbridge_offload.config.validate import validate

        edited = copy.deepcopy(self.raw) if self.raw is not None else _synthesized(s, self.num_layers, self.extra)
        model = edited.setdefault("model", {})
        if isinstance(model, dict) and model.get("num_layers") is None:
            # A config that leaves the model to --model (a preset): without its layer count the catalogue cannot
            # check an offload's layers against it (ACT-NO-OVERLAP at L - 1, the L-layer limit).
            model["num_layers"] = self.num_layers
        sources.apply_overrides(edited, overrides)
        return list(validate(sources.build_config(edited, "<candidate>"), edited, source=self.source).findings)

    def problems(self, s: Setup, overlap: bool = True) -> list[str]:
        """``rule: message`` for each error, and each warning the config without offload does not raise."""
        from mbridge_offload.plan.search.levers import lever_overrides

        key = tuple((lever_overrides(self.base, s) if self.base is not None else []) + overrides_for(s, overlap))
        if key not in self._cache:
            off = replace(self.base or s, optimizer_offload_fraction=0.0, activation_offload_layers=0)
            if self._baseline is None:
                base = self._findings(off, list(_ALL_OFF))
                self._baseline = {f.rule for f in base if f.severity == "warning"}
            found = self._findings(s, [*_ALL_OFF, *key])
            self._cache[key] = [
                f"{f.rule}: {f.message}"
                for f in found
                if f.severity == "error" or (f.severity == "warning" and f.rule not in self._baseline)
            ]
        return self._cache[key]

    def clean(self, s: Setup) -> bool:
        return not self.problems(s)


# ------------------------------------------------------------------------------------------- fallback


def headroom_bytes(asked_gib: float | None, budget_bytes: float) -> tuple[float, str]:
    """The headroom a fallback must free, and where that figure comes from."""
    if asked_gib is not None:
        return asked_gib * GiB, "asked for (--headroom-gib)"
    return DEFAULT_HEADROOM_SHARE * budget_bytes, f"default: {DEFAULT_HEADROOM_SHARE:.0%} of the allocatable budget"
