"""The offload settings a log states, in upstream's own formats, and what they say of each OOM reading.

A training log prints the settings it ran with: Megatron-LM's argument dump (``optimizer_cpu_offload ...... True``),
its command line (``--optimizer-offload-fraction 0.5``), a Bridge YAML or Hydra override (``optimizer_cpu_offload:
true``, ``optimizer.optimizer_offload_fraction=0.5``), a dataclass repr or a dict (``optimizer_cpu_offload=False``,
``'cpu_offloading': True``). Read without a config, these decide which offload was on, so that an out-of-memory
message gets the reading of its run, not a guess. Only the four offload settings are read, by their names;
no sentence is interpreted. Plain Python: no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAMES = ("optimizer_cpu_offload", "optimizer_offload_fraction", "cpu_offloading", "cpu_offloading_num_layers")
_VALUE = r"(?P<value>true|false|yes|no|on|off|none|null|[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?)\b"
# ``name ..... value`` (the argument dump), ``name: value``, ``name = value``, ``'name': value``; the name is whole
# (``use_torch_optimizer_for_cpu_offload`` is not ``optimizer_cpu_offload``); a dotted prefix is a section.
_KEYED = re.compile(
    rf"(?<![\w-])[\"']?(?P<name>{'|'.join(_NAMES)})[\"']?\s*(?:\.{{2,}}\s*:?|:|=)\s*[\"']?{_VALUE}", re.IGNORECASE
)
# Megatron-LM's flags: a bare ``--optimizer-cpu-offload`` is on.
_FLAG = re.compile(
    rf"(?<![\w-])--(?P<name>{'|'.join(n.replace('_', '-') for n in _NAMES)})(?![\w-])(?:[ =]{_VALUE})?",
    re.IGNORECASE,
)


def _value(text: str | None) -> bool | float | None:
    if text is None:
        return True  # a bare flag
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    return float(low)


@dataclass(frozen=True)
class Stated:
    """What a text states about the two offloads: True on, False off, None not said; and the lines saying so."""

    optimizer: bool | None
    fraction: float | None
    activation: bool | None
    lines: dict[str, str]

    def line(self, *names: str) -> str:
        """The log line(s) that state these settings, for a reason."""
        return "; ".join(dict.fromkeys(self.lines[n] for n in names if n in self.lines))


def stated(text: str) -> Stated:
    """Which offloads ``text`` says were on or off; the last value stated for each setting wins."""
    found: dict[str, bool | float | None] = {}
    lines: dict[str, str] = {}
    for line in text.splitlines():
        for hit in (*_KEYED.finditer(line), *_FLAG.finditer(line)):
            name = hit.group("name").lower().replace("-", "_")
            found[name], lines[name] = _value(hit.group("value")), line.strip()[:300]
    opt, frac = found.get("optimizer_cpu_offload"), found.get("optimizer_offload_fraction")
    fraction = frac if isinstance(frac, float) else None
    if not isinstance(opt, bool):
        # A fraction alone, written by the user (an override, a flag), says optimizer offload was used at it.
        opt = (fraction > 0) if fraction is not None else None
    act, layers = found.get("cpu_offloading"), found.get("cpu_offloading_num_layers")
    if not isinstance(act, bool):
        act = (layers > 0) if isinstance(layers, float) else None
    return Stated(optimizer=opt, fraction=fraction, activation=act, lines=lines)


def verdict(mode_id: str, st: Stated) -> tuple[bool, str] | None:
    """What the stated settings say of an OOM or slowdown reading without a config: (True, "") offered,
    (False, reason) ruled out, None when they do not decide."""
    opt, act, frac = st.optimizer, st.activation, st.fraction
    full = bool(opt) and frac is not None and frac >= 1.0
    act_line = st.line("cpu_offloading", "cpu_offloading_num_layers")
    opt_line = st.line("optimizer_cpu_offload", "optimizer_offload_fraction")
    if mode_id == "oom_activation_offload":
        if act is None:
            return None
        return (True, "") if act else (False, f"the text states activation offload off ({act_line})")
    if mode_id == "oom_partial_optimizer_offload":
        if act:
            return False, f"the text states activation offload on ({act_line}): the activation-offload reading applies"
        if opt is False:
            return False, f"the text states optimizer offload off ({opt_line})"
        if full:
            return False, f"the text states every optimizer state on the host ({opt_line}): the full-offload reading"
        return (True, "") if opt else None
    if mode_id == "oom_full_optimizer_offload":
        if full and not act:
            return True, ""
        if opt is False or act or (frac is not None and frac < 1.0):
            return False, f"the text does not state every optimizer state offloaded ({opt_line or act_line})"
        return None
    if mode_id == "oom_no_offload":
        if opt or act:
            return False, f"the text states an offload on ({opt_line if opt else act_line})"
        return (True, "") if opt is False and act is False else None
    if mode_id == "slowdown" and opt is False and act is False:
        return False, f"the text states nothing is offloaded ({opt_line}; {act_line}): the slowdown has another cause"
    return None
