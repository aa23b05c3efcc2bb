"""``pipeline_model_parallel_layout``: which layers each pipeline (virtual) stage holds.

megatron-core's grammar (``PipelineParallelLayerLayout.parse_str_to_list``): stages separated by ``|``; ``E`` the
embedding, ``t`` a decoder layer, ``m`` an MTP layer, ``L`` the loss; ``x*n`` and ``(…)*n`` repeat; commas are
cosmetic. A list of lists of layer names (``embedding``, ``decoder``, ``mtp``, ``loss``) is the same layout. The
number of stages must be a multiple of PP; VPP = stages / PP, and megatron-core asserts that a configured VPP
agrees. Never imports torch.
"""

from __future__ import annotations

import re
from typing import Any

_NAMES = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
_REPEATS = (re.compile(r"\(([^)]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))
MAX_LAYOUT_STAGES = 4096


def layout_text(value: Any) -> str | None:
    """The layout as a string (a list of lists of names is converted); None when unset."""
    if value is None or value == "":
        return None
    if isinstance(value, list):
        return "|".join("".join(_NAMES.get(str(n).strip().lower(), "?") for n in row) for row in value)
    return str(value)


def parse_layout(text: str) -> list[str]:
    """The stages of a layout string, each a string of ``E``/``t``/``m``/``L``.

    Raises:
        ValueError: an unknown layer symbol, or a layout that unrolls to more than ``MAX_LAYOUT_STAGES`` stages.
    """
    s = text.replace(",", "").replace(" ", "")
    for pattern in _REPEATS:
        s = pattern.sub(lambda x: x.group(1) * int(x.group(2)), s)
        if len(s) > 64 * MAX_LAYOUT_STAGES:
            raise ValueError(f"pipeline_model_parallel_layout {text!r} unrolls to more than {MAX_LAYOUT_STAGES} stages")
    stages = s.split("|")
    bad = set("".join(stages)) - set(_NAMES.values())
    if bad:
        raise ValueError(
            f"pipeline_model_parallel_layout {text!r}: unknown layer symbol(s) {''.join(sorted(bad))} "
            "(E embedding, t decoder, m MTP, L loss)"
        )
    return stages


def decoder_counts(text: str) -> tuple[int, ...]:
    """Decoder layers per virtual stage, in layer order."""
    return tuple(stage.count("t") for stage in parse_layout(text))


def mtp_layers(text: str) -> int:
    return sum(stage.count("m") for stage in parse_layout(text))
