"""diagnose on whole logs: a healthy run's lines (argument and config dumps, metric records, progress lines, fine-tuning
reports) match no failure, with or without an offloading config; the offload settings a log states in upstream's
formats (Megatron-LM's argument dump and flags, Bridge YAML, Hydra overrides, reprs) decide which OOM reading
applies (mbridge_offload.actions.diagnose.stated)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mbridge_offload.actions.diagnose.diagnose import diagnose
from mbridge_offload.actions.diagnose.stated import stated
from mbridge_offload.config.sources import load

OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of 79.10 GiB"

# Lines a healthy run prints, and the way people report a run that is fine (fine-tuning loss reports above all).
NOT_A_FAILURE = [
    # Megatron-LM's training_log, its memory report and timers
    " [2025-07-01 12:00:00] iteration       50/    1000 | consumed samples:         1600 | elapsed time per iteration "
    "(ms): 2375.1 | throughput per GPU (TFLOP/s/GPU): 412.8 | learning rate: 2.999999E-04 | global batch size:    32 "
    "| lm loss: 7.893341E+00 | loss scale: 1.0 | grad norm: 2.114 | number of skipped iterations:   0 | number of nan "
    "iterations:   0 |",
    "[Rank 0] (after 10 iterations) memory (MB) | allocated: 30212.5 | max allocated: 61011.2 | reserved: 64000.0 | "
    "max reserved: 64000.0",
    "(min, max) time across ranks (ms):\n    forward-backward ...............................: (1801.12, 1803.55)\n"
    "    optimizer ......................................: (121.35, 122.01)",
    "Theoretical memory footprints: weight and optimizer=45812.34 MB, activation=30211.21 MB, total=76023.55 MB",
    "saving checkpoint at iteration 500 to /ckpt in torch_dist format\n"
    "successfully saved checkpoint from iteration 500 to /ckpt [ t 1/8, p 1/1 ]",
    "loading checkpoint from /ckpt at iteration 500\n"
    "successfully loaded checkpoint from /ckpt [ t 1/8, p 1/1 ] at iteration 500",
    "WARNING: Setting args.overlap_p2p_comm and args.align_param_gather to False since non-interleaved schedule does "
    "not support overlapping p2p communication and aligned param AG",
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being "
    "overloaded",
    # NeMo / Megatron Bridge progress lines
    "Step 120 | lr: 1.0e-05 | global_batch_size: 128 | reduced_train_loss: 1.2134 | train_step_timing in s: 1.93 | "
    "consumed_samples: 15360 | TFLOPs/GPU: 398.2",
    # argument and config dumps (the words of every offload key, all of them switched off)
    "------------------------ arguments ------------------------\n"
    "  optimizer_cpu_offload ........................... False\n"
    "  optimizer_offload_fraction ...................... 1.0\n"
    "  overlap_cpu_optimizer_d2h_h2d ................... False\n"
    "  cpu_offloading_num_layers ....................... 0\n"
    "  recompute_granularity ........................... None\n"
    "  pin_cpu_grads ................................... True\n"
    "  load ............................................ /ckpt\n"
    "  finetune ........................................ True",
    "optimizer:\n  optimizer_cpu_offload: false\n  optimizer_offload_fraction: 0.0\n  pin_cpu_grads: true\n"
    "dataset:\n  pin_memory: true\n  num_workers: 8\ncheckpoint:\n  save: /ckpt\n  load: /ckpt\n"
    "  pretrained_checkpoint: /models/llama3-8b\n  finetune: true\n  load_optim: false",
    "INFO:megatron.core.optimizer:Setting up optimizer with config OptimizerConfig(optimizer='adam', lr=0.0003, "
    "optimizer_cpu_offload=False, optimizer_offload_fraction=0.0, pin_cpu_grads=True)",
    # fine-tuning loss reports, in prose
    "Fine-tuning loss went from 1.9 to 1.21 over 2000 steps, validation loss 1.35",
    "SFT run finished: final train loss 0.87, throughput 420 TFLOP/s per GPU, no errors",
    "The loss curve looks healthy, step time 1.9 s as expected",
    "fine-tune loss no longer decreases after 1000 steps",
    "the loss converges slower than in pretraining, which is expected with a lower LR",
    "lm loss 2.1 at iteration 400, it converges slower than pretraining",
    "training loss decreases slowly but steadily during fine-tuning",
    "validation perplexity improved from 9.1 to 6.4 after the SFT epoch",
    "fine-tuning with optimizer offload at fraction 0.5: loss 1.32 at step 800, step time 2.1 s, memory 61 GiB",
    "After resuming from the checkpoint the loss continued at 1.21, exactly where it left off",
    "Fine-tuning Llama 3 8B with offload: loss 1.9 at step 1, 1.7 at step 2, 1.5 at step 50",
]


@pytest.mark.parametrize("text", NOT_A_FAILURE, ids=lambda t: t.strip()[:40])
def test_a_healthy_runs_lines_match_no_failure(text: str) -> None:
    assert diagnose(log=text).matches == []


@pytest.mark.parametrize("text", NOT_A_FAILURE, ids=lambda t: t.strip()[:40])
def test_a_healthy_runs_lines_match_no_failure_with_an_offloading_config_either(tmp_path: Path, text: str) -> None:
    path = tmp_path / "run.yaml"  # both offloads on: no reading is excluded by the config, only the text decides
    path.write_text(
        "model:\n  num_layers: 8\n  cpu_offloading: true\n  cpu_offloading_num_layers: 2\n"
        "optimizer:\n  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 0.5\n",
        encoding="utf-8",
    )
    loaded = load(str(path))
    assert diagnose(log=text, config=loaded.config, raw=loaded.raw).matches == []


# ---------------------------------------------------------------------------------------------- stated settings


def test_the_argument_dump_states_its_offload_settings() -> None:
    said = stated("  optimizer_cpu_offload ........ True\n  optimizer_offload_fraction ..... 0.25\nCUDA out of memory")
    assert (said.optimizer, said.fraction, said.activation) == (True, 0.25, None)
    assert said.line("optimizer_offload_fraction") == "optimizer_offload_fraction ..... 0.25"


def test_megatron_lm_flags_state_their_settings() -> None:
    said = stated("torchrun pretrain_gpt.py --optimizer-cpu-offload --optimizer-offload-fraction 0.5")
    assert (said.optimizer, said.fraction) == (True, 0.5)
    assert stated("--cpu-offloading-num-layers 4").activation is True


def test_a_longer_name_that_ends_in_a_setting_is_not_that_setting() -> None:
    said = stated("use_torch_optimizer_for_cpu_offload: true\nskip_megatron_wrapping=True with optimizer_cpu_offload")
    assert (said.optimizer, said.activation) == (None, None)


def test_a_traceback_frame_names_code_not_an_offload() -> None:
    text = (
        '[rank3]:   File "/opt/megatron-lm/megatron/core/optimizer/optimizer.py", line 477, in step\n'
        "[rank3]:     self.optimizer.step()\n"
        f"[rank3]: {OOM}"
    )
    assert [m.failure for m in diagnose(log=text).matches] == ["oom_unattributed"]


# ---------------------------------------------------------------------------------------------- which offload was on


ARGS_OFF = (
    "  optimizer_cpu_offload ........ False\n  optimizer_offload_fraction ..... 1.0\n"
    "  cpu_offloading_num_layers ...... 0\n"
)


@pytest.mark.parametrize(
    ("log", "reading", "ruled"),
    [
        (ARGS_OFF, "oom_no_offload", {"oom_activation_offload", "oom_partial_optimizer_offload"}),
        (ARGS_OFF.replace("False", "True"), "oom_full_optimizer_offload", {"oom_no_offload"}),
        (ARGS_OFF.replace("1.0", "0.25").replace("False", "True"), "oom_partial_optimizer_offload", set()),
        (ARGS_OFF.replace("...... 0", "...... 4"), "oom_activation_offload", {"oom_no_offload"}),
        (
            "optimizer:\n  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 0.5\n",
            "oom_partial_optimizer_offload",
            set(),
        ),
        (
            "optimizer:\n  optimizer_cpu_offload: true  # on\n  optimizer_offload_fraction: 0.5  # half\n",
            "oom_partial_optimizer_offload",
            set(),
        ),
        ('{"optimizer_cpu_offload": false, "cpu_offloading": false}\n', "oom_no_offload", set()),
        (
            "cfg: {'optimizer_cpu_offload': True, 'optimizer_offload_fraction': 1.0}\n",
            "oom_full_optimizer_offload",
            set(),
        ),
    ],
    ids=["all-off", "full", "partial", "activation", "bridge-yaml", "yaml-comments", "json", "dict-repr"],
)
def test_the_settings_a_log_states_decide_the_oom_reading(log: str, reading: str, ruled: set[str]) -> None:
    report = diagnose(log=log + OOM)
    assert [m.failure for m in report.matches] == [reading]
    assert ruled <= {r.failure for r in report.ruled_out}
    assert report.matches[0].fix == []  # no config: the reading is known, the size is not guessed


@pytest.mark.parametrize(
    "log",
    [
        "> building optimizer ...\n> learning rate decay style: cosine\n",
        "INFO:megatron.core.optimizer:Setting up optimizer with config OptimizerConfig(optimizer='adam', "
        "optimizer_cpu_offload=False, optimizer_offload_fraction=0.0)\n",
        "Theoretical memory footprints: weight and optimizer=45812.34 MB, activation=30211.21 MB\n",
        "[rank0]: the activations of layer 3 are large\n",
    ],
    ids=["mentions-optimizer", "states-optimizer-off", "memory-footprint", "mentions-activations"],
)
def test_a_log_that_only_mentions_offload_words_leaves_a_bare_oom_unattributed(log: str) -> None:
    report = diagnose(log=log + OOM)
    assert [m.failure for m in report.matches] == ["oom_unattributed"]
    assert report.matches[0].fix == [] and any("config" in n for n in report.needs)
