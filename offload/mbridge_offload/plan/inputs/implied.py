"""Inputs an answer rests on that the caller rarely states: the micro-batches behind a step time, and the node whose
host RAM the offload buffers share. Each comes back as ``(name, value, source, note)`` for the answer's
``assumptions`` (``resolve.Assumption`` wraps them), so an agent can check the figure and the flag that changes it.

- Step time: the step is ``micro-batches × (forward + backward)`` plus the pipeline bubble, so the number of
  micro-batches per DP rank scales every second of it. It is ``global_batch_size / (micro_batch_size × DP)``;
  without a global batch the time model assumes ``4 × PP`` (a filled 1F1B pipeline), and the answer says so.
- Host memory: pinned buffers of every GPU of a node share that node's RAM: ``host_ram_gb`` (per GPU) ×
  ``gpus_per_node``, from the flags or the GPU preset's datasheet figure.

Never imports torch.
"""

from __future__ import annotations

from typing import Any

from mbridge_offload.plan.inputs.hardware import GpuPreset
from mbridge_offload.plan.model.run import Setup

Row = tuple[str, Any, str, str | None]


def batch(s: Setup, gbs_source: str | None) -> list[Row]:
    """The global batch and the micro-batches per step behind every step time, each with its source.

    Args:
        s: the resolved setup (its DP decides the split).
        gbs_source: where ``global_batch_size`` came from (``config``, ``flag``, ``preset``...), None when not given.
    """
    from mbridge_offload.plan.time.step import default_microbatches, samples_per_step

    n, per_rank = default_microbatches(s), s.micro_batch_size * s.dp  # what the time model uses
    if s.global_batch_size is None:
        implied = samples_per_step(s)
        return [
            (
                "global_batch_size",
                implied,
                "default",
                f"not given: the step time assumes {n} micro-batches per DP rank (4 × PP {s.pp}: a filled 1F1B "
                f"pipeline), i.e. {n} × micro-batch {s.micro_batch_size} × DP {s.dp} = {implied} samples per step; "
                "pass --global-batch-size (train.global_batch_size) for yours",
            ),
            ("microbatches_per_step", n, "default", f"4 × PP {s.pp}: no global batch given"),
        ]
    note = f"global batch {s.global_batch_size} ({gbs_source}) / (micro-batch {s.micro_batch_size} × DP {s.dp})"
    if s.global_batch_size < per_rank:
        note += ": fewer samples than one micro-batch per DP rank, counted as 1 (Megatron asserts divisibility)"
    elif s.global_batch_size % per_rank:
        note += f": not divisible, {n} counted (Megatron asserts global batch % (micro-batch × DP) == 0)"
    return [("microbatches_per_step", n, "derived", note)]


def host(gpu: GpuPreset, host_ram_given: bool, gpus_per_node_given: bool) -> list[Row]:
    """The node's host RAM and its GPU count, each with its source (flag or the GPU preset's datasheet)."""
    preset = gpu.host_source or "the GPU preset"
    ram_source = "flag" if host_ram_given else "preset"
    ram_note = (
        f"--host-ram-gb {gpu.host_ram_gb:g} per GPU × {gpu.gpus_per_node} GPUs per node"
        if host_ram_given
        else f"{gpu.name}: {preset}"
    )
    return [
        ("host_ram_per_node_gb", round(gpu.host_ram_node_gb, 1), ram_source, ram_note),
        (
            "gpus_per_node",
            gpu.gpus_per_node,
            "flag" if gpus_per_node_given else "preset",
            "GPUs whose offload buffers share one node's host RAM"
            + ("" if gpus_per_node_given else f" ({gpu.name}: {preset}); --gpus-per-node sets it"),
        ),
    ]
