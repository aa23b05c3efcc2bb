"""The settings a training log prints about its own run: batch, sequence, GPU count and parallel sizes.

A measured figure belongs to the run that printed it, so what that run printed about itself describes it:

- Megatron-LM's argument table at start-up (``megatron/training/arguments.py``, ``_print_args``):
  "  micro_batch_size ................................ 1", one line per argument, dots between name and value;
- Megatron-LM's "using world size: 8, data-parallel size: 4, context-parallel size: 1, ... tensor-model-parallel
  size: 2, pipeline-model-parallel size: 1" (rank 0, at start-up);
- the iteration line of Megatron-LM and Megatron Bridge (``training_log``): "... | global batch size:    32 | ...";
- a config printed as YAML (Bridge prints its ``ConfigContainer``): a line holding only "micro_batch_size: 1"
  (indented or not), for the names below.

Each is read into the planner input of the same meaning (``num_gpus`` for the world size). When one setting is
printed with two values (a batch ramp-up, two runs in one file) the last one counts and the answer says so.
Never imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Megatron-LM argument → planner input.
NAMES: dict[str, str] = {
    "micro_batch_size": "micro_batch_size",
    "global_batch_size": "global_batch_size",
    "seq_length": "seq_length",
    "world_size": "num_gpus",
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
}
_NAME = "|".join(NAMES)
_TABLE = re.compile(rf"^\s*({_NAME}) \.{{3,}} (\d+)\s*$")
_YAML = re.compile(rf"^\s*({_NAME})\s*:\s*(\d+)\s*$")
_WORLD = re.compile(
    r"using world size: (\d+), data-parallel size: \d+,?\s*context-parallel size: (\d+)"
    r".*?tensor-model-parallel size: (\d+),?\s*(?:encoder-tensor-model-parallel size: \S+,?\s*)?"
    r"pipeline-model-parallel size: (\d+)"
)
_GBS = re.compile(r"\|\s*global batch size:\s*(\d+)\s*\|")


@dataclass
class Printed:
    """One setting as the log printed it: the planner input, the value, the 1-based line and its text."""

    name: str
    value: int
    line_number: int
    line: str


@dataclass
class LogSettings:
    """The settings a log printed (the last value of each), and what to say about them."""

    values: dict[str, Printed] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_inputs(self) -> dict[str, int]:
        return {name: p.value for name, p in self.values.items()}


def _found(line: str) -> list[tuple[str, int]]:
    """The (planner input, value) pairs one line prints."""
    if m := _TABLE.match(line) or _YAML.match(line):
        return [(NAMES[m.group(1)], int(m.group(2)))]
    if m := _WORLD.search(line):
        return [
            ("num_gpus", int(m.group(1))),
            ("cp", int(m.group(2))),
            ("tp", int(m.group(3))),
            ("pp", int(m.group(4))),
        ]
    if m := _GBS.search(line):
        return [("global_batch_size", int(m.group(1)))]
    return []


def parse_settings(text: str) -> LogSettings:
    """Every setting of :data:`NAMES` the log prints about its run.

    Args:
        text: the log.

    Returns:
        The last printed value of each setting (with its line), and a note for each setting printed with more
        than one value.
    """
    out, seen = LogSettings(), dict[str, set[int]]()
    for i, line in enumerate(text.splitlines()):
        if not ("..." in line or "world size" in line or "batch size" in line or ":" in line):
            continue
        for name, value in _found(line):
            seen.setdefault(name, set()).add(value)
            out.values[name] = Printed(name, value, i + 1, line.strip()[:200])
    for name, values in seen.items():
        if len(values) > 1:
            last = out.values[name]
            out.notes.append(
                f"log: {name} printed with {len(values)} values ({', '.join(map(str, sorted(values)))}); the last, "
                f"{last.value} (line {last.line_number}), describes the measured run"
            )
    return out
