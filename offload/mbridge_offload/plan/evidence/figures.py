"""The figures read from a user's log: what each is, the line it came from, and whether it bounds or fixes the peak.

A ``point`` is a peak that was measured (Megatron's ``max allocated``, ``torch.cuda.max_memory_allocated``): the
model is shifted to reproduce it. A ``bound`` is a lower bound on the peak (PyTorch's out-of-memory message: the
allocated memory plus the request that failed): the model is shifted at least up to it, never down. A ``step`` is a
measured step time. Every figure keeps its line (text and 1-based number) so an answer can cite it. Never imports
torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

from mbridge_offload.plan.evidence.settings import LogSettings

Kind = Literal["bound", "point", "step"]
Source = Literal[
    "pytorch_oom",
    "pytorch_oom_unsized",
    "megatron_memory_report",
    "bridge_memory_report",
    "max_memory_allocated",
    "megatron_iteration_time",
    "nemo_step_timing",
]

# What each source is, in the words an answer uses (also the list of what a log may contain: the error for a log
# with none of these names them).
SOURCES: dict[str, str] = {
    "pytorch_oom": "PyTorch's CUDA out-of-memory message ('Tried to allocate ...'; its current and its pre-2.2 form)",
    "pytorch_oom_unsized": "an out-of-memory error without sizes ('CUDA error: out of memory', a cut message)",
    "megatron_memory_report": "Megatron-LM's memory report ('memory (MB) | allocated: ... | max allocated: ...')",
    "bridge_memory_report": "Megatron Bridge's memory report ('memory (GB) | ... | mem-max-allocated-gigabytes: ...')",
    "max_memory_allocated": "a print of torch.cuda.max_memory_allocated() (bytes, or with a unit)",
    "megatron_iteration_time": "Megatron's / Bridge's 'elapsed time per iteration (ms): ...'",
    "nemo_step_timing": "NeMo's 'train_step_timing in s: ...'",
}

# A line kept in an answer is cut to this many characters (a log line can be a whole traceback).
LINE_CHARS = 400


class Figure(BaseModel):
    """One figure read from the user's log, with the line it came from."""

    source: Source = Field(description="what printed it: " + "; ".join(f"{k} = {v}" for k, v in SOURCES.items()))
    kind: Kind = Field(description="bound: the peak is at least this; point: the peak was this; step: a step time")
    value_gib: float | None = Field(
        None, description="bound: allocated + requested at the failure; point: peak allocated; GiB (2^30 bytes)"
    )
    value_s: float | None = Field(None, description="a step time, seconds")
    tflops_per_gpu: float | None = Field(
        None, description="step: the throughput per GPU the same line prints (Megatron-LM's own FLOPs), TFLOP/s"
    )
    line: str = Field(description="the log line it was read from (cut to 400 characters)")
    line_number: int = Field(description="1-based line number in the text read")
    rank: int | None = Field(None, description="the rank that printed it (global, or local with rank_source)")
    rank_source: str | None = Field(None, description="how the rank was read: which line prefix")
    stage: int | None = Field(None, description="the pipeline stage it is compared with (0-based)")
    stage_source: str | None = Field(None, description="why that stage: the rank's stage in the layout, or the worst")
    shift_gib: float | None = Field(None, description="the figure minus the model's prediction for that stage, GiB")
    used: bool = Field(False, description="this figure set the shift every prediction carries")
    set_aside: str | None = Field(
        None, description="why physics refuses this figure for the measured run on this GPU (not used), or null"
    )
    allocated_gib: float | None = Field(None, description="OOM: memory allocated by PyTorch at the failure, GiB")
    requested_gib: float | None = Field(None, description="OOM: the allocation that failed ('Tried to allocate'), GiB")
    reserved_unallocated_gib: float | None = Field(
        None, description="OOM: reserved by PyTorch but unallocated (fragmentation of the caching allocator), GiB"
    )
    capacity_gib: float | None = Field(None, description="OOM: the GPU's total capacity as CUDA reports it, GiB")
    free_gib: float | None = Field(None, description="OOM: free on the GPU at the failure, GiB")
    process_gib: float | None = Field(None, description="OOM: this process's memory in use, non-PyTorch included, GiB")
    other_processes_gib: float | None = Field(None, description="OOM: other processes' memory on that GPU, GiB")
    device: int | None = Field(None, description="OOM: the CUDA device index in the message (local, not a rank)")


@dataclass
class Evidence:
    """Everything read from one log: memory figures (bounds and points), step-time figures, and what to say."""

    memory: list[Figure] = field(default_factory=list)
    steps: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    settings: LogSettings = field(default_factory=LogSettings)  # what the log printed about its own run

    @property
    def bounds(self) -> list[Figure]:
        return [f for f in self.memory if f.kind == "bound"]

    @property
    def points(self) -> list[Figure]:
        return [f for f in self.memory if f.kind == "point"]

    @property
    def ooms(self) -> bool:
        """The log shows an out-of-memory failure (sized or not)."""
        return bool(self.bounds)

    @property
    def empty(self) -> bool:
        return not self.memory and not self.steps


def cut(line: str) -> str:
    """A line as an answer quotes it: stripped and cut to ``LINE_CHARS``."""
    text = line.strip()
    return text if len(text) <= LINE_CHARS else text[: LINE_CHARS - 1] + "…"
