"""Failure modes of optimizer offloading (the HybridDeviceOptimizer): the settings megatron-core, Megatron-LM and
Megatron-FSDP refuse, and what goes wrong in its step.

Data for :mod:`mbridge_offload.actions.diagnose.diagnose` (the catalogue in ``catalogue.py`` lists every family).
"""

from __future__ import annotations

from mbridge_offload.actions.diagnose import conditions as fc
from mbridge_offload.actions.diagnose.failures.base import FailureMode, mlm_actions

OPTIMIZER: tuple[FailureMode, ...] = (
    FailureMode(
        "decoupled_weight_decay",
        "Optimizer offload needs AdamW mode",
        (r"CPU offloading only supported with decoupled_weight_decay enabled",),
        "optimizer.optimizer_cpu_offload with decoupled_weight_decay=false; the CPU optimizer is torch AdamW",
        "check optimizer.decoupled_weight_decay",
        ("optimizer.decoupled_weight_decay=true",),
    ),
    FailureMode(
        "precision_aware_required",
        "Megatron-LM optimizer offload needs the precision-aware optimizer",
        (r"optimizer cpu offload must be used in conjunction with `?--use-precision-aware-optimizer",),
        "Megatron-LM's validate_args requires --use-precision-aware-optimizer with --optimizer-cpu-offload",
        "check the launch flags for --use-precision-aware-optimizer",
        ("optimizer.use_precision_aware_optimizer=true",),
        ("on the Megatron-LM command line add --use-precision-aware-optimizer",),
    ),
    FailureMode(
        "mlm_validate_args",
        "Megatron-LM's argument check rejects the offload flags",
        (),
        "Megatron-LM's validate_args (megatron/training/arguments.py) asserts on offload flag combinations that "
        "megatron-core's own configs accept: --optimizer-cpu-offload needs --use-precision-aware-optimizer, with "
        "--fp8-param-gather also --fp8-recipe delayed, and --fine-grained-activation-offloading needs "
        "--transformer-impl transformer_engine",
        'run `mbridge-offload validate --megatron-args "<the launch flags>"` (it applies these checks and answers '
        "with the flag to add), or read the AssertionError line just above the validate_args frame",
        (),  # the AssertionError's text names the check: it is matched to its rule (OPT-MLM-*, ACT-MLM-*)
        mlm_actions(),
        needs=(
            'the Megatron-LM command line (`mbridge-offload validate --megatron-args "..."`, MCP validate_config '
            "megatron_args) or the AssertionError text: it names the one check that failed",
        ),
    ),
    FailureMode(
        "mfsdp_v2",
        "Megatron-FSDP v2 does not support optimizer offload",
        (r"MFSDP v2 does not (currently )?support optimizer CPU offload",),
        "optimizer.optimizer_cpu_offload with Megatron-FSDP v2",
        "check ddp.use_megatron_fsdp and the FSDP version",
        ("optimizer.optimizer_cpu_offload=false",),
        ("or use the distributed optimizer instead of Megatron-FSDP v2 (ddp.use_megatron_fsdp=false)",),
    ),
    FailureMode(
        "skip_megatron_wrapping",
        "skip_megatron_wrapping with optimizer offload",
        (r"skip_megatron_wrapping=True is incompatible with optimizer_cpu_offload",),
        "get_megatron_optimizer(skip_megatron_wrapping=True) cannot wrap the HybridDeviceOptimizer",
        "look for skip_megatron_wrapping=True where your code builds the optimizer",
        ("optimizer.optimizer_cpu_offload=false",),
        ("or keep offloading and call get_megatron_optimizer without skip_megatron_wrapping=True",),
    ),
    FailureMode(
        "mfsdp_offload_pin_memory",
        "Megatron-FSDP + optimizer offload fails in pin_memory",
        (
            r"Megatron FSDP does not work with CPU_OFFLOADING",
            r"(?:megatron_fsdp|fully_shard|DTensor|_dtensor).{0,600}pin_memory",
            r"pin_memory.{0,600}(?:megatron_fsdp|DTensor|_dtensor)",
        ),
        "the HybridDeviceOptimizer clones every parameter to the CPU and pins the clone when the optimizer is "
        "built (get_megatron_optimizer); under Megatron-FSDP the parameters are sharded DTensors (EP shards "
        "included) and pin_memory goes through DTensor dispatch, which fails",
        "the traceback runs setup_model_and_optimizer -> get_megatron_optimizer -> hybrid_optimizer and ends in "
        "pin_memory with DTensor frames; ddp.use_megatron_fsdp is true",
        (
            "ddp.use_megatron_fsdp=false",
            "ddp.use_distributed_optimizer=true",
            "optimizer.use_distributed_optimizer=true",
        ),
        (
            "the distributed optimizer works with optimizer offload; Megatron-LM PR #4623 (open) makes the HDO "
            "use the FSDP local shards",
        ),
        ("NVIDIA/Megatron-LM#1986", "NVIDIA/Megatron-LM#4623"),
        rules_out=fc.rules_out_fsdp,
    ),
    FailureMode(
        "fused_adam_cpu_tensors",
        "GPU-only fused Adam on CPU tensors (NaN, no error)",
        # A NaN raises nothing; the frames and class names of a traceback or repr that show a fused Adam on CPU
        # tensors do. Else the caller names it (symptom fused_adam_cpu_tensors).
        (
            r"FusedAdam[^\n]{0,300}\bcpu",
            r"\bcpu[^\n]{0,300}FusedAdam",
            r"multi_tensor_apply[^\n]{0,200}\bcpu",
        ),
        "a GPU-only fused Adam (Transformer Engine's or Apex's FusedAdam) steps tensors that live on the CPU "
        "(CPU-offloaded optimizer states or parameters): it may raise nothing and write garbage, so exp_avg is "
        "poisoned and the loss turns NaN, often right after a resume",
        "check which optimizer class steps the host-resident tensors: print type(sub) for every sub-optimizer and "
        "the device of its parameters; it must be torch.optim.AdamW (CPU fused) for CPU tensors",
        ("optimizer.use_torch_optimizer_for_cpu_offload=true",),
        (
            "megatron-core's HDO uses torch.optim.AdamW for its CPU part; a GPU-only class passed as "
            "cpu_optimizer_cls (or FSDP2/DTensor cpu_offload with TE FusedAdam, NeMo-RL#3544) must be replaced "
            "by torch's Adam/AdamW, or offload turned off",
        ),
        ("NVIDIA-NeMo/RL#3544",),
        supersedes=(
            (
                "resume_loss_jump",
                "the NaN comes from a GPU-only fused Adam stepping host tensors (fused_adam_cpu_tensors), not from "
                "the state restore: checkpoint.load_optim=false only hides it until the moments are rebuilt",
            ),
            ("slowdown", "the text reports NaN values, not a longer step time"),
        ),
    ),
    FailureMode(
        "precision_dtypes_ignored",
        "Offload ignores precision-aware state dtypes",
        (),  # no upstream message: the caller names it (symptom precision_dtypes_ignored)
        "with optimizer_cpu_offload, megatron-core's factory builds the HybridDeviceOptimizer with "
        "param_update_in_fp32=True and never passes main_params_dtype / exp_avg_dtype / exp_avg_sq_dtype, and "
        "torch AdamW creates its moments like the fp32 master: all three states are fp32 whatever the config asks",
        "after one step, print {k: v.dtype for k, v in sub.state[p].items()} for a sub-optimizer of the HDO: "
        "fp32 although the config says bf16/fp16",
        (
            "optimizer.main_params_dtype=fp32",
            "optimizer.exp_avg_dtype=fp32",
            "optimizer.exp_avg_sq_dtype=fp32",
        ),
        (
            "the overrides make the config say what runs, so memory estimates (`mbridge-offload estimate`) count "
            "fp32 states on the host; lower-precision offloaded states need a megatron-core with the dtypes passed "
            "through (radixark/Megatron-LM PR #67; MCore dev branch commit bcc46a5f29)",
        ),
        ("radixark/Megatron-LM#67",),
        rules_out=fc.rules_out_precision_dtypes,
        explain=fc.explain_precision_dtypes,
    ),
)
