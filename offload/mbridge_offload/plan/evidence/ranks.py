"""Which rank printed a log line, and which pipeline stage that rank holds.

Line prefixes that name a rank:

- ``[rank12]:`` — torch.distributed's prefix on each worker line (the global rank);
- ``[Rank 5]`` — Megatron's own prints (``report_memory``: ``torch.distributed.get_rank()``, global);
- ``[default3]:`` — torchrun ``--tee``'s ``[<role><local rank>]:`` (torch.distributed.elastic): a *local* rank;
- ``12: `` — Slurm ``srun --label``'s task id (one task per GPU: the global rank);
- otherwise ``rank 3`` / ``rank=3`` in a user's own print.

Rank → stage follows megatron-core's ``RankGenerator`` (``parallel_state.initialize_model_parallel``): ranks are laid
out along the order string, first token fastest; the dense generator has ``ep`` = 1, so with the default order
``tp-cp-ep-dp-pp`` a rank's pipeline rank is ``rank // (TP·CP·DP)`` and with ``--use-tp-pp-dp-mapping``
(``tp-cp-ep-pp-dp``, Megatron-LM's and Bridge's ``use_tp_pp_dp_mapping``) it is ``(rank // (TP·CP)) % PP``. Never
imports torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"

_TORCH = re.compile(r"^\s*(?:\d+: )?\[rank(\d+)\]:")
_MEGATRON = re.compile(r"\[Rank (\d+)\]")
_TEE = re.compile(r"^\s*\[[A-Za-z_][A-Za-z_-]*?(\d+)\]:")
_SRUN = re.compile(r"^\s*(\d+): ")
_INLINE = re.compile(r"\brank\s*[=:#]?\s*(\d+)\b", re.IGNORECASE)
# Every line prefix a launcher adds, stripped from continuation lines of a wrapped message.
PREFIXES = re.compile(r"^\s*(?:(?:\[[A-Za-z_][A-Za-z_-]*\d+\]:|\d+: )\s*)+")


@dataclass(frozen=True)
class LineRank:
    rank: int
    local: bool  # a local rank (torchrun --tee): the node is not known from the line
    source: str


def rank_of(line: str, inline: bool = False) -> LineRank | None:
    """The rank a line names (a global one preferred), or None.

    Args:
        line: one log line.
        inline: also read ``rank 3`` / ``rank=3`` in the text (a user's own print); off for library messages.
    """
    for pattern, source in (
        (_TORCH, "the line's [rankN]: prefix (torch.distributed, global rank)"),
        (_MEGATRON, "Megatron's [Rank N] (torch.distributed.get_rank(), global rank)"),
    ):
        m = pattern.search(line)
        if m:
            return LineRank(int(m.group(1)), False, source)
    m = _SRUN.match(line)
    if m:
        return LineRank(int(m.group(1)), False, "the line's 'N: ' prefix (srun --label task id, global rank)")
    m = _TEE.match(line)
    if m:
        return LineRank(int(m.group(1)), True, "torchrun --tee's [<role>N]: prefix (a local rank)")
    if inline:
        m = _INLINE.search(line)
        if m:
            return LineRank(int(m.group(1)), False, "'rank N' in the printed text (taken as the global rank)")
    return None


def strip_prefixes(line: str) -> str:
    """The line without launcher prefixes (``[rank3]:``, ``[default0]:``, ``3: ``)."""
    return PREFIXES.sub("", line, count=1)


@dataclass(frozen=True)
class RankLayout:
    """How a job's ranks map to pipeline stages (megatron-core's rank order)."""

    num_gpus: int
    tp: int
    cp: int
    pp: int
    order: str = DEFAULT_ORDER
    gpus_per_node: int = 8

    @property
    def dp(self) -> int:
        return self.num_gpus // (self.tp * self.cp * self.pp)

    def _stride(self) -> int:
        """Ranks between consecutive pipeline ranks: the product of the sizes before ``pp`` in the order."""
        sizes = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        tokens = self.order.split("-")
        return math.prod(sizes[t] for t in tokens[: tokens.index("pp")])

    def stage_of_rank(self, rank: int) -> int:
        """The pipeline rank of a global rank (0 ≤ rank < num_gpus)."""
        return (rank // self._stride()) % self.pp

    def describe(self) -> str:
        return f"order {self.order}, TP{self.tp} CP{self.cp} DP{self.dp} PP{self.pp} on {self.num_gpus} GPUs" + (
            " (--use-tp-pp-dp-mapping)" if self.order == TP_PP_DP_ORDER else ""
        )

    def stage(self, who: LineRank | None) -> tuple[int | None, str]:
        """The stage of the rank that printed a line, or None with why it cannot be told."""
        if self.pp == 1:
            return 0, "PP = 1: every rank holds the one stage"
        if who is None:
            return None, "the line names no rank"
        if who.rank >= self.num_gpus:
            return None, f"rank {who.rank} is outside the {self.num_gpus} GPUs assumed (pass num_gpus)"
        if who.local and self.num_gpus > self.gpus_per_node:
            return None, (
                f"local rank {who.rank} ({who.source}) on an unknown node of a {self.num_gpus}-GPU job: the global "
                "rank is not known (launch with a [rankN]: prefix, e.g. torchrun --log-line-prefix-template)"
            )
        kind = "local rank (one node: the global rank)" if who.local else "rank"
        stage = self.stage_of_rank(who.rank)
        return stage, f"{kind} {who.rank} ({who.source}) is pipeline stage {stage} ({self.describe()})"


def order_from_config(raw: dict | None) -> tuple[str, str]:
    """megatron-core's rank order for a config: ``dist.use_tp_pp_dp_mapping`` (Bridge) or Megatron-LM's
    ``--use-tp-pp-dp-mapping``; the default otherwise. Returns (order, source)."""
    for section in ("dist", "megatron_lm"):
        block = (raw or {}).get(section)
        if isinstance(block, dict) and block.get("use_tp_pp_dp_mapping"):
            return TP_PP_DP_ORDER, f"{section}.use_tp_pp_dp_mapping"
    return DEFAULT_ORDER, "megatron-core default"
