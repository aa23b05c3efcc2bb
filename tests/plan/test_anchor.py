"""Calibration from the user's own run: measured peak, step time, Megatron log lines, and "it ran out of memory"."""

from __future__ import annotations

import argparse
import json

import pytest

from mbridge_offload.plan.evidence.read import parse_log
from mbridge_offload.plan.evidence.steps import steady_step_s
from mbridge_offload.plan.inputs.resolve import resolve
from mbridge_offload.plan.search import planner as plan
from mbridge_offload_tools.cli import plan as cli_plan

# Megatron's report_memory and training_log lines (megatron/training/utils.py, training.py), MB = bytes / 1024².
ITER = (
    " [2026-03-30 10:01:0{i}] iteration        {i}/      20 | consumed samples:           {n} | "
    "elapsed time per iteration (ms): {ms} | learning rate: 3.0E-06 |"
)
MEM = (
    "[Rank {r}] (after 1 iterations) memory (MB) | allocated: 30123.5 | max allocated: {peak} | "
    "reserved: 47000.0 | max reserved: 47000.0"
)
LOG = "\n".join(
    [
        ITER.format(i=1, n=8, ms=9123.4),
        MEM.format(r=0, peak=44544.0),
        ITER.format(i=2, n=16, ms=2480.0),
        ITER.format(i=3, n=24, ms=2490.0),
        ITER.format(i=4, n=32, ms=2484.0),
        MEM.format(r=8, peak=40550.4),
    ]
)


def test_megatron_log_lines_give_peak_gib_and_steady_step_time():
    ev = parse_log(LOG)
    assert max(f.value_gib for f in ev.points) == pytest.approx(44544.0 / 1024)
    assert steady_step_s(ev.steps) == (pytest.approx(2.484), 3)  # median after the warm-up iteration
    assert parse_log("nothing here").empty


def test_measured_peak_anchors_the_other_fractions():
    base = {"model": "qwen3-30b-a3b", "optimizer_offload_fraction": 0.5}
    plain = plan.estimate(resolve(base)).memory_gib.total
    anchored = plan.recommend(resolve({**base, "measured_peak_gib": plain + 3.0}))
    assert anchored.calibration.memory_offset_gib == pytest.approx(3.0, abs=0.01)
    # Before (no offload) is shifted by the same 3 GiB.
    free = plan.estimate(resolve({"model": "qwen3-30b-a3b"})).memory_gib.total
    assert anchored.memory_gib.without_offload.total == pytest.approx(free + 3.0, abs=0.01)
    assert anchored.memory_gib.before.total == pytest.approx(plain + 3.0, abs=0.01)  # the config as given
    assert any("every prediction shifted by +3.00 GiB" in r for r in anchored.rationale)


def test_measured_step_at_an_offloaded_setting_fixes_the_baseline():
    r = resolve({"model": "qwen3-30b-a3b", "optimizer_offload_fraction": 0.5, "measured_step_s": 2.484})
    est = plan.estimate(r)
    # The measurement pins the configured run (its recompute kept); ``baseline`` is the lever-free run, so the
    # measured step minus the offload cost is ``without_offload``, and it calibrates the compute efficiency.
    assert est.time_s.without_offload + est.time_s.optimizer_extra == pytest.approx(2.484, rel=1e-3)
    assert est.time_s.step == pytest.approx(2.484, rel=1e-3)
    assert est.calibration.baseline_step_s == pytest.approx(est.time_s.without_offload, rel=1e-3)
    assert est.time_s.baseline < est.time_s.without_offload  # the recipe's full recompute has a cost


def test_measured_step_with_a_baseline_gives_the_hosts_cpu_adam_rate():
    flags = {"model": "qwen3-30b-a3b", "optimizer_offload_fraction": 1.0, "baseline_step_s": 0.996}
    slow = plan.estimate(resolve({**flags, "measured_step_s": 6.0}))
    assert slow.time_s.step == pytest.approx(6.0, rel=1e-3)
    assert slow.time_s.without_offload == pytest.approx(0.996, rel=1e-3)
    assert slow.step_time_factor == pytest.approx(6.0 / 0.996, rel=1e-2)  # over the measured run without offload
    assert slow.step_time_factor_vs_no_levers == pytest.approx(6.0 / slow.time_s.baseline, rel=1e-2)
    assert slow.calibration.cpu_adam_params_per_s_per_core < 0.705e9
    # And the rate carries over to another fraction of the same answer: recommend uses it for its step time.
    rec = plan.recommend(resolve({**flags, "measured_step_s": 6.0, "gpu_memory_gb": 48}))
    assert rec.mode == "optimizer" and rec.step_time_factor_vs_no_levers > 1
    # Over the config as given (all of the optimizer offloaded), the smaller fraction recommended is faster.
    assert rec.optimizer_offload_fraction < 1.0 and rec.step_time_factor < 1


def test_a_reported_oom_is_never_called_a_fit_and_says_what_must_be_true():
    flags = {"model": "qwen3-30b-a3b", "optimizer_offload_fraction": 0.25, "ooms": True}
    est = plan.estimate(resolve(flags))
    assert est.fits is False
    assert any("ran out of memory" in n and "more is in use than modelled" in n for n in est.notes)
    # the least fraction above the failed 0.25 that keeps the default margin (2 %) with the OOM's shift
    assert any("optimizer_offload_fraction=0.35 would fit" in n for n in est.notes)
    rec = plan.recommend(resolve(flags))
    assert rec.fits and rec.mode == "optimizer" and rec.optimizer_offload_fraction > 0.25
    assert rec.memory_gib.after.total <= rec.budget_gib


def test_an_oom_at_full_offload_gets_no_fit_and_suggestions():
    rec = plan.recommend(resolve({"model": "qwen3-30b-a3b", "optimizer_offload_fraction": 1.0, "ooms": True}))
    assert not rec.fits and rec.suggestions


def test_cli_reads_a_log_file(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text(LOG)
    parser = argparse.ArgumentParser()
    cli_plan.add_parsers(parser.add_subparsers())
    args = parser.parse_args(
        [
            "estimate",
            "--model",
            "qwen3-30b-a3b",
            "--optimizer-offload-fraction",
            "0.5",
            "--measured-log",
            str(log),
            "--json",
        ]
    )
    args.handler(args)
    data = json.loads(capsys.readouterr().out)
    assert data["calibration"]["measured_peak_gib"] == pytest.approx(43.5, abs=0.01)
    assert data["memory_gib"]["total"] == pytest.approx(43.5, abs=0.01)
    assert data["calibration"]["measured_step_s"] == pytest.approx(2.484)
