"""mbridge_offload.actions.diagnose.diagnose: known failure modes, matched from real error text, narrowed by the
config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mbridge_offload.actions.diagnose.diagnose import diagnose
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


def test_oom_naming_both_offloads_without_config_lists_the_two_offload_readings() -> None:
    text = OOM + " (activation offload of 4 layers and optimizer offload at fraction 0.5)"
    assert _ids(diagnose(error=text)) == ["oom_activation_offload", "oom_partial_optimizer_offload"]


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
    report = diagnose(log="step time is 4.2x slower than the baseline", config=cfg)
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
            "iteration 101 | lm loss 10.2 -- loss jumped from 0.31 after resuming from the checkpoint",
            "resume_loss_jump",
        ),
        (
            "ValueError: CPU Offloading is enabled while it is not mentioned what to offload (weights/activations)",
            "te_nothing_to_offload",
        ),
        ("KeyError in _update_fp32_params_by_new_state", "fp32_master_keyerror"),
        ("I enabled optimizer_cpu_offload but see no memory saving", "no_saving"),
    ],
)
def test_failures_without_one_upstream_message(text: str, failure: str) -> None:
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
    assert report.matches == [] and "no known offload failure matched" in report.notes[0]


# ---------------------------------------------------------------------------------------------- by meaning

PARAPHRASES: dict[str, list[str]] = {
    "no_saving": [
        "GPU memory did not go down",
        "turned on optimizer_cpu_offload, VRAM usage is exactly the same as before",
        "the offload flag has no effect on allocated memory",
        "I moved the optimizer states to the CPU but HBM consumption barely decreased",
        "memory footprint on the device is unchanged after enabling offloading",
        "max allocated stays at 47 GiB whether or not I offload",
    ],
    "slowdown": [
        "each iteration now takes 4x longer since I enabled the optimizer on the host",
        "training is crawling with offload on",
        "tokens/s tanked — throughput dropped after switching on offloading",
        "the run became sluggish, steps take forever",
        "iterations are way slower than the baseline",
    ],
    "resume_loss_jump": [
        "after I restarted from the checkpoint the lm loss went back to its initial value",
        "resumed training and the loss shot up from 0.3 to 10",
        "loss spikes right after reloading the ckpt",
        "perplexity got much worse once the job picked up again from the saved state",
        "continuing from the checkpoint makes the loss diverge",
    ],
    "pinned_memory": [
        "cannot allocate page locked buffers on the host",
        "pinning host memory fails inside the container",
        "the container's limit on locked memory is too small",
        "error when the optimizer tries to pin its CPU tensors",
        "ulimit for locked memory is 64 KiB and the job dies at start",
    ],
    "host_oom": [
        "the node's RAM filled up and the kernel killed the process",
        "system memory is exhausted on the host when I offload everything",
        "the job gets killed with exit code 137, dmesg shows the oom killer",
        "host ran out of RAM during the first optimizer step",
        "the machine's RAM is exhausted and the rank died",
    ],
    "checkpoint_save_assert": [
        "an assertion fires when saving the checkpoint with offload on",
        "assert failed while writing the checkpoint",
        "saving the optimizer state hits an AssertionError",
        "I get an assertion error as soon as the checkpoint is saved",
        "checkpoint saving dies on an assert in the distributed optimizer",
    ],
    "fsdp_save_hang": [
        "the job is stuck forever while saving the checkpoint",
        "writing the checkpoint never finishes with optimizer offload",
        "checkpoint save freezes with Megatron-FSDP",
        "saving the optimizer state deadlocks",
        "the run hung at the checkpoint save step",
    ],
    "weights_only_load": [
        "torch.load refuses the checkpoint because of weights_only",
        "unpickling the optimizer state fails with PyTorch 2.6",
        "loading fails: the class is not in the safe globals",
        "weights-only loading rejects my optimizer checkpoint",
        "pickle error when loading the offloaded optimizer checkpoint",
    ],
}


def _patterns_and_phrasings() -> list[str]:
    out = []
    for mode in KNOWN:
        out += [p.lower() for p in mode.patterns] + [p.lower() for p in mode.phrasings]
    return out


@pytest.mark.parametrize(
    ("failure", "text"), [(f, t) for f, texts in PARAPHRASES.items() for t in texts], ids=lambda v: str(v)[:40]
)
def test_plain_phrasings_are_understood(failure: str, text: str) -> None:
    assert not any(text.lower() in p or p in text.lower() for p in _patterns_and_phrasings())  # a real paraphrase
    assert failure in _ids(diagnose(error=text))


@pytest.mark.parametrize(
    "text",
    [
        "after enabling optimizer offload the GPU ran out of memory space",
        "not enough GPU memory with offload fraction 0.25",
        "with the Adam states offloaded the card still runs out of memory",
    ],
)
def test_oom_paraphrases_naming_optimizer_offload_give_that_reading_not_activation_offload(text: str) -> None:
    ids = _ids(diagnose(error=text))
    assert "oom_partial_optimizer_offload" in ids
    assert not {"oom_activation_offload", "oom_unattributed"} & set(ids)


@pytest.mark.parametrize(
    "text",
    [
        "the device memory got exhausted at step 3",
        "my training does not fit on the card anymore",
        "HBM is full and the job crashes",
    ],
)
def test_oom_paraphrases_naming_no_mechanism_ask_for_the_config(text: str) -> None:
    report = diagnose(error=text)
    assert _ids(report) == ["oom_unattributed"] and report.matches[0].fix == []
    assert any("config" in n for n in report.needs)


def test_every_mode_with_phrasings_has_at_least_two_ways_to_say_it() -> None:
    spoken = [m for m in KNOWN if m.phrasings]
    assert len(spoken) >= 10
    for mode in spoken:
        if not mode.id.startswith(("oom_full", "pp_", "recompute_", "cuda_graph_")):
            assert len(mode.phrasings) >= 2, mode.id


def test_nothing_matched_lists_the_closest_modes() -> None:
    report = diagnose(error="the memory of my GPU looks odd")
    assert report.matches == []
    assert report.closest and report.closest[0].score > 0
    assert "closest failure modes" in report.notes[0]
    assert report.closest[0].failure in report.notes[0]


def test_report_is_one_pydantic_schema() -> None:
    report = diagnose(error="GPU memory did not go down")
    data = report.model_dump(mode="json")
    assert set(data) == {
        *("matches", "ruled_out", "findings", "comparison", "closest", "needs", "notes", "effective"),
        *("options", "assumptions", "calibration"),
    }
    assert data["matches"][0]["source"] == "meaning"


# ---------------------------------------------------------------------------------------------- the config decides

HALF = "optimizer:\n  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 0.5\n"


def _cfg(tmp_path: Path, body: str, name: str = "run.yaml"):
    return load(str(_yaml(tmp_path, name, body))).config


def test_no_saving_is_ruled_out_when_the_fraction_is_already_half(tmp_path: Path) -> None:
    report = diagnose(error="I enabled optimizer_cpu_offload but see no memory saving", config=_cfg(tmp_path, HALF))
    assert "no_saving" not in _ids(report)
    (ruled,) = [r for r in report.ruled_out if r.failure == "no_saving"]
    assert "optimizer_offload_fraction is 0.5" in ruled.reason
    assert not any("fraction is 0.0" in m.cause for m in report.matches)
    assert any(n.startswith("ruled out by the config: no_saving") for n in report.notes)


def test_no_saving_with_offload_off_says_offload_is_off_and_turns_it_on(tmp_path: Path) -> None:
    report = diagnose(error="GPU memory did not go down", config=_cfg(tmp_path, "model:\n  num_layers: 8\n"))
    top = report.matches[0]
    assert top.failure == "no_saving"
    assert "optimizer_cpu_offload is false in this config" in top.cause
    assert top.fix == ["optimizer.optimizer_cpu_offload=true", "optimizer.optimizer_offload_fraction=0.5"]


def test_no_saving_at_fraction_zero_names_the_fraction(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "optimizer:\n  optimizer_cpu_offload: true\n")
    top = diagnose(error="GPU memory did not go down", config=cfg).matches[0]
    assert top.failure == "no_saving" and "optimizer_offload_fraction is 0.0 in this config" in top.cause


def test_oom_readings_the_config_excludes_are_listed_with_reasons(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "model:\n  num_layers: 48\n  cpu_offloading: true\n  cpu_offloading_num_layers: 24\n")
    report = diagnose(error=OOM, config=cfg)
    assert _ids(report) == ["oom_activation_offload"]
    reasons = {r.failure: r.reason for r in report.ruled_out}
    assert "model.cpu_offloading is true" in reasons["oom_partial_optimizer_offload"]


def test_slowdown_cause_names_the_configs_fraction(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, HALF)
    top = diagnose(log="step time is 3x slower than the baseline", config=cfg).matches[0]
    assert top.failure == "slowdown" and "optimizer_offload_fraction=0.5" in top.cause


def test_slowdown_without_any_offload_is_ruled_out(tmp_path: Path) -> None:
    report = diagnose(log="training got slow", config=_cfg(tmp_path, "model:\n  num_layers: 8\n"))
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


@pytest.mark.parametrize(
    "text",
    [
        "fine-tuning from a pretrained checkpoint, loss right at step 1, random at step 2",
        "SFT from the HF weights: iteration 1 lm loss 1.9, iteration 2 lm loss 11.8 -- it collapses to random",
        "after loading the pretrained weights the loss goes back to random after one step",
    ],
)
def test_finetune_with_stale_masters_is_its_own_mode(text: str) -> None:
    report = diagnose(error=text)
    assert report.matches[0].failure == "finetune_stale_masters"
    assert "resume_loss_jump" not in _ids(report)
    top = report.matches[0]
    assert "checkpoint.load_optim=false" not in top.fix
    assert any("4082" in a for a in top.actions) and "NVIDIA-NeMo/Megatron-Bridge#3949" in top.references


def test_finetune_mode_supersedes_the_resume_fix_when_both_match(tmp_path: Path) -> None:
    text = "fine-tuning from a pretrained checkpoint: loss jumped to random at step 2 after loading"
    report = diagnose(error=text, config=_cfg(tmp_path, FINETUNE))
    assert _ids(report)[0] == "finetune_stale_masters"
    assert "pretrained_checkpoint='/ckpt/hf'" in report.matches[0].cause
    assert (
        "checkpoint.load_optim=false) tells nothing"
        in {r.failure: r.reason for r in report.ruled_out}["resume_loss_jump"]
    )


def test_resume_jump_is_ruled_out_when_no_optimizer_state_is_loaded(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, HALF + "checkpoint:\n  load_optim: false\n")
    report = diagnose(error="loss jumped after resuming from the checkpoint", config=cfg)
    assert "resume_loss_jump" not in _ids(report)
    assert "checkpoint.load_optim is false" in {r.failure: r.reason for r in report.ruled_out}["resume_loss_jump"]


def test_finetune_mode_is_ruled_out_without_optimizer_offload(tmp_path: Path) -> None:
    report = diagnose(
        error="fine-tuning from a pretrained checkpoint, loss right at step 1, random at step 2",
        config=_cfg(tmp_path, "model:\n  bf16: true\n"),
    )
    assert "finetune_stale_masters" in {r.failure for r in report.ruled_out}


# ---------------------------------------------------------------------------------------------- user reports since June

# The error text as filed upstream (issue in the comment), and a paraphrase an agent would write.
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
    (
        "precision_dtypes_ignored",  # radixark/Megatron-LM#67
        "--optimizer-cpu-offload --main-params-dtype fp16 --exp-avg-dtype fp16 --exp-avg-sq-dtype fp16 leaves all "
        "three optimizer-state tensors in FP32",
        "with CPU offload the optimizer moments are float32 instead of bf16 even though I set bf16 states",
    ),
]


@pytest.mark.parametrize(("failure", "error", "_paraphrase"), REPORTS, ids=[r[0] for r in REPORTS])
def test_upstream_report_text_is_matched(failure: str, error: str, _paraphrase: str) -> None:
    report = diagnose(error=error)
    assert report.matches and report.matches[0].failure == failure, _ids(report)
    assert report.matches[0].references


@pytest.mark.parametrize(("failure", "_error", "paraphrase"), REPORTS, ids=[r[0] for r in REPORTS])
def test_agent_paraphrase_of_the_report_is_matched(failure: str, _error: str, paraphrase: str) -> None:
    assert failure in _ids(diagnose(error=paraphrase))


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
    top = diagnose(error=REPORTS[6][2], config=cfg).matches[0]
    assert top.failure == "precision_dtypes_ignored" and "exp_avg_dtype=bf16" in top.cause
    fp32 = _cfg(tmp_path, HALF, "fp32.yaml")
    assert "all fp32" in diagnose(error=REPORTS[6][2], config=fp32).ruled_out[0].reason


def test_stale_grad_cause_names_the_configs_experts(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "model:\n  num_moe_experts: 64\n" + HALF)
    top = diagnose(error=REPORTS[4][2], config=cfg).matches[0]
    assert top.failure == "stale_grad_reapplied" and "64 MoE experts" in top.cause
