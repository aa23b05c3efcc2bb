"""diagnose reads like a careful engineer: confirmation steps are not fixes, no mechanism is assumed that nothing
showed, Megatron-LM's argument assertions are matched to their rules, prose matches nothing, and the "nothing
matched" answer says what would help. Each on upstream's real error text, on named symptoms, and on negatives.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mbridge_offload.actions.diagnose.diagnose import diagnose
from mbridge_offload.actions.diagnose.failures.catalogue import KNOWN
from mbridge_offload.actions.diagnose.failures.memory import OOM_UNATTRIBUTED
from mbridge_offload.config.sources import load

OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of "
    "79.10 GiB of which 1.02 GiB is free."
)
# Settings that throw training state away: a way to confirm a cause, never a fix.
DISCARDS_STATE = ("checkpoint.load_optim=false", "checkpoint.save_optim=false")


def _ids(report) -> list[str]:
    return [m.failure for m in report.matches]


def _cfg(tmp_path: Path, body: str):
    path = tmp_path / "run.yaml"
    path.write_text(body, encoding="utf-8")
    return load(str(path)).config


def _all_fixes(report) -> list[str]:
    return [f for m in report.matches for f in m.fix]


# ---------------------------------------------------------------------------------------------- confirm is not fix


def test_resume_jump_confirms_with_a_run_that_tells_the_causes_apart_and_fixes_with_the_upstream_remedy() -> None:
    top = diagnose(symptom="resume_loss_jump").matches[0]
    assert top.failure == "resume_loss_jump"
    assert "checkpoint.load_optim=false" not in top.fix
    assert any("4082" in a and "sync_hybrid_device_optimizer_fp32_master_copies" in a for a in top.actions)
    assert any("5929" in a for a in top.actions)


def test_the_resume_check_tells_the_hdo_restore_from_the_checkpoint_apart() -> None:
    top = diagnose(symptom="resume_loss_jump").matches[0]
    # Resuming the same state into the GPU optimizer: the jump goes only if the HybridDeviceOptimizer's restore is
    # at fault. Resuming without the optimizer state makes every restore fault go, so it tells nothing.
    assert top.confirm_overrides == ["optimizer.optimizer_cpu_offload=false"]
    assert "goes away: the HybridDeviceOptimizer's restore" in top.confirm
    assert "stays: the saved state or its reading" in top.confirm
    assert "checkpoint.load_optim=false tells neither apart" in top.confirm


def test_resume_jump_with_a_config_still_keeps_the_confirmation_out_of_the_fix(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "optimizer:\n  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 0.5\n")
    top = diagnose(symptom="resume_loss_jump", config=cfg).matches[0]
    assert top.failure == "resume_loss_jump" and top.confirm_overrides and not set(top.fix) & set(DISCARDS_STATE)


@pytest.mark.parametrize("mode", KNOWN, ids=lambda m: m.id)
def test_no_failure_mode_fixes_by_throwing_training_state_away(mode) -> None:
    fix = mode.fix(None, None) if callable(mode.fix) else mode.fix
    assert not set(fix) & set(DISCARDS_STATE), mode.id
    assert not set(fix) & set(mode.confirm_with), mode.id


def test_the_confirming_overrides_are_on_the_json_and_in_the_human_output() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools", "diagnose", "--symptom", "resume_loss_jump"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "(to confirm only; not a fix)" in out
    assert "fix:     checkpoint.load_optim=false" not in out


# ---------------------------------------------------------------------------------------------- no assumed mechanism


@pytest.mark.parametrize(
    "text",
    [
        OOM,
        "RuntimeError: CUDA error: out of memory",
        '  File "megatron/core/optimizer/optimizer.py", line 477, in step\n' + OOM,
    ],
)
def test_a_plain_oom_asks_for_the_config_instead_of_blaming_an_offload(text: str) -> None:
    report = diagnose(error=text)
    assert _ids(report) == ["oom_unattributed"]
    assert report.matches[0].fix == []
    assert "model.cpu_offloading=false" not in _all_fixes(report)
    assert any("config" in n for n in report.needs) and any("log" in n for n in report.needs)


@pytest.mark.parametrize(
    ("text", "reading"),
    [
        ("model.cpu_offloading=true model.cpu_offloading_num_layers=4\n" + OOM, "oom_activation_offload"),
        ("  cpu_offloading_num_layers ....... 4\n" + OOM, "oom_activation_offload"),
        ("optimizer.optimizer_offload_fraction=0.25\n" + OOM, "oom_partial_optimizer_offload"),
    ],
)
def test_an_oom_whose_log_states_its_offload_gets_that_reading(text: str, reading: str) -> None:
    report = diagnose(error=text)
    assert _ids(report)[0] == reading and "oom_unattributed" not in _ids(report)


def test_with_a_config_an_oom_is_never_unattributed(tmp_path: Path) -> None:
    for body in ("model:\n  num_layers: 8\n", "model:\n  num_layers: 8\n  cpu_offloading: true\n"):
        report = diagnose(error=OOM, config=_cfg(tmp_path, body))
        assert "oom_unattributed" not in _ids(report) and report.matches
        assert not any("config" in n for n in report.needs)


def test_a_host_oom_is_not_read_as_an_unattributed_gpu_oom() -> None:
    ids = _ids(diagnose(error="Out of memory: Killed process 4242 (python)"))
    assert "host_oom" in ids and "oom_unattributed" not in ids


def test_the_unattributed_oom_is_documented_like_every_mode() -> None:
    assert OOM_UNATTRIBUTED.cause and OOM_UNATTRIBUTED.confirm and OOM_UNATTRIBUTED.needs


# ---------------------------------------------------------------------------------------------- Megatron-LM argv


def test_the_real_validate_args_assertion_is_matched_to_its_rule() -> None:
    text = (
        'File "megatron/training/arguments.py", line 1154, in validate_args\n'
        "AssertionError: The optimizer cpu offload must be used in conjunction with `--use-precision-aware-optimizer`, "
        "as the hybrid device optimizer reuses the code path of this flag."
    )
    top = diagnose(error=text).matches[0]
    assert top.fix == ["optimizer.use_precision_aware_optimizer=true"]


def test_a_named_megatron_lm_argument_failure_asks_for_the_command_line() -> None:
    report = diagnose(symptom="mlm_validate_args")
    top = report.matches[0]
    assert top.failure == "mlm_validate_args" and top.fix == []
    assert "--megatron-args" in top.confirm
    assert any("--use-precision-aware-optimizer" in a for a in top.actions)
    assert any("command line" in n for n in report.needs)


@pytest.mark.parametrize(
    ("rule", "fix"),
    [
        ("OPT-MLM-PRECISION-AWARE", ["optimizer.use_precision_aware_optimizer=true"]),
        ("ACT-MLM-FG-TE-IMPL", ["model.transformer_impl=transformer_engine"]),
        ("OPT-MLM-FP8-PARAM-GATHER", ["optimizer.fp8_recipe=delayed"]),
    ],
)
def test_each_validate_args_assertion_is_matched_to_its_rule(rule: str, fix: list[str]) -> None:
    from mbridge_offload.config.rules.catalogue import all_rules

    message = next(r.message for r in all_rules() if r.id == rule)
    top = diagnose(error=f"AssertionError: {message}").matches[0]
    assert top.fix == fix and top.source in ("known", f"rule:{rule}")  # a known mode may explain the rule


# ---------------------------------------------------------------------------------------------- prose


@pytest.mark.parametrize(
    "text", ["at step 2 it jumps", "the step counter jumps by two", "iteration 5 went up", "it got worse at step 1"]
)
def test_a_sentence_with_no_upstream_message_matches_no_mode(text: str) -> None:
    assert diagnose(error=text).matches == []


def test_a_real_slowdown_is_named_not_read() -> None:
    assert diagnose(error="each step takes 3x longer since I turned on optimizer offload").matches == []
    assert _ids(diagnose(symptom="slowdown"))[0] == "slowdown"


# ---------------------------------------------------------------------------------------------- nothing matched


@pytest.mark.parametrize("text", ["the frobnicator is broken", "at step 2 it jumps", "the memory of my GPU looks odd"])
def test_nothing_matched_is_said_cleanly_with_what_would_help(text: str) -> None:
    report = diagnose(error=text)
    assert report.matches == []
    note = report.notes[-1]
    assert "none." not in note and ": ." not in note and " ," not in note and ".." not in note
    assert "config" in note and "symptom" in note and report.needs


def test_cli_json_carries_needs_for_a_plain_oom() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools", "diagnose", "--error", OOM, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    data = json.loads(proc.stdout)
    assert proc.returncode == 0 and data["matches"][0]["failure"] == "oom_unattributed"
    assert data["matches"][0]["confirm_overrides"] == [] and data["needs"]
