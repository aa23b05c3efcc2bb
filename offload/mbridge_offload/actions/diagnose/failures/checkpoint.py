"""Failure modes of saving and resuming with optimizer offload: state on the wrong device, the checkpoint's common
state, stale master weights, and a loss that jumps after a resume.

Data for :mod:`mbridge_offload.actions.diagnose.diagnose` (the catalogue in ``catalogue.py`` lists every family).
"""

from __future__ import annotations

from mbridge_offload.actions.diagnose import conditions as fc
from mbridge_offload.actions.diagnose.failures.base import FailureMode

CHECKPOINT: tuple[FailureMode, ...] = (
    FailureMode(
        "optimizer_state_device_mismatch",
        "Optimizer state on mixed devices/dtypes after resume",
        (r"Tensors of the same index must be on the same device and the same dtype",),
        "after the checkpoint load some Adam state tensors (exp_avg, exp_avg_sq) are not on the device or dtype of "
        "the parameter their sub-optimizer steps (e.g. GPU state for a CPU copy at optimizer_offload_fraction=1.0); "
        "torch's foreach/fused Adam groups tensors by device and dtype and refuses the mix",
        "after load, print {k: (v.device, v.dtype)} of each optimizer.state entry next to its parameter's; the "
        "traceback ends in torch/utils/_foreach_utils.py _group_tensors_by_device_and_dtype",
        (),
        (
            "upgrade megatron-core / Megatron Bridge (the HDO's load hooks move each state to its sub-optimizer's "
            "device), or resume with this project's HybridDeviceOptimizer, whose load_state_dict places every "
            "state with its sub-optimizer",
            "workaround that loses the Adam moments (they restart from zero): resume the weights only with "
            "checkpoint.load_optim=false",
        ),
        ("NVIDIA-NeMo/Speech#14574",),
        rules_out=fc.rules_out_save_assert,
    ),
    FailureMode(
        "common_state_differs",
        "Common state dict differs across ranks",
        (r"There is difference in the common state dict in different ranks",),
        "with optimizer_cpu_offload the HybridDeviceOptimizer's per-parameter state (optimizer param_state keys) "
        "lands in the checkpoint's common (replicated) part, which each rank fills differently; the save warns "
        "and the resume from that checkpoint fails",
        "the warning lists ('optimizer', 0, 'param_state', ...) keys; it does not appear with "
        "optimizer_cpu_offload=false",
        ("optimizer.use_distributed_optimizer=true", "ddp.use_distributed_optimizer=true"),
        (
            "the distributed optimizer saves the HDO's state sharded (fully_reshardable / dp_reshardable) instead "
            "of in the common dict; or resume the weights only (checkpoint.load_optim=false)",
        ),
        ("NVIDIA-NeMo/Speech#14243",),
        rules_out=fc.rules_out_save_assert,
    ),
    FailureMode(
        "finetune_stale_masters",
        "Fine-tune: loss right at step 1, random at step 2",
        (r"sync_hybrid_device_optimizer_fp32_master_copies",),  # else named (symptom finetune_stale_masters)
        "the HybridDeviceOptimizer's CPU and fp32 copies of the weights are made when the optimizer is built, "
        "before the pretrained checkpoint is loaded into the model; the load (model only) refreshes the distributed "
        "optimizer's own fp32 shards but not these copies, so the first step runs Adam on random-init weights and "
        "writes them back: step 1's loss is right, step 2's is that of a random model (optimizer_cpu_offload + "
        "distributed optimizer + bf16/fp16 + model-only load)",
        "log the loss of steps 1-3: right, then ~ln(vocab size) (about 10-12); it does not happen with "
        "optimizer.optimizer_cpu_offload=false",
        (),
        (
            "upgrade Megatron Bridge (PR #4082: sync_hybrid_device_optimizer_fp32_master_copies after checkpoint "
            "load; Megatron Bridge 0.6.2 has it); the megatron-core fix is Megatron-LM PR #5071 (open); NeMo-RL has "
            "the same fix (PR #2372)",
            "until then: call the same sync after loading, or turn optimizer offload off for the fine-tune "
            "(optimizer.optimizer_cpu_offload=false); with this project's HybridDeviceOptimizer call "
            "refresh_from_model() after a model-only load",
            "checkpoint.load_optim=false does not help: a fine-tune start loads no optimizer state",
        ),
        ("NVIDIA-NeMo/Megatron-Bridge#3949", "NVIDIA-NeMo/Megatron-Bridge#4082", "NVIDIA-NeMo/RL#2371"),
        rules_out=lambda cfg: fc.rules_out_save_assert(cfg),
        explain=fc.explain_stale_masters,
        supersedes=(
            (
                "resume_loss_jump",
                "a fine-tune start loads no optimizer state, so resuming without it (checkpoint.load_optim=false) "
                "tells nothing; the stale copies are the HybridDeviceOptimizer's (finetune_stale_masters)",
            ),
        ),
    ),
    FailureMode(
        "resume_loss_jump",
        "Loss jumps after resuming from a checkpoint",
        (),  # no upstream message: the caller names it (symptom resume_loss_jump)
        "resuming a run (model and optimizer state), the HybridDeviceOptimizer's fp32 masters or its Adam step "
        "counter were not restored: precision-aware + offload resume (Megatron-LM#1842), stale 'step' in "
        "DP-reshardable loads (SkyRL#1401, Megatron-LM PR #5929)",
        "a check that tells the causes apart, not a fix: resume once from the same checkpoint, optimizer state "
        "included, with optimizer.optimizer_cpu_offload=false (megatron-core's distributed optimizer saves exp_avg, "
        "exp_avg_sq and the fp32 masters per parameter in the same layout with or without the "
        "HybridDeviceOptimizer, so the GPU optimizer reads the same state; if it does not fit, check at a smaller "
        "micro-batch or on more GPUs: a jump from 0.3 to 10 survives that). The jump goes away: the "
        "HybridDeviceOptimizer's restore is at fault (its fp32 masters or Adam step not pushed to its "
        "sub-optimizers). The jump stays: the saved state or its reading is, whatever the optimizer (a checkpoint "
        "written in another format or parallel layout than the resume reads, or a cause outside the optimizer: data "
        "order, LR schedule). Resuming with checkpoint.load_optim=false tells neither apart: it throws the state "
        "away, so both jumps go",
        (),
        (
            "upgrade Megatron Bridge to >= 0.6.2: PR #4082 (Megatron-Bridge#3949) calls "
            "sync_hybrid_device_optimizer_fp32_master_copies after every checkpoint load, refreshing the "
            "HybridDeviceOptimizer's CPU copies and fp32 masters from the loaded weights",
            "upgrade megatron-core past Megatron-LM PR #5929 (main; Megatron-LM PR #6124 on dev): it restores the "
            "Adam 'step' in DP-reshardable loads and the fp32 masters of native-fp32 parameters (megatron-core 0.16.1 "
            "and 0.19.2 both predate it: their DP-reshardable load skips 'step', and _update_fp32_params_by_new_state "
            "looks up every parameter's fp32 copy)",
            "or use this project's HybridDeviceOptimizer (install_optimizer_offload): its load_state_dict refreshes "
            "the host copies and masters from the loaded weights, then restores the saved masters and each "
            "parameter's step (resume is bit-exact: tests/runtime/test_optimizer_resume.py)",
        ),
        ("NVIDIA/Megatron-LM#1842", "NVIDIA-NeMo/Megatron-Bridge#4082", "NovaSky-AI/SkyRL#1401"),
        rules_out=fc.rules_out_resume_jump,
        confirm_with=("optimizer.optimizer_cpu_offload=false",),
    ),
    FailureMode(
        "checkpoint_save_assert",
        "AssertionError saving a checkpoint with optimizer offload",
        (
            r"gbuf_local_end - gbuf_local_start",
            r"AssertionError[\s\S]{0,300}(?:save_checkpoint|distrib_optimizer\.py)",
            r"(?:save_checkpoint|distrib_optimizer\.py)[\s\S]{0,600}AssertionError",
        ),
        "torch AdamW's 0-dim 'step' tensor went through the per-bucket shape assertion of the distributed "
        "optimizer's save path (fixed in megatron-core 0.18.0, Megatron-LM PR #2874)",
        "the traceback ends in distrib_optimizer.py's state save; check `pip show megatron-core` (< 0.18.0)",
        (),
        (
            "upgrade to megatron-core >= 0.18.0 / Megatron Bridge >= 0.5.0 (Megatron-LM PR #2874)",
            "workaround until then, which writes checkpoints without the optimizer state (a resume restarts the "
            "Adam moments): checkpoint.save_optim=false",
        ),
        ("NVIDIA-NeMo/Megatron-Bridge#1942", "NVIDIA/Megatron-LM#1872"),
        rules_out=fc.rules_out_save_assert,
    ),
    FailureMode(
        "weights_only_load",
        "torch.load(weights_only=True) rejects the optimizer checkpoint",
        (r"Weights only load failed", r"WeightsUnpickler error", r"Unsupported global: GLOBAL torch\.optim"),
        "PyTorch >= 2.6 loads with weights_only=True by default, and the HybridDeviceOptimizer's param groups "
        "carry the optimizer classes (cpu_optimizer_cls/gpu_optimizer_cls) as pickled objects",
        "the error names a GLOBAL like torch.optim.adamw.AdamW",
        (),
        (
            "for a checkpoint you trust: torch.serialization.add_safe_globals([torch.optim.AdamW, torch.optim.SGD]) "
            "before loading, or torch.load(..., weights_only=False)",
        ),
        ("NovaSky-AI/SkyRL#1401",),
    ),
    FailureMode(
        "fp32_master_keyerror",
        "KeyError restoring fp32 masters",
        (r"_update_fp32_params_by_new_state",),
        "native-fp32 parameters have no separate fp32 master, and older megatron-core looked them up anyway "
        "(fixed by Megatron-LM PR #5929)",
        "the traceback ends in hybrid_optimizer.py _update_fp32_params_by_new_state with a KeyError",
        (),
        ("upgrade megatron-core past PR #5929",),
        ("NovaSky-AI/SkyRL#1401",),
    ),
    FailureMode(
        "fsdp_save_hang",
        "Checkpoint save hangs with Megatron-FSDP and optimizer offload",
        (),  # a hang prints nothing of its own: the caller names it (symptom fsdp_save_hang)
        "Megatron-FSDP's optimizer checkpoint save with optimizer_cpu_offload=True can hang (Megatron-LM#4910)",
        "the hang is in the optimizer state save: py-spy dump shows the ranks in the optimizer checkpoint save, "
        "and one save with checkpoint.save_optim=false completes",
        (
            "ddp.use_megatron_fsdp=false",
            "ddp.use_distributed_optimizer=true",
            "optimizer.use_distributed_optimizer=true",
        ),
        (
            "the distributed optimizer saves the offloaded state without the hang; Megatron-LM PR #4623 fixed the "
            "small reproducer (a full Qwen3.5-35B-A3B still hung)",
            "workaround that writes checkpoints without the optimizer state: checkpoint.save_optim=false",
        ),
        ("NVIDIA/Megatron-LM#4910",),
        rules_out=fc.rules_out_fsdp,
        confirm_with=("checkpoint.save_optim=false",),
    ),
    FailureMode(
        "stale_grad_reapplied",
        "Grad-less parameter updated with a stale gradient",
        (r"_set_sub_optimizer_grads",),  # a traceback frame; else named (symptom stale_grad_reapplied)
        "megatron-core's HybridDeviceOptimizer keeps each inner parameter's .grad from the last step; when the "
        "model parameter has no gradient it only sets requires_grad=False, and torch's Adam skips a parameter only "
        "when .grad is None, so the previous step's gradient is applied again (MoE experts that got no tokens, "
        "unused or conditional branches)",
        "compare a parameter whose .grad is None in a step before and after optimizer.step(): it must not change",
        (),
        (
            "upgrade megatron-core past Megatron-LM PR #7551 (open, 2026-09; also PR #6871), which clears the cached "
            "grads; this project's HybridDeviceOptimizer already skips parameters without a gradient "
            "(install_optimizer_offload; tests/runtime/test_optimizer_stale_grad.py is the regression test)",
            "or turn optimizer offload off (optimizer.optimizer_cpu_offload=false)",
        ),
        ("NVIDIA/Megatron-LM#7551", "NVIDIA/Megatron-LM#6871"),
        rules_out=fc.rules_out_save_assert,
        explain=fc.explain_stale_grad,
    ),
)
