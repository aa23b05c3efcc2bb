"""mbridge_offload.actions.diagnose.sizing: diagnose answers with the planner. An OOM's fix is one of recommend's
options
and fits by ``estimate`` on the same GPU and count; the GPU count is an input with its source, never a silent 8;
before/after predicts per-GPU memory for the count given; bad planner inputs are refused before anything is read."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from mbridge_offload.actions.diagnose.diagnose import diagnose
from mbridge_offload.actions.diagnose.failures.catalogue import KNOWN
from mbridge_offload.actions.diagnose.sizing import GPU_OOM, SIZED, check_inputs, input_names
from mbridge_offload.config.errors import InputError
from mbridge_offload.config.sources import load
from mbridge_offload.plan.inputs.fields import PlanInputs, group_of
from mbridge_offload.plan.service import estimate_for_inputs, recommend_for_inputs
from tests.support.configs import LLAMA3_8B, bridge_yaml

OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of 79.10 GiB "
    "of which 1.21 GiB is free. Of the allocated memory 74.12 GiB is allocated by PyTorch, and 2.05 GiB is reserved "
    "by PyTorch but unallocated."
)
# The case: Llama 3 8B SFT at 16k on H100s (the old answer, optimizer offload 0.5, stays far over budget).
SFT_8B_16K = bridge_yaml(
    (
        "model",
        {
            **LLAMA3_8B,
            "seq_length": 16384,
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "bf16": True,
        },
    ),
    ("train", {"micro_batch_size": 1, "global_batch_size": 32}),
    ("checkpoint", {"pretrained_checkpoint": "/models/llama3-8b"}),
    ("optimizer", {"use_distributed_optimizer": True, "bf16": True}),  # last: a test appends optimizer keys
)


def _write(tmp_path: Path, body: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(body, encoding="utf-8")
    return path


def _run(path: Path, planner: dict[str, Any], **texts: str):
    loaded = load(str(path))
    return diagnose(config=loaded.config, raw=loaded.raw, source=loaded.source, planner=planner, **texts)


def _fits(path: Path, overrides: list[str], planner: dict[str, Any]) -> tuple[bool, float]:
    """``estimate`` of the config with the overrides applied, on the same GPU and count (no evidence)."""
    edited = load(str(path), overrides)
    flags = {k: v for k, v in planner.items() if k in ("model", "gpu", "num_gpus")}
    est = estimate_for_inputs(edited.config, edited.raw, edited.source, **flags)
    return est.fits, est.memory_gib.total


# ---------------------------------------------------------------------------------------------- generated setups


def _setups(n: int = 7, seed: int = 28) -> list[tuple[str, dict[str, Any]]]:
    """Runs that do not fit as given: a model preset, a sequence length, a GPU and count, a layout and an offload."""
    rng = random.Random(seed)
    out: list[tuple[str, dict[str, Any]]] = []
    while len(out) < n:
        model = rng.choice(["llama3-8b", "qwen3-8b", "llama3-70b", "qwen3-30b-a3b"])
        seq = rng.choice([8192, 16384, 32768])
        gpu = rng.choice(["h100-80gb", "a100-80gb", "h200-141gb", "b200"])
        tp = rng.choice([1, 2, 4]) if model != "llama3-70b" else rng.choice([4, 8])
        pp = rng.choice([1, 2]) if model != "llama3-70b" else rng.choice([2, 4])
        num_gpus = tp * pp * rng.choice([2, 4, 8])
        offload = rng.choice(["none", "optimizer", "activation"] if pp == 1 else ["none", "optimizer"])
        body = (
            f"model:\n  seq_length: {seq}\n  tensor_model_parallel_size: {tp}\n  pipeline_model_parallel_size: {pp}\n"
            f"  sequence_parallel: {str(tp > 1).lower()}\n  bf16: true\n"
        )
        if offload == "activation":
            body += "  cpu_offloading: true\n  cpu_offloading_num_layers: 2\n"
        body += "train:\n  micro_batch_size: 1\n  global_batch_size: 64\n"
        body += "optimizer:\n  use_distributed_optimizer: true\n  bf16: true\n"
        if offload == "optimizer":
            body += "  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 0.25\n"
        planner = {"model": model, "gpu": gpu, "num_gpus": num_gpus}
        out.append((body, planner))
    return out


@pytest.mark.parametrize(
    ("body", "planner"), _setups(), ids=lambda v: v["model"] + "-" + v["gpu"] if isinstance(v, dict) else ""
)
def test_every_fix_and_option_of_an_oom_fits_by_estimate_on_the_same_gpus(
    tmp_path: Path, body: str, planner: dict[str, Any]
) -> None:
    path = _write(tmp_path, body)
    report = _run(path, planner, error=OOM)
    (oom,) = [m for m in report.matches if m.failure in GPU_OOM]
    given = {a.name: a for a in report.assumptions}
    assert given["gpu"].value == planner["gpu"] and given["num_gpus"].value == planner["num_gpus"]
    assert given["num_gpus"].source == "flag" and given["ooms"].source == "diagnose text"
    if not oom.fix:  # nothing fits: said, and nothing guessed
        assert not any(o.fits for o in report.options if o.changes)
        assert any("no setting the planner considers fits" in n for n in report.notes)
        return
    assert oom.fix in [o.overrides for o in report.options]  # the fix is one of the planner's options
    fits, _ = _fits(path, oom.fix, planner)
    assert fits, (oom.fix, planner)
    for option in report.options:
        if option.fits:
            assert _fits(path, option.overrides, planner)[0], (option.overrides, planner)


def test_the_8b_sft_at_16k_on_h100_gets_a_fix_that_fits_not_a_generic_fraction(tmp_path: Path) -> None:
    path = _write(tmp_path, SFT_8B_16K)
    planner = {"gpu": "h100-80gb", "num_gpus": 8}
    assert not _fits(
        path, ["optimizer.optimizer_cpu_offload=true", "optimizer.optimizer_offload_fraction=0.5"], planner
    )[0]
    report = _run(path, planner, error=OOM)
    fix = report.matches[0].fix
    assert report.matches[0].failure == "oom_no_offload" and fix
    assert "optimizer.optimizer_offload_fraction=0.5" not in fix
    assert _fits(path, fix, planner)[0]
    assert fix == report.options[0].overrides  # the planner's first option (recompute here, not optimizer offload)


def test_every_sized_reading_is_a_known_mode() -> None:
    known = {m.id for m in KNOWN} | {"oom_unattributed"}
    assert set(SIZED) <= known
    for mode in KNOWN:  # no OOM reading carries a fixed fraction any more: the planner sizes it
        if mode.id in GPU_OOM:
            assert mode.fix == (), mode.id


# ---------------------------------------------------------------------------------------------- inputs and evidence


def test_diagnose_takes_the_planners_hardware_time_decision_and_evidence_inputs() -> None:
    names = set(input_names())
    assert {"gpu", "num_gpus", "measured_log", "measured_peak_gib", "ooms", "levers", "model"} <= names
    for name in PlanInputs.model_fields:  # one declaration: whole groups, nothing hand-picked inside them
        if group_of(name) in ("hardware", "time", "decision", "measured"):
            assert name in names
    assert not {"tp", "pp", "seq_length", "optimizer_offload_fraction"} & names  # the run itself is the config


def test_the_gpu_count_is_an_assumption_with_its_source_never_a_silent_eight(tmp_path: Path) -> None:
    path = _write(tmp_path, SFT_8B_16K)
    default = {a.name: a for a in _run(path, {}, error=OOM).assumptions}
    assert default["num_gpus"].value == 8 and default["num_gpus"].source != "flag" and default["num_gpus"].note
    assert default["gpu"].source == "default"
    given = {a.name: a for a in _run(path, {"num_gpus": 16, "gpu": "h200-141gb"}, error=OOM).assumptions}
    assert (given["num_gpus"].value, given["num_gpus"].source) == (16, "flag")
    assert (given["gpu"].value, given["gpu"].source) == ("h200-141gb", "flag")


def test_before_after_predicts_the_per_gpu_change_for_the_count_given(tmp_path: Path) -> None:
    before = load(
        str(
            _write(
                tmp_path, SFT_8B_16K + "  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 1.0\n", "b.yaml"
            )
        )
    )
    after_path = _write(tmp_path, SFT_8B_16K.replace("seq_length: 16384", "seq_length: 4096"), "a.yaml")
    after = load(str(after_path))
    sixteen = diagnose(before=before, after=after, planner={"num_gpus": 16}).comparison
    eight = diagnose(before=before, after=after, planner={"num_gpus": 8}).comparison
    assert sixteen is not None and eight is not None
    assert sixteen["num_gpus"] == {"before": 16, "after": 16}
    for side, loaded in (("before", before), ("after", after)):  # exactly estimate's figure at 16 GPUs
        est = estimate_for_inputs(loaded.config, loaded.raw, loaded.source, num_gpus=16)
        assert sixteen["memory_gib"][side]["total"] == est.memory_gib.total
    # The distributed optimizer shards over DP: 16 GPUs halve the per-GPU optimizer states, so the change differs.
    assert sixteen["memory_gb"]["delta_total"] != eight["memory_gb"]["delta_total"]


def test_the_text_is_the_measured_log_and_a_memory_report_in_it_anchors_the_sizing(tmp_path: Path) -> None:
    path = _write(tmp_path, SFT_8B_16K)
    log = "[Rank 0] (after 1 iterations) memory (MB) | allocated: 60000.0 | max allocated: 81000.0 |\n" + OOM
    report = _run(path, {"gpu": "h100-80gb"}, log=log)
    assert report.calibration is not None and report.calibration.measured_peak_gib == pytest.approx(81000 / 1024)
    assert {a.name: a.source for a in report.assumptions}["measured_log"] == "diagnose text"


def test_the_callers_own_evidence_wins_over_the_text(tmp_path: Path) -> None:
    path = _write(tmp_path, SFT_8B_16K)
    report = _run(path, {"measured_peak_gib": 75.0, "ooms": False}, error=OOM)
    assert report.calibration is not None and report.calibration.measured_peak_gib == 75.0
    said = {a.name: a for a in report.assumptions}
    assert said["ooms"].value is False and said["ooms"].source == "flag"


@pytest.mark.parametrize(
    ("planner", "says"),
    [
        ({"num_gpus": 0}, "--num-gpus"),
        ({"gpu": "h100-80"}, "unknown GPU preset"),
        ({"model": "llama-9b"}, "unknown model preset"),
        ({"levers": ["warp-drive"]}, "unknown lever"),
        ({"measured_log": "/no/such/log.txt"}, "no such file"),
        ({"tp": 2}, "diagnose does not take tp"),
    ],
)
def test_bad_planner_inputs_are_refused_before_anything_is_read(planner: dict[str, Any], says: str) -> None:
    with pytest.raises(InputError, match=says):
        check_inputs(planner)
    with pytest.raises(InputError):
        diagnose(error=OOM, planner=planner)


# ---------------------------------------------------------------------------------------------- no sizing, no guess


def test_a_config_without_the_model_sizes_gets_no_guessed_oom_fix_and_says_what_sizes_it(tmp_path: Path) -> None:
    path = _write(tmp_path, "model:\n  num_layers: 48\n  cpu_offloading: true\n  cpu_offloading_num_layers: 24\n")
    report = _run(path, {}, error=OOM)
    assert [m.failure for m in report.matches] == ["oom_activation_offload"]
    assert report.matches[0].fix == [] and report.options == []
    assert any("model's sizes" in n for n in report.needs)
    assert any("cannot be sized" in n for n in report.notes)


def test_without_a_config_an_attributed_oom_asks_for_the_config_to_size_it() -> None:
    report = diagnose(error=OOM + " with optimizer_offload_fraction=0.25")
    assert [m.failure for m in report.matches] == ["oom_partial_optimizer_offload"]
    assert report.matches[0].fix == [] and any("--num-gpus" in n for n in report.needs)


def test_a_predicted_oom_that_the_planner_says_fits_gets_no_fix(tmp_path: Path) -> None:
    body = SFT_8B_16K.replace("seq_length: 16384", "seq_length: 2048")
    before = load(
        str(_write(tmp_path, body + "  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 1.0\n", "b.yaml"))
    )
    after = load(str(_write(tmp_path, body, "a.yaml")))
    report = diagnose(before=before, after=after, planner={"gpu": "h100-80gb"})
    assert [m.failure for m in report.matches] == ["oom_no_offload"] and report.matches[0].fix == []
    assert any("predicts the config as given fits" in n for n in report.notes)


# ---------------------------------------------------------------------------------------------- slowdown, host OOM


def test_a_slowdown_takes_the_fastest_option_that_fits_and_beats_the_config(tmp_path: Path) -> None:
    body = SFT_8B_16K.replace("seq_length: 16384", "seq_length: 4096")
    path = _write(tmp_path, body + "  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 1.0\n")
    report = _run(path, {"gpu": "h100-80gb"}, symptom="slowdown")
    (slow,) = [m for m in report.matches if m.failure == "slowdown"]
    assert slow.fix and _fits(path, slow.fix, {"gpu": "h100-80gb"})[0]
    given = estimate_for_inputs(load(str(path)).config, load(str(path)).raw, gpu="h100-80gb").time_s.step
    chosen = next(o for o in report.options if o.overrides == slow.fix)
    assert chosen.step_time_s < given


def test_a_host_oom_takes_an_option_with_less_host_memory(tmp_path: Path) -> None:
    body = SFT_8B_16K.replace("seq_length: 16384", "seq_length: 4096")
    path = _write(tmp_path, body + "  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 1.0\n")
    report = _run(path, {"gpu": "h100-80gb"}, error="Out of memory: Killed process 4242 (python)")
    (host,) = [m for m in report.matches if m.failure == "host_oom"]
    given = estimate_for_inputs(load(str(path)).config, load(str(path)).raw, gpu="h100-80gb").host_peak_gb
    assert host.fix and next(o for o in report.options if o.overrides == host.fix).host_gb < given


def test_the_options_are_recommends_for_the_same_config_and_evidence(tmp_path: Path) -> None:
    path = _write(tmp_path, SFT_8B_16K)
    planner = {"gpu": "h100-80gb", "num_gpus": 16}
    report = _run(path, planner, error=OOM)
    loaded = load(str(path))
    rec = recommend_for_inputs(loaded.config, loaded.raw, loaded.source, **planner, measured_log=OOM + "\n", ooms=True)
    assert [o.model_dump() for o in report.options] == [o.model_dump() for o in rec.options]
    assert report.calibration == rec.calibration


def test_a_log_printing_another_micro_batch_than_the_config_is_flagged_and_sized_at_its_own_run(tmp_path: Path) -> None:
    path = _write(tmp_path, SFT_8B_16K)
    log = OOM + "\n  micro_batch_size ................................ 2\n"
    report = _run(path, {}, error=log)
    c = report.calibration
    assert c is not None and [(m.name, m.log) for m in c.mismatches] == [("micro_batch_size", 2)]
    assert c.measured_run is not None and c.measured_run.settings["micro_batch_size"] == 2
    assert c.asked_run is not None and c.asked_run.settings["micro_batch_size"] == 1
