"""Measured step times in a log: Megatron's (and Bridge's) iteration line, NeMo's step timing.

- Megatron-LM ``training_log`` and Megatron Bridge ``training_log`` (``train_utils.py``): "... | elapsed time per
  iteration (ms): 1234.5 | ...", the mean over the logging interval, printed by the last rank.
- NeMo 2 (``MegatronProgressBar``): "train_step_timing in s: 2.505"; NeMo 1's progress bar "train_step_timing in
  s=3.130"; DLLogger JSON ``"train_step_timing in s": 92.28``.

The step time an answer uses is the median after the first line (the first interval holds the warm-up: compilation,
allocator growth, NCCL set-up). Never imports torch.
"""

from __future__ import annotations

import re
import statistics

from mbridge_offload.plan.evidence.figures import Figure, cut
from mbridge_offload.plan.evidence.sizes import NUMBER

_MEGATRON = re.compile(rf"elapsed time per iteration \(ms\):\s*({NUMBER})")
_NEMO = re.compile(rf"train_step_timing in s\"?\s*[:=]\s*({NUMBER})")
# Megatron-LM's iteration line also prints the throughput its own FLOPs formula implies (``--log-throughput``).
_THROUGHPUT = re.compile(rf"throughput per GPU \(TFLOP/s/GPU\):\s*({NUMBER})")


def parse_steps(lines: list[str], candidates: list[int]) -> list[Figure]:
    """Every step-time line among ``candidates``, in line order."""
    out: list[Figure] = []
    for i in candidates:
        line = lines[i]
        m = _MEGATRON.search(line)
        if m:
            seconds, source = float(m.group(1)) / 1000, "megatron_iteration_time"
        else:
            m = _NEMO.search(line)
            if not m:
                continue
            seconds, source = float(m.group(1)), "nemo_step_timing"
        tflops = _THROUGHPUT.search(line)
        out.append(
            Figure(
                source=source,
                kind="step",
                value_s=seconds,
                tflops_per_gpu=float(tflops.group(1)) if tflops else None,
                line=cut(line),
                line_number=i + 1,
            )
        )
    return out


def steady_step_s(steps: list[Figure]) -> tuple[float | None, int]:
    """The median step time after the first line (warm-up), and how many lines it is the median of."""
    values = [f.value_s for f in steps if f.value_s is not None]
    steady = values[1:] if len(values) > 1 else values
    return (statistics.median(steady), len(steady)) if steady else (None, 0)


def is_candidate(lower: str) -> bool:
    return "elapsed time per iteration" in lower or "train_step_timing" in lower
