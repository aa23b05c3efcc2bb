"""What in a log or error text is a statement about the failure, and what only names a setting, a metric or code.

A training log is mostly not prose: argument dumps (``optimizer_cpu_offload ........ False``), config dumps
(``pin_memory: true``), metric records (``lm loss: 1.23E+00 | elapsed time per iteration (ms): 812.3``), dataclass
reprs (``OptimizerConfig(..., optimizer_cpu_offload=False)``) and traceback frames (``File ".../optimizer.py"``).
Their words name a key, a metric or a code location; they do not say that anything went wrong or which offload was
on. :func:`scope` separates them:

- *fields* (a whole ``key <sep> scalar`` line or ``|``-segment, or an inline ``key=scalar``): blanked from what
  failure patterns and ideas are read from (a setting is not a symptom); the offload settings among them
  are read (:class:`Scoped.settings`): a setting that is on shows its mechanism, one that is off rules it out;
- *traceback frames* (``File "…", line N, in f`` and the source line under it): blanked from the statement text
  (a frame in ``optimizer.py`` says where the allocation failed, not that optimizer offload was on); patterns still
  read them (``_update_fp32_params_by_new_state`` is a known failure's frame).

:func:`attached` decides what a symptom word is about. "slower" in "the loss converges slower" describes the loss,
not the step time: a symptom attaches to the nearest quantity its sentence names (step time, loss or memory), and a
failure mode that declares its quantity (:data:`ABOUT`) counts the symptom only when it attaches there (or when the
sentence names no quantity at all). Plain Python: no torch.
"""

from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from mbridge_offload.actions.diagnose.failures.concepts import CONCEPTS

# A failure mode whose symptom words are generic (slow, increase, ...) and the quantity they must be about:
# mode id -> (the quantities: CONCEPTS ideas, the symptoms: CONCEPTS ideas, one of which its evidence must show).
ABOUT: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "slowdown": (("time",), ("slow", "increase")),
    "resume_loss_jump": (("loss",), ("increase", "random", "nan")),
}
# The quantities a symptom can describe (CONCEPTS ideas): speed, the learning curve, memory.
QUANTITIES = ("time", "loss", "memory")

# A scalar value: a number, a boolean or null, a quoted string, a tuple or list, or one token (a path, a name).
_SCALAR = (
    r"(?:[-+]?\d[\d,_]*(?:\.\d+)?(?:[eE][-+]?\d+)?%?|[-+]?\.\d+|'[^'\n]{0,200}'|\"[^\"\n]{0,200}\"|"
    r"\([^()\n]{0,200}\)|\[[^\[\]\n]{0,400}\]|\{[^{}\n]{0,400}\}|[\w./\-:+@~*]{1,200})"
)
# A whole line or ``|``-segment that is one field: ``key ..... value`` (Megatron's argument dump and timers),
# ``key: value`` (YAML, metric records; a section header has no value), ``key = value``. The key is a name, or a
# few words of a metric ("elapsed time per iteration (ms)"); never an exception ("KeyError: 'x'" is a failure).
_FIELD = re.compile(
    r"^\s*(?:[-*]\s+)?[\"']?(?P<key>[A-Za-z_][\w.\-/]*(?:[ \t]+[A-Za-z_(/][\w.\-/()]*){0,7}?)[\"']?"
    rf"\s*(?:\.{{2,}}\s*:?|:|=)\s*(?P<value>{_SCALAR})?\s*,?\s*(?:#.*)?$"
)
_NOT_A_KEY = re.compile(r"(?:interrupt|exit|killed)\b|^(?:info|debug)$", re.I)
# ``key=value`` inside a line: a dataclass repr, Hydra overrides, ``env=value`` (names with a '_' or '.' only, so
# that prose such as "x=2" stays prose).
_INLINE = re.compile(
    rf"(?<![\w.\-])(?P<key>[A-Za-z_][\w\-]*[._][\w.\-]*\w)\s*=\s*(?P<value>{_SCALAR})|"
    rf"[\"'](?P<dkey>[A-Za-z_][\w\-]*[._][\w.\-]*\w)[\"']\s*:\s*(?P<dvalue>{_SCALAR})"  # a dict's or JSON's item
)
# Megatron-LM flags stated on a command line: ``--optimizer-offload-fraction 0.5``, a bare ``--optimizer-cpu-offload``.
_FLAG = re.compile(r"(?<![\w-])--(?P<key>[a-z][\w-]*)(?:[ =](?P<value>[-+]?\d+(?:\.\d+)?|true|false)\b)?", re.I)
# What a log line starts with before its message: ``[rank3]:``, ``[2025-07-01 12:00:00]``, ``INFO:megatron.x:``.
# One space after it at most: the indentation of a traceback's source line is what tells it apart.
_PREFIX = re.compile(r"^(?:\s*\[[^\]\n]{0,80}\]:? ?|\s*(?:INFO|WARNING|DEBUG|ERROR)(?::[\w.]+)*: ?)*")
_FRAME = re.compile(r'^\s*File "[^"\n]+", line \d+')
# An exception's own line states the failure, whatever ``key=value`` it quotes ("moe_x='y' requires ...").
_EXCEPTION = re.compile(r"^\s*(?:[\w.]*(?:Error|Exception|Warning)|Traceback)\b")
_SEGMENT = re.compile(r"[|;\n]|[.!?](?=\s|$)")
# The offload settings a text can state, by their names in Bridge YAML, Megatron-LM's dump and flags.
_SETTINGS = {
    "optimizer_cpu_offload": "optimizer_cpu_offload",
    "optimizer_offload_fraction": "optimizer_offload_fraction",
    "cpu_offloading": "cpu_offloading",
    "cpu_offloading_num_layers": "cpu_offloading_num_layers",
}


@dataclass
class Scoped:
    """A text split into its statements and its fields (:func:`scope`)."""

    text: str
    evidence: str  # the text with its fields blanked: what failure patterns read (same length: offsets agree)
    statement: str  # the evidence with traceback frames blanked too: what ideas are read from
    settings: dict[str, Any] = field(default_factory=dict)  # the offload settings the text states
    setting_lines: dict[str, str] = field(default_factory=dict)  # setting -> the line that states it
    _segments: list[tuple[int, str]] | None = field(default=None, repr=False)

    @property
    def segments(self) -> list[tuple[int, str]]:
        """The statement's sentences (lines, ``|``/``;``-pieces, sentences) as (offset, text), computed once."""
        if self._segments is None:
            self._segments = _segments(self.statement)
        return self._segments


def _value(text: str | None) -> Any:
    """A stated scalar as Python: bool, float, None, or the string."""
    if text is None:
        return True  # a bare flag
    v = text.strip().strip("'\"")
    low = v.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null", "~", ""):
        return None
    try:
        return float(v.replace(",", "").replace("_", ""))
    except ValueError:
        return v


def _setting_name(key: str) -> str | None:
    leaf = key.strip().lstrip("-").replace("-", "_").rsplit(".", 1)[-1].lower()
    return _SETTINGS.get(leaf)


def _blank(chars: list[str], start: int, end: int) -> None:
    for i in range(start, end):
        if chars[i] != "\n":
            chars[i] = " "


def scope(text: str) -> Scoped:
    """Split ``text`` into statements and fields; read the offload settings it states."""
    chars, frames = list(text), []
    out = Scoped(text=text, evidence=text, statement=text)
    offset, after_frame = 0, False
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\n")
        prefix = _PREFIX.match(body)
        start = prefix.end() if prefix else 0
        rest = body[start:]
        if _FRAME.match(rest) or (after_frame and rest[:1].isspace() and rest.strip()):
            frames.append((offset + start, offset + len(body)))
            after_frame = bool(_FRAME.match(rest))
        else:
            after_frame = False
            if not _EXCEPTION.match(rest):
                _read_segments(out, chars, body, offset, start)
            for flag in _FLAG.finditer(body):
                _state(out, flag.group("key"), flag.group("value"), body)
        offset += len(line)
    out.evidence = "".join(chars)
    for a, b in frames:
        _blank(chars, a, b)
    out.statement = "".join(chars)
    return out


def _read_segments(out: Scoped, chars: list[str], body: str, offset: int, start: int) -> None:
    """The fields of one line: whole ``|``-segments of ``key <sep> scalar``, then inline ``key=scalar``."""
    pos = start
    for seg in body[start:].split("|"):
        hit = _FIELD.match(seg)
        whole = bool(hit and not _NOT_A_KEY.search(hit.group("key").strip()))
        if hit and whole:
            _blank(chars, offset + pos, offset + pos + len(seg))
            _state(out, hit.group("key"), hit.group("value") or "", body)
        for inline in _INLINE.finditer(seg):  # also inside a whole field's dict or repr value
            if not whole:
                _blank(chars, offset + pos + inline.start(), offset + pos + inline.end())
            key = inline.group("key") or inline.group("dkey")
            _state(out, key, inline.group("value") or inline.group("dvalue"), body)
        pos += len(seg) + 1


def _state(out: Scoped, key: str, value: str | None, line: str) -> None:
    name = _setting_name(key)
    if name is None or value == "":  # a YAML section header states nothing
        return
    out.settings[name] = _value(value)
    out.setting_lines[name] = line.strip()[:300]


# ---------------------------------------------------------------------------------------------- what is on


@dataclass(frozen=True)
class Stated:
    """What the text states about the two offloads: True on, False off, None not said; and the lines saying so."""

    optimizer: bool | None
    fraction: float | None
    activation: bool | None
    lines: dict[str, str]

    @property
    def ideas(self) -> frozenset[str]:
        """The mechanism ideas (CONCEPTS) a setting that is on shows."""
        out: set[str] = set()
        if self.optimizer:
            out |= {"optimizer", "offload"}
        if self.activation:
            out |= {"activation", "offload"}
        return frozenset(out)

    def line(self, *names: str) -> str:
        """The log line(s) that state these settings, for a reason."""
        return "; ".join(dict.fromkeys(self.lines[n] for n in names if n in self.lines))


def stated(scoped: Scoped) -> Stated:
    """Which offloads the text says were on or off (Megatron-LM: ``--cpu-offloading-num-layers`` > 0 is on)."""
    s = scoped.settings
    opt, frac = s.get("optimizer_cpu_offload"), s.get("optimizer_offload_fraction")
    fraction = float(frac) if isinstance(frac, float) else None
    if not isinstance(opt, bool):
        # A fraction alone, written by the user (an override, a flag), says optimizer offload was used at it.
        opt = (fraction > 0) if fraction is not None else None
    act, layers = s.get("cpu_offloading"), s.get("cpu_offloading_num_layers")
    if not isinstance(act, bool):
        act = (layers > 0) if isinstance(layers, float) else None
    return Stated(optimizer=opt, fraction=fraction, activation=act, lines=dict(scoped.setting_lines))


def verdict(mode_id: str, st: Stated) -> tuple[bool, str] | None:
    """What the text's stated settings say of an OOM or slowdown reading without a config: (True, "") offered,
    (False, reason) ruled out, None when they do not decide (the text's own words then do)."""
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


# ---------------------------------------------------------------------------------------------- attachment


@lru_cache(maxsize=1)
def _regexes() -> dict[str, re.Pattern[str]]:
    return {name: re.compile(pattern, re.IGNORECASE) for name, pattern in CONCEPTS.items()}


def _segments(statement: str) -> list[tuple[int, str]]:
    """The statement's sentences (lines, ``|``/``;``-pieces, sentences): (offset, text)."""
    out, pos = [], 0
    for hit in _SEGMENT.finditer(statement):
        out.append((pos, statement[pos : hit.start()]))
        pos = hit.end()
    out.append((pos, statement[pos:]))
    return [(o, t) for o, t in out if t.strip()]


# "went from 1.2 s to 5.1 s": a change told in numbers, an increase or a decrease by its direction.
_FROM_TO = re.compile(
    r"\bfrom\s+~?(?P<a>\d+(?:\.\d+)?)\s*(?P<unit>[a-z/%]{0,12})\s+to\s+~?(?P<b>\d+(?:\.\d+)?)", re.IGNORECASE
)
# Closer than this is not a change worth a word (run-to-run noise).
_CHANGE = 1.1


def numeric_changes(text: str) -> list[tuple[int, int, str]]:
    """The changes the text tells in numbers: (start, end, ``increase`` or ``decrease``)."""
    out = []
    for m in _FROM_TO.finditer(text):
        a, b = float(m.group("a")), float(m.group("b"))
        if b > a * _CHANGE:
            out.append((m.start(), m.end(), "increase"))
        elif b * _CHANGE < a:
            out.append((m.start(), m.end(), "decrease"))
    return out


def _spans(text: str, ideas: tuple[str, ...]) -> list[tuple[int, int, str]]:
    regexes = _regexes()
    found = [(m.start(), m.end(), idea) for idea in ideas for m in regexes[idea].finditer(text)]
    return found + [c for c in numeric_changes(text) if c[2] in ideas]


def _gap(a: tuple[int, int, str], b: tuple[int, int, str]) -> int:
    return max(0, max(a[0], b[0]) - min(a[1], b[1]))


def _attaches(segment: str, about: tuple[str, ...], symptoms: tuple[str, ...]) -> bool:
    """Some symptom word of the segment describes one of ``about``: its nearest quantity is one of them, or the
    segment names no quantity (nothing else it could describe)."""
    quantities = _spans(segment, QUANTITIES)
    for symptom in _spans(segment, symptoms):
        if not quantities:
            return True
        nearest = min(_gap(symptom, q) for q in quantities)
        if any(q[2] in about for q in quantities if _gap(symptom, q) == nearest):
            return True
    return False


def attached(mode_id: str, scoped: Scoped, span: tuple[int, int] | None = None) -> bool:
    """Whether the text shows ``mode_id``'s symptom about its quantity (:data:`ABOUT`); True for other modes.

    Args:
        mode_id: a failure mode id.
        scoped: the text (:func:`scope`).
        span: a pattern's hit in the text: only the sentences it touches count. None: any sentence (a reading by
            meaning).
    """
    if mode_id not in ABOUT:
        return True
    about, symptoms = ABOUT[mode_id]
    segments = scoped.segments
    if span is not None:  # only the sentences the hit touches (a long log has many; find them by offset)
        first = max(0, bisect.bisect_right(segments, (span[0], "\uffff")) - 1)
        near = itertools.takewhile(lambda seg: seg[0] < span[1], segments[first:])
        segments = [(o, t) for o, t in near if o + len(t) > span[0]]
    return any(_attaches(re.sub(r"\s", " ", t), about, symptoms) for _o, t in segments)
