"""Which run a user's evidence measured, and which run the caller asks about.

A measured figure belongs to the run that produced it: the config as written plus the hardware inputs (GPU, GPU
count, host), and whatever the log printed about that run itself (``settings.py``). Settings the caller changes
(``--set`` overrides, the planner's run flags beside a config, a plot's swept input) describe another run, the
*asked* run; the answer predicts it as measured + model(asked) - model(measured) (``search/anchor.py``) and shows
both runs side by side (``calibration.measured_run`` / ``asked_run``).

Without a config the flags are the only description of the run, so they describe the measured run, except those the
caller marks as asked (``resolve(asked=...)``: a plot sweep's input). ``measured_settings`` (NAME=VALUE) states the
measured run's settings where they differ from the asked run's, over the config as written or the flags. Never imports
torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from mbridge_offload.config.errors import InputError
from mbridge_offload.plan.evidence.settings import LogSettings
from mbridge_offload.plan.inputs.resolve import Resolved, measured_settings, resolve, shared
from mbridge_offload.plan.model.run import Setup

# A setting the user stated (a changed value there is a disagreement, not a value filled in).
_STATED = {"config", "argv", "flag", "measured_settings"}
# What an answer shows of each run besides what differs.
SHOWN = ("num_gpus", "tp", "pp", "cp", "ep", "micro_batch_size", "global_batch_size", "seq_length")


@dataclass
class Mismatch:
    """A setting the log printed that disagrees with what the config (or the flags) says."""

    name: str
    log: int
    given: Any
    source: str
    line_number: int


@dataclass
class Runs:
    """The measured run (``None`` when it cannot be modelled: ``why``), the settings where the asked run differs,
    and what the log printed against what was given."""

    measured: Resolved | None
    changes: list[tuple[str, Any, Any]] = field(default_factory=list)  # (setting, measured, asked)
    mismatches: list[Mismatch] = field(default_factory=list)
    taken_from_log: dict[str, int] = field(default_factory=dict)
    why: str | None = None

    @property
    def same(self) -> bool:
        return self.measured is not None and not self.changes


def _written_inputs(r: Resolved) -> tuple[dict[str, Any], Any, Any]:
    """The flags, config and raw dict that describe the run as written, ``measured_settings`` over them."""
    call = r.call
    assert call is not None
    stated = measured_settings(call.flags.get("measured_settings"))
    if call.config is None:
        return {**{k: v for k, v in call.flags.items() if k not in call.asked}, **stated}, None, None
    config, raw = call.config.written or (call.config, call.raw)
    return {**{k: v for k, v in call.flags.items() if shared(k) and k not in call.asked}, **stated}, config, raw


def value(r: Resolved, name: str) -> Any:
    """The run's value of planner input ``name`` as the models use it."""
    s = r.setup
    if name == "seq_length":
        return s.seq_length or r.model.seq_length
    if name == "global_batch_size":
        return s.global_batch_size
    return getattr(s, name)  # num_gpus, micro_batch_size, tp, pp, cp, ep: Setup's own names


def _differences(measured: Resolved, asked: Resolved) -> list[tuple[str, Any, Any]]:
    out = [
        (f.name, getattr(measured.setup, f.name), getattr(asked.setup, f.name))
        for f in fields(Setup)
        if getattr(measured.setup, f.name) != getattr(asked.setup, f.name)
    ]
    if measured.model.seq_length != asked.model.seq_length and not any(n == "seq_length" for n, _, _ in out):
        out.append(("seq_length", measured.model.seq_length, asked.model.seq_length))
    if measured.model != asked.model and not out:
        out.append(("model", measured.model.name, asked.model.name))
    return out


def runs(r: Resolved, printed: LogSettings | None = None) -> Runs:
    """The measured run of ``r``'s evidence and how the asked run ``r`` differs from it.

    Args:
        r: the resolved asked run (``resolve`` keeps its arguments in ``r.call``).
        printed: the settings the measured log printed about its own run (they describe the measured run).

    Returns:
        The two runs' differences, the log's disagreements with the config, or why the measured run cannot be
        modelled (the evidence is then set aside).
    """
    if r.call is None:  # built by hand: nothing to rebuild the written run from
        return Runs(measured=r)
    log = printed.as_inputs() if printed else {}
    plain = r.call.config is None and not r.call.asked and not r.call.flags.get("measured_settings")
    if plain and all(value(r, name) == v for name, v in log.items()):
        return Runs(measured=r)  # the flags and the log describe one run: the one asked about
    flags, config, raw = _written_inputs(r)
    try:
        written = resolve(flags, config, raw, r.call.source)
        out = Runs(measured=written)
        for name, logged in log.items():
            given, source = value(written, name), written.sources.get(name, "default")
            if name in measured_settings(r.call.flags.get("measured_settings")):
                source = "measured_settings"
            if given == logged:
                continue
            out.taken_from_log[name] = logged
            if source in _STATED:
                assert printed is not None
                out.mismatches.append(Mismatch(name, logged, given, source, printed.values[name].line_number))
        if out.taken_from_log:
            out.measured = resolve({**flags, **out.taken_from_log}, config, raw, r.call.source)
    except (InputError, ValueError, KeyError) as exc:
        return Runs(measured=None, why=f"the run the evidence measured cannot be modelled: {exc}")
    assert out.measured is not None
    out.changes = _differences(out.measured, r)
    return out
