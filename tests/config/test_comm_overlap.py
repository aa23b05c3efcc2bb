"""Bridge's ``comm_overlap`` section is read into the effective config: ``CommOverlapConfig.setup`` (Bridge
0.6.2 ``training/comm_overlap.py``) decides ``model.tp_comm_overlap`` and, with the distributed optimizer, the DDP
overlaps; the planner's step time uses what it decides. Checked on NVIDIA's own run_config.yaml dumps."""

from __future__ import annotations

from pathlib import Path

import pytest

from mbridge_offload.config import sources
from mbridge_offload.config.effective import resolve
from mbridge_offload.plan import service

PERF = Path(__file__).resolve().parents[2] / "tests" / "data" / "bridge-0.6.2" / "perf"
L405 = PERF / "llama31_405b_pretrain_128gpu_b300_bf16_config.yaml"  # TP 2, sequence parallel, comm_overlap on
L70 = PERF / "llama3_70b_pretrain_64gpu_gb200_bf16_config.yaml"  # TP 1, comm_overlap.tp_comm_overlap: true
SETUP = "comm_overlap (Bridge 0.6.2 CommOverlapConfig.setup)"


def _variant(tmp_path: Path, source: Path, old: str, new: str) -> Path:
    text = source.read_text()
    assert old in text
    path = tmp_path / source.name
    path.write_text(text.replace(old, new, 1))  # the first occurrence: the comm_overlap section comes first
    return path


def _effective(path: Path) -> dict:
    loaded = sources.load(str(path))
    return {k: (v.value, v.source) for k, v in resolve(loaded.config, loaded.raw, source=loaded.source).values.items()}


@pytest.fixture(scope="module")
def the_405b() -> tuple:
    """The recipe as dumped, estimated (module-wide: the file has ~900 keys)."""
    return service.estimate_for_inputs(*_load(L405), gpu="b300", num_gpus=128)


def _load(path: Path) -> tuple:
    loaded = sources.load(str(path))
    return loaded.config, loaded.raw, loaded.source


def test_the_recipes_tp_comm_overlap_is_on_although_its_model_section_says_false() -> None:
    assert "  tp_comm_overlap: false" in L405.read_text()  # the model section, overwritten at start-up
    got = _effective(L405)
    assert got["model.tp_comm_overlap"] == (True, f"{SETUP}: comm_overlap.tp_comm_overlap (TE assumed)")
    # use_distributed_optimizer: the DDP overlaps are the section's, else on for DP > 1
    assert got["ddp.overlap_grad_reduce"][0] is True and got["ddp.overlap_grad_reduce"][1].startswith(SETUP)


def test_bridge_switches_it_off_at_tp_1_and_without_sequence_parallelism(tmp_path: Path) -> None:
    assert _effective(L70)["model.tp_comm_overlap"] == (False, f"{SETUP}: asked for, switched off at TP 1 < 2")
    no_sp = _variant(tmp_path, L405, "  sequence_parallel: true", "  sequence_parallel: false")
    value, source = _effective(no_sp)["model.tp_comm_overlap"]
    assert value is False and "sequence_parallel off" in source


def test_without_the_section_the_model_keys_are_as_written(tmp_path: Path) -> None:
    plain = tmp_path / "plain.yaml"
    plain.write_text(
        "model:\n  num_layers: 4\n  tensor_model_parallel_size: 2\n  sequence_parallel: true\n  tp_comm_overlap: true\n"
    )
    assert _effective(plain)["model.tp_comm_overlap"] == (True, "config")
    section = tmp_path / "section.yaml"
    section.write_text(plain.read_text() + "comm_overlap:\n  tp_comm_overlap: false\n")
    assert _effective(section)["model.tp_comm_overlap"] == (
        False,
        f"{SETUP}: off unless comm_overlap.tp_comm_overlap is true",
    )


def test_the_sections_own_ddp_overlap_wins(tmp_path: Path) -> None:
    path = _variant(tmp_path, L405, "  overlap_grad_reduce: null", "  overlap_grad_reduce: false")
    assert _effective(path)["ddp.overlap_grad_reduce"] == (False, f"{SETUP}: comm_overlap.overlap_grad_reduce")
    assert _effective(path)["ddp.overlap_param_gather"][0] is True  # still null there: on for DP > 1


def test_the_planner_uses_it_in_the_step_time_and_lists_it(tmp_path: Path, the_405b) -> None:
    (assumed,) = [a for a in the_405b.assumptions if a.name == "tp_comm_overlap"]
    assert assumed.value is True and assumed.source == "config" and SETUP in (assumed.note or "")
    assert the_405b.effective["model.tp_comm_overlap"].value is True
    off = _variant(tmp_path, L405, "  tp_comm_overlap: true", "  tp_comm_overlap: false")
    without = service.estimate_for_inputs(*_load(off), gpu="b300", num_gpus=128)
    assert [a.value for a in without.assumptions if a.name == "tp_comm_overlap"] == [False]
    # TE userbuffers hide most of the TP all-gather / reduce-scatter: the exposed TP time drops, nothing else moves.
    assert the_405b.time_s.tp_comm < 0.5 * without.time_s.tp_comm
    assert the_405b.time_s.compute == without.time_s.compute
    assert the_405b.memory_gib == without.memory_gib
