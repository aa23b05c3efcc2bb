"""Physics before trust: a figure no run of these settings on this GPU can produce is set aside, with why, and the
answer is the uncalibrated model's."""

from __future__ import annotations

import pytest

from mbridge_offload.plan.evidence.physics import min_step_s
from mbridge_offload.plan.inputs.resolve import resolve
from mbridge_offload.plan.search import planner

RUN = {"model": "llama3-8b", "gpu": "h100-80gb", "num_gpus": 8, "tp": 2, "seq_length": 8192, "global_batch_size": 64}


def report(peak_gib: float) -> str:
    mib = peak_gib * 1024
    return f"[Rank 0] (after 10 iterations) memory (MB) | allocated: {mib / 2:.2f} | max allocated: {mib:.2f} | x"


@pytest.fixture(scope="module")
def plain():
    return planner.estimate(resolve(RUN))


def test_a_peak_above_the_gpus_capacity_is_set_aside(plain):
    est = planner.estimate(resolve({**RUN, "measured_log": report(95.0)}))
    c = est.calibration
    assert c.measured_kind is None and c.memory_offset_gib == 0.0
    assert est.memory_gib.total == pytest.approx(plain.memory_gib.total)
    assert "above the 79.11 GiB the h100-80gb holds" in c.set_aside[0]
    assert c.figures[0].set_aside == c.set_aside[0] and not c.figures[0].used


def test_an_allocated_figure_below_the_resident_state_is_set_aside(plain):
    m = plain.memory_gib
    resident = m.weights + m.gradients + m.optimizer
    est = planner.estimate(resolve({**RUN, "measured_peak_gib": resident - 3.0}))
    c = est.calibration
    assert c.measured_kind is None and est.memory_gib.total == pytest.approx(m.total)
    assert "below the" in c.set_aside[0] and "weights, gradients and optimizer state" in c.set_aside[0]
    assert any(n == c.set_aside[0] for n in c.notes)  # said in the answer's notes too


def test_a_peak_just_above_the_resident_state_is_taken(plain):
    m = plain.memory_gib
    est = planner.estimate(resolve({**RUN, "measured_peak_gib": m.weights + m.gradients + m.optimizer + 1.0}))
    assert est.calibration.measured_kind == "point" and not est.calibration.set_aside


def test_an_oom_with_more_allocated_than_the_gpu_holds_is_set_aside():
    oom = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of "
        "139.81 GiB of which 0.10 GiB is free. Of the allocated memory 120.00 GiB is allocated by PyTorch, and 1.00 "
        "GiB is reserved by PyTorch but unallocated."
    )
    c = planner.estimate(resolve({**RUN, "measured_log": oom})).calibration
    assert c.measured_kind is None and "120.00 GiB allocated at the failure" in c.set_aside[0]
    assert any("139.81 GiB total capacity" in n for n in c.notes)  # what the message says is still said


def test_a_step_faster_than_the_flops_allow_is_set_aside():
    r = resolve(RUN)
    fastest = min_step_s(r)
    est = planner.estimate(resolve({**RUN, "measured_step_s": fastest / 1.23}))  # the efficiency 1.23
    c = est.calibration
    assert c.baseline_step_s is None and c.measured_step_s is None
    assert "implies an efficiency (MFU) of 1.23, above the GPU's peak" in c.set_aside[0]
    assert est.time_s.efficiency <= 1.0


def test_a_log_step_faster_than_the_flops_allow_is_set_aside_and_marked():
    fastest = min_step_s(resolve(RUN))
    line = " iteration {}/ 100 | elapsed time per iteration (ms): {:.1f} | global batch size:    64 |"
    log = "\n".join(line.format(i, fastest * 500) for i in (10, 20, 30))
    c = planner.estimate(resolve({**RUN, "measured_log": log})).calibration
    assert c.measured_step_s is None and "the log's step time" in c.set_aside[0]
    assert all(f.set_aside for f in c.figures if f.kind == "step")


def test_a_possible_step_calibrates():
    fastest = min_step_s(resolve(RUN))
    c = planner.estimate(resolve({**RUN, "measured_step_s": fastest * 2.5})).calibration
    assert not c.set_aside and c.baseline_step_s is not None


def test_a_log_whose_own_throughput_is_above_the_gpus_peak_is_set_aside():
    line = " iteration {}/ 100 | elapsed time per iteration (ms): 30000.0 | throughput per GPU (TFLOP/s/GPU): 1100.0 |"
    log = "\n".join(line.format(i) for i in (10, 20, 30))
    c = planner.estimate(resolve({**RUN, "measured_log": log})).calibration
    assert c.measured_step_s is None and c.baseline_step_s is None
    assert "1100 TFLOP/s per GPU" in c.set_aside[0] and "above the h100-80gb's peak (989 TFLOP/s)" in c.set_aside[0]
    assert all(f.set_aside and f.tflops_per_gpu == 1100.0 for f in c.figures if f.kind == "step")
