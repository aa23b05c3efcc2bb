"""mbridge_offload.actions.diagnose.diagnose: known failure modes, matched from upstream's messages or named as a
symptom, narrowed by the config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mbridge_offload.actions.diagnose.diagnose import SYMPTOMS, diagnose
from mbridge_offload.actions.diagnose.failures.catalogue import KNOWN
from mbridge_offload.config.rules.catalogue import all_rules
from mbridge_offload.config.sources import load

PP2_TRACEBACK = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "megatron/core/transformer/transformer_config.py", line 1304, in __post_init__
[rank0]:     raise ValueError(
[rank0]: ValueError: Currently there is no support for Pipeline parallelism with CPU offloading
"""

OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of "
    "79.10 GiB of which 1.02 GiB is free."
)


def _yaml(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("# run config\n" + body, encoding="utf-8")
    return path


def _ids(report) -> list[str]:
    return [m.failure for m in report.matches]


def test_pp_error_in_a_traceback_gives_cause_confirm_and_override_fix() -> None:
    report = diagnose(log=PP2_TRACEBACK)
    top = report.matches[0]
    assert top.failure == "pp_constraint"
    assert "pipeline_model_parallel_size" in top.confirm
    assert top.fix[:2] == ["model.cpu_offloading=false", "optimizer.optimizer_cpu_offload=true"]
    assert "no support for Pipeline parallelism" in top.evidence


@pytest.mark.parametrize("rule", [r for r in all_rules() if r.upstream and r.severity == "error"], ids=lambda r: r.id)
def test_every_upstream_error_message_in_the_catalogue_is_recognised(rule) -> None:
    text = re.sub(r"\{[^}]*\}", "7", rule.message)
    report = diagnose(error=f"ValueError: {text}")
    assert report.matches, f"{rule.id}: {text!r} not matched"
    assert all(m.cause for m in report.matches)


def test_layer_range_fix_uses_the_number_in_the_message() -> None:
    report = diagnose(error="ValueError: CPU offloading can be done only for layers less than 48")
    assert report.matches[0].fix == ["model.cpu_offloading_num_layers=47"]


def test_an_oom_under_flags_that_switch_both_offloads_on_is_the_activation_offload_reading() -> None:
    text = "pretrain_gpt.py --cpu-offloading-num-layers 4 --optimizer-offload-fraction 0.5\n" + OOM
    report = diagnose(error=text)
    assert _ids(report) == ["oom_activation_offload"]
    assert "activation offload on" in {r.failure: r.reason for r in report.ruled_out}["oom_partial_optimizer_offload"]


def test_oom_with_activation_offload_config_takes_the_planners_first_option(tmp_path: Path) -> None:
    loaded = load(
        str(
            _yaml(
                tmp_path,
                "act.yaml",
                "model:\n  seq_length: 16384\n  cpu_offloading: true\n  cpu_offloading_num_layers: 2\n",
            )
        )
    )
    report = diagnose(error=OOM, config=loaded.config, raw=loaded.raw, planner={"model": "llama3-8b", "gpu": "b200"})
    assert _ids(report) == ["oom_activation_offload"]
    assert report.matches[0].fix == next(o.overrides for o in report.options if o.fits and not o.alternative)


def test_oom_at_partial_optimizer_offload_is_sized_by_the_planner_not_raised_by_a_step(tmp_path: Path) -> None:
    body = "model:\n  seq_length: 8192\noptimizer:\n  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 0.25\n"
    loaded = load(str(_yaml(tmp_path, "opt.yaml", body)))
    report = diagnose(error=OOM, config=loaded.config, raw=loaded.raw, planner={"model": "qwen3-8b"})
    assert _ids(report) == ["oom_partial_optimizer_offload"]
    assert report.matches[0].fix in [o.overrides for o in report.options]
    assert "optimizer.optimizer_offload_fraction=0.5" not in report.matches[0].fix


def test_slowdown_at_full_offload_lowers_the_fraction(tmp_path: Path) -> None:
    cfg = load(
        str(
            _yaml(
                tmp_path, "full.yaml", "optimizer:\n  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 1.0\n"
            )
        )
    ).config
    report = diagnose(symptom="slowdown", config=cfg)
    assert _ids(report) == ["slowdown"]
    assert report.matches[0].fix == [
        "optimizer.optimizer_offload_fraction=0.75",
        "optimizer.overlap_cpu_optimizer_d2h_h2d=true",
    ]


@pytest.mark.parametrize(
    ("text", "failure"),
    [
        (
            "TypeError: get_cpu_offload_context() takes from 0 to 4 positional arguments but 5 were given",
            "te_signature",
        ),
        (
            "_pickle.UnpicklingError: Weights only load failed. WeightsUnpickler error: Unsupported global: "
            "GLOBAL torch.optim.adamw.AdamW was not an allowed global by default.",
            "weights_only_load",
        ),
        (
            "RuntimeError: CUDA error: invalid argument ... cudaHostAlloc failed; check ulimit -l (memlock)",
            "pinned_memory",
        ),
        (
            "ValueError: CPU Offloading is enabled while it is not mentioned what to offload (weights/activations)",
            "te_nothing_to_offload",
        ),
        ("KeyError in _update_fp32_params_by_new_state", "fp32_master_keyerror"),
        ("[3422.1] Out of memory: Killed process 4242 (python) total-vm:912GB", "host_oom"),
    ],
)
def test_failures_read_from_upstreams_own_output(text: str, failure: str) -> None:
    assert diagnose(error=text).matches[0].failure == failure


def test_every_known_failure_has_cause_confirm_and_a_fix_or_action() -> None:
    for mode in KNOWN:
        assert mode.cause and mode.confirm, mode.id
        assert mode.fix or mode.actions, mode.id


def test_config_adds_validator_findings(tmp_path: Path) -> None:
    loaded = load(
        str(
            _yaml(
                tmp_path,
                "pp.yaml",
                "model:\n  num_layers: 8\n  cpu_offloading: true\n  pipeline_model_parallel_size: 2\n",
            )
        )
    )
    report = diagnose(error=PP2_TRACEBACK, config=loaded.config, raw=loaded.raw)
    assert "ACT-PP" in [f["rule"] for f in report.findings]


def test_before_after_lists_the_offload_diff_and_reads_it_as_an_oom_risk(tmp_path: Path) -> None:
    body = "model:\n  num_layers: 48\noptimizer:\n  optimizer_cpu_offload: true\n  optimizer_offload_fraction: {}\n"
    before = load(str(_yaml(tmp_path, "before.yaml", body.format(0.75)))).config
    after = load(str(_yaml(tmp_path, "after.yaml", body.format(0.25)))).config
    report = diagnose(before=before, after=after)
    assert report.comparison["changed"] == [
        {"key": "optimizer.optimizer_offload_fraction", "before": 0.75, "after": 0.25}
    ]
    assert _ids(report) == ["oom_partial_optimizer_offload"]


def test_unknown_text_matches_nothing_and_says_so() -> None:
    report = diagnose(error="segmentation fault in libfoo")
    assert report.matches == [] and "no upstream message of a known offload failure" in report.notes[0]


# ---------------------------------------------------------------------------------------------- named symptoms


@pytest.mark.parametrize("mode", KNOWN, ids=lambda m: m.id)
def test_every_failure_mode_can_be_named_as_a_symptom(mode) -> None:
    report = diagnose(symptom=mode.id)
    if mode.id.startswith(("oom_full", "oom_no")):  # the config tells these apart; named, they still stand
        assert _ids(report) == [mode.id]
    assert mode.id in _ids(report)
    top = next(m for m in report.matches if m.failure == mode.id)
    assert top.source == "symptom" and top.evidence == f"named by the caller: symptom {mode.id}"


def test_the_symptoms_are_the_failure_ids_and_oom() -> None:
    assert set(SYMPTOMS) == {"oom", *(m.id for m in KNOWN)}


def test_an_unknown_symptom_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown symptom 'slow'.*slowdown"):
        diagnose(symptom="slow")


def test_a_named_oom_without_a_config_asks_for_the_config() -> None:
    report = diagnose(symptom="oom")
    assert _ids(report) == ["oom_unattributed"] and report.matches[0].fix == []
    assert any("config" in n for n in report.needs)


def test_a_named_oom_with_a_config_gets_the_configs_reading(tmp_path: Path) -> None:
    cfg = load(str(_yaml(tmp_path, "act.yaml", "model:\n  num_layers: 8\n  cpu_offloading: true\n"))).config
    assert _ids(diagnose(symptom="oom", config=cfg)) == ["oom_activation_offload"]


@pytest.mark.parametrize(
    "text",
    [
        "at step 2 it jumps",
        "training is 4x slower with offload on",
        "GPU memory did not go down",
        "loss jumped after resuming from the checkpoint",
    ],
)
def test_a_sentence_without_an_upstream_message_matches_nothing_and_says_to_name_the_symptom(text: str) -> None:
    report = diagnose(error=text)
    assert report.matches == []
    assert "does not read prose" in report.notes[-1] and "slowdown" in report.notes[-1]


def test_report_is_one_pydantic_schema() -> None:
    report = diagnose(symptom="no_saving")
    data = report.model_dump(mode="json")
    assert set(data) == {
        *("matches", "ruled_out", "findings", "comparison", "needs", "notes", "effective"),
        *("options", "assumptions", "calibration"),
    }
    assert data["matches"][0]["source"] == "symptom"


# ---------------------------------------------------------------------------------------------- the config decides

HALF = "optimizer:\n  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 0.5\n"


def _cfg(tmp_path: Path, body: str, name: str = "run.yaml"):
    return load(str(_yaml(tmp_path, name, body))).config


def test_no_saving_is_ruled_out_when_the_fraction_is_already_half(tmp_path: Path) -> None:
    report = diagnose(symptom="no_saving", config=_cfg(tmp_path, HALF))
    assert "no_saving" not in _ids(report)
    (ruled,) = [r for r in report.ruled_out if r.failure == "no_saving"]
    assert "optimizer_offload_fraction is 0.5" in ruled.reason
    assert not any("fraction is 0.0" in m.cause for m in report.matches)
    assert any(n.startswith("ruled out by the config: no_saving") for n in report.notes)


def test_no_saving_with_offload_off_says_offload_is_off_and_turns_it_on(tmp_path: Path) -> None:
    report = diagnose(symptom="no_saving", config=_cfg(tmp_path, "model:\n  num_layers: 8\n"))
    top = report.matches[0]
    assert top.failure == "no_saving"
    assert "optimizer_cpu_offload is false in this config" in top.cause
    assert top.fix == ["optimizer.optimizer_cpu_offload=true", "optimizer.optimizer_offload_fraction=0.5"]


def test_no_saving_at_fraction_zero_names_the_fraction(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "optimizer:\n  optimizer_cpu_offload: true\n")
    top = diagnose(symptom="no_saving", config=cfg).matches[0]
    assert top.failure == "no_saving" and "optimizer_offload_fraction is 0.0 in this config" in top.cause


def test_oom_readings_the_config_excludes_are_listed_with_reasons(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "model:\n  num_layers: 48\n  cpu_offloading: true\n  cpu_offloading_num_layers: 24\n")
    report = diagnose(error=OOM, config=cfg)
    assert _ids(report) == ["oom_activation_offload"]
    reasons = {r.failure: r.reason for r in report.ruled_out}
    assert "model.cpu_offloading is true" in reasons["oom_partial_optimizer_offload"]


def test_slowdown_cause_names_the_configs_fraction(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, HALF)
    top = diagnose(symptom="slowdown", config=cfg).matches[0]
    assert top.failure == "slowdown" and "optimizer_offload_fraction=0.5" in top.cause


def test_slowdown_without_any_offload_is_ruled_out(tmp_path: Path) -> None:
    report = diagnose(symptom="slowdown", config=_cfg(tmp_path, "model:\n  num_layers: 8\n"))
    assert "slowdown" not in _ids(report)
    assert "nothing is offloaded" in {r.failure: r.reason for r in report.ruled_out}["slowdown"]


def test_pinned_fix_drops_keys_already_false(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, HALF + "  pin_cpu_grads: false\n")
    top = diagnose(error="RuntimeError: cudaHostAlloc failed; check ulimit -l", config=cfg).matches[0]
    assert top.failure == "pinned_memory" and top.fix == ["optimizer.pin_cpu_params=false"]


# --------------------------------------------------------------------------------------------- fine-tune (Bridge #3949)

FINETUNE = (
    "model:\n  bf16: true\noptimizer:\n  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 1.0\n"
    "  use_distributed_optimizer: true\n  bf16: true\ncheckpoint:\n  pretrained_checkpoint: /ckpt/hf\n"
)


def test_finetune_with_stale_masters_is_its_own_mode() -> None:
    report = diagnose(symptom="finetune_stale_masters")
    top = report.matches[0]
    assert top.failure == "finetune_stale_masters" and "resume_loss_jump" not in _ids(report)
    assert "checkpoint.load_optim=false" not in top.fix
    assert any("4082" in a for a in top.actions) and "NVIDIA-NeMo/Megatron-Bridge#3949" in top.references


def test_bridges_sync_call_in_a_log_is_the_finetune_mode_and_supersedes_a_named_resume_jump(tmp_path: Path) -> None:
    text = 'File "megatron/bridge/training/checkpointing.py", in sync_hybrid_device_optimizer_fp32_master_copies'
    report = diagnose(error=text, symptom="resume_loss_jump", config=_cfg(tmp_path, FINETUNE))
    assert _ids(report)[0] == "finetune_stale_masters"
    assert "pretrained_checkpoint='/ckpt/hf'" in report.matches[0].cause
    assert "finetune_stale_masters" in {r.failure: r.reason for r in report.ruled_out}["resume_loss_jump"]


def test_resume_jump_is_ruled_out_when_no_optimizer_state_is_loaded(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, HALF + "checkpoint:\n  load_optim: false\n")
    report = diagnose(symptom="resume_loss_jump", config=cfg)
    assert "resume_loss_jump" not in _ids(report)
    assert "checkpoint.load_optim is false" in {r.failure: r.reason for r in report.ruled_out}["resume_loss_jump"]


def test_finetune_mode_is_ruled_out_without_optimizer_offload(tmp_path: Path) -> None:
    report = diagnose(symptom="finetune_stale_masters", config=_cfg(tmp_path, "model:\n  bf16: true\n"))
    assert "finetune_stale_masters" in {r.failure for r in report.ruled_out}


# ---------------------------------------------------------------------------------------------- user reports since June

# The error text as filed upstream (issue in the comment); an agent names the failure when the user only describes it.
REPORTS = [
    (
        "optimizer_state_device_mismatch",  # NVIDIA-NeMo/Speech#14574
        "[rank65]:     return torch._C._group_tensors_by_device_and_dtype(tensorlistlist, with_indices)\n"
        "[rank65]: RuntimeError: Tensors of the same index must be on the same device and the same dtype except "
        "`step` tensors that can be CPU and float32/64 notwithstanding",
        "after resuming with offload fraction 1.0 the Adam step fails: optimizer state tensors are on different "
        "devices",
    ),
    (
        "double_buffer_size_mismatch",  # NVIDIA-NeMo/Speech#14670
        '[rank7]:   File "transformer_engine/pytorch/cpu_offload.py", line 265, in reload\n'
        '[rank7]:     assert cpu_backup.size() == copy_buffer.size(), "Can\'t copy two buffers of different sizes!"\n'
        "[rank7]: AssertionError: Can't copy two buffers of different sizes!",
        "activation offloading with double buffering crashes because the buffer sizes differ between layers",
    ),
    (
        "common_state_differs",  # NVIDIA-NeMo/Speech#14243
        "[NeMo W 2025-07-15 21:12:01 validation:389] There is difference in the common state dict in different "
        "ranks. The differences are {2: ([('optimizer', 0, 'param_state', "
        "'module.decoder.layers.11.self_attention.linear_proj.weight'), ...",
        "when saving with optimizer offload the optimizer state differs between ranks and auto-resume fails",
    ),
    (
        "mfsdp_offload_pin_memory",  # NVIDIA/Megatron-LM#1986
        'Megatron FSDP does not work with CPU_OFFLOADING. [rank2047]:   File "megatron/training/training.py", '
        "line 1104, in setup_model_and_optimizer\n[rank2047]:     optimizer = get_megatron_optimizer(\n"
        '[rank2047]:   File "megatron/core/distributed/fsdp/src/megatron_fsdp/uneven_dtensor.py", in ...\n'
        "[rank2047]:     param = param.pin_memory()",
        "Megatron-FSDP with optimizer CPU offload crashes in pin_memory when the optimizer is built",
    ),
    (
        "stale_grad_reapplied",  # NVIDIA/Megatron-LM#7551
        "Fix stale gradients in hybrid optimizer: in HybridDeviceOptimizer._set_sub_optimizer_grads a param whose "
        "grad is None keeps last step's grad",
        "MoE experts that get no tokens still change every step with optimizer offload: the stale gradient of the "
        "previous step is applied again",
    ),
    (
        "fused_adam_cpu_tensors",  # NVIDIA-NeMo/RL#3544
        "optimizer: TE FusedAdam with cpu_offload: true -> loss NaN at step N+1 after restoring the optimizer state",
        "the fused Adam runs on CPU offloaded optimizer states and the loss becomes NaN after resume",
    ),
]


@pytest.mark.parametrize(("failure", "error", "_paraphrase"), REPORTS, ids=[r[0] for r in REPORTS])
def test_upstream_report_text_is_matched(failure: str, error: str, _paraphrase: str) -> None:
    report = diagnose(error=error)
    assert report.matches and report.matches[0].failure == failure, _ids(report)
    assert report.matches[0].references


@pytest.mark.parametrize(("failure", "_error", "paraphrase"), REPORTS, ids=[r[0] for r in REPORTS])
def test_the_reports_paraphrase_alone_matches_nothing(failure: str, _error: str, paraphrase: str) -> None:
    assert failure not in _ids(diagnose(error=paraphrase))  # an agent names it: symptom=failure


def test_mfsdp_pin_memory_is_ruled_out_without_megatron_fsdp(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, HALF + "ddp:\n  use_distributed_optimizer: true\n")
    report = diagnose(error=REPORTS[3][1], config=cfg)
    assert "ddp.use_megatron_fsdp is false" in {r.failure: r.reason for r in report.ruled_out}[REPORTS[3][0]]


def test_double_buffer_mode_is_ruled_out_when_double_buffering_is_off(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "model:\n  num_layers: 8\n  cpu_offloading: true\n  cpu_offloading_num_layers: 4\n")
    report = diagnose(error=REPORTS[1][1], config=cfg)
    assert "cpu_offloading_double_buffering is false" in report.ruled_out[0].reason


def test_precision_dtypes_mode_reads_the_configs_dtypes(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, HALF + "  exp_avg_dtype: bf16\n  exp_avg_sq_dtype: bf16\n")
    top = diagnose(symptom="precision_dtypes_ignored", config=cfg).matches[0]
    assert top.failure == "precision_dtypes_ignored" and "exp_avg_dtype=bf16" in top.cause
    fp32 = _cfg(tmp_path, HALF, "fp32.yaml")
    assert "all fp32" in diagnose(symptom="precision_dtypes_ignored", config=fp32).ruled_out[0].reason


def test_stale_grad_cause_names_the_configs_experts(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "model:\n  num_moe_experts: 64\n" + HALF)
    top = diagnose(symptom="stale_grad_reapplied", config=cfg).matches[0]
    assert top.failure == "stale_grad_reapplied" and "64 MoE experts" in top.cause
