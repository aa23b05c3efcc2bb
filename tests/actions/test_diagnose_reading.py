"""diagnose reads like a careful engineer: confirmation steps are not fixes, no mechanism is assumed that nothing
showed, Megatron-LM argument failures are understood in plain words, incidental words match nothing, and the
"nothing matched" answer says what would help. Each on the real error text, on paraphrases, and on negatives.
"""

from __future__ import annotations

import json
import re
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

RESUME_TEXTS = [
    # Megatron-LM#1842 as measured, and the way users put it
    "loss jumped from 0.3 to 10 after resuming with optimizer offload",
    "after resume the loss jumps from 0.31 to 10 with --optimizer-cpu-offload --use-precision-aware-optimizer",
    "resumed training and the loss shot up from 0.3 to 10",
    "continuing from the checkpoint makes the loss diverge",
]


@pytest.mark.parametrize("text", RESUME_TEXTS)
def test_resume_jump_confirms_with_no_load_optim_and_fixes_with_the_upstream_remedy(text: str) -> None:
    report = diagnose(error=text)
    top = report.matches[0]
    assert top.failure == "resume_loss_jump"
    assert top.confirm_overrides == ["checkpoint.load_optim=false"]
    assert "checkpoint.load_optim=false" not in top.fix
    assert any("4082" in a and "sync_hybrid_device_optimizer_fp32_master_copies" in a for a in top.actions)
    assert any("5929" in a for a in top.actions)


def test_resume_jump_with_a_config_still_keeps_the_confirmation_out_of_the_fix(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "optimizer:\n  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 0.5\n")
    top = diagnose(error=RESUME_TEXTS[0], config=cfg).matches[0]
    assert top.failure == "resume_loss_jump" and top.confirm_overrides and not set(top.fix) & set(DISCARDS_STATE)


@pytest.mark.parametrize("mode", KNOWN, ids=lambda m: m.id)
def test_no_failure_mode_fixes_by_throwing_training_state_away(mode) -> None:
    fix = mode.fix(None, re.match(r"(?s).*", "")) if callable(mode.fix) else mode.fix
    assert not set(fix) & set(DISCARDS_STATE), mode.id
    assert not set(fix) & set(mode.confirm_with), mode.id


def test_the_confirming_overrides_are_on_the_json_and_in_the_human_output() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools", "diagnose", "--error", RESUME_TEXTS[0]],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "check:   checkpoint.load_optim=false  (to confirm only; not a fix)" in out
    assert "fix:     checkpoint.load_optim=false" not in out


# ---------------------------------------------------------------------------------------------- no assumed mechanism


@pytest.mark.parametrize(
    "text",
    [
        OOM,
        "RuntimeError: CUDA error: out of memory",
        "the GPU ran out of memory at iteration 12",
        "HBM is full and the job crashes",
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
        (OOM + " with activation offloading of 4 layers", "oom_activation_offload"),
        ("cpu_offloading is on and the GPU still runs out of memory", "oom_activation_offload"),
        (OOM + " at optimizer_offload_fraction 0.25", "oom_partial_optimizer_offload"),
    ],
)
def test_an_oom_that_names_its_offload_gets_that_reading(text: str, reading: str) -> None:
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


@pytest.mark.parametrize(
    ("text", "fix"),
    [
        ("Megatron-LM validate_args fails since we added the two offload flags", []),
        ("megatron-lm refuses to start once I pass the cpu offload command line options", []),
        (
            "pretrain_gpt.py dies in argument validation after adding --optimizer-cpu-offload "
            "--optimizer-offload-fraction 0.5",
            ["optimizer.use_precision_aware_optimizer=true"],
        ),
        (
            "Megatron-LM asserts on the args when I turn on --fine-grained-activation-offloading",
            ["model.transformer_impl=transformer_engine"],
        ),
        (
            "validate_args in Megatron-LM rejects optimizer offload together with --fp8-param-gather",
            ["optimizer.fp8_recipe=delayed"],
        ),
    ],
)
def test_plain_language_megatron_lm_argument_failures_are_recognised(text: str, fix: list[str]) -> None:
    report = diagnose(error=text)
    top = report.matches[0]
    assert top.failure == "mlm_validate_args" and top.fix == fix
    assert "--megatron-args" in top.confirm
    assert any("--use-precision-aware-optimizer" in a for a in top.actions)
    if not fix:  # the text names no check: the report asks for the command line rather than guessing
        assert any("command line" in n for n in report.needs)


@pytest.mark.parametrize(
    "text",
    [
        "Megatron-LM runs fine with the offload flags",
        "which Megatron-LM flags switch on offloading?",
        "the Bridge config with optimizer offload fails to load the checkpoint weights",
    ],
)
def test_megatron_lm_argument_reading_needs_megatron_lm_its_arguments_and_a_failure(text: str) -> None:
    assert "mlm_validate_args" not in _ids(diagnose(error=text))


# ---------------------------------------------------------------------------------------------- incidental words


@pytest.mark.parametrize(
    "text", ["at step 2 it jumps", "the step counter jumps by two", "iteration 5 went up", "it got worse at step 1"]
)
def test_incidental_words_match_no_mode_and_are_close_to_none(text: str) -> None:
    report = diagnose(error=text)
    assert report.matches == [] and report.closest == []


def test_the_slowdown_mode_still_reads_a_real_slowdown() -> None:
    assert _ids(diagnose(error="each step takes 3x longer since I turned on optimizer offload"))[0] == "slowdown"


# ---------------------------------------------------------------------------------------------- nothing matched


@pytest.mark.parametrize("text", ["the frobnicator is broken", "at step 2 it jumps", "the memory of my GPU looks odd"])
def test_nothing_matched_is_said_cleanly_with_what_would_help(text: str) -> None:
    report = diagnose(error=text)
    assert report.matches == []
    note = report.notes[-1]
    assert "none." not in note and ": ." not in note and " ," not in note and ".." not in note
    assert "config" in note and report.needs
    if report.closest:
        assert report.closest[0].failure in note
    else:
        assert "closest" not in note


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
