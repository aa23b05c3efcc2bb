"""Failure modes about memory and speed: GPU out of memory (read by which offload is on), offload that saves nothing
or costs too much time, and host memory (pinned buffers, the node's RAM).

Data for :mod:`mbridge_offload.actions.diagnose.diagnose` (the catalogue in ``catalogue.py`` lists every family).
"""

from __future__ import annotations

from mbridge_offload.actions.diagnose import conditions as fc
from mbridge_offload.actions.diagnose.failures.base import OOM_PATTERNS, FailureMode, fix_slowdown

MEMORY: tuple[FailureMode, ...] = (
    # --- failures with no single message
    FailureMode(
        "oom_activation_offload",
        "OOM with activation offloading",
        OOM_PATTERNS,
        "activation offload requires PP=1, so every GPU holds all layers' weights, gradients and optimizer states; "
        "for large (30B+, MoE) models these alone exceed the GPU (Qwen3-30B-A3B: 70.3 GiB allocated at PP=1 on an "
        "80 GB H100)",
        "compare torch.cuda.max_memory_allocated() with the GPU size; run `mbridge-offload estimate` with this config",
        (),  # sized by the planner (actions/diagnose/sizing.py): a generic fraction can leave the run over budget
        ("optimizer offload and recompute also work with PP > 1 (model.pipeline_model_parallel_size)",),
        rules_out=fc.rules_out_oom_activation,
        without_config=False,
    ),
    FailureMode(
        "oom_partial_optimizer_offload",
        "OOM at partial optimizer offload",
        OOM_PATTERNS,
        "optimizer.optimizer_offload_fraction is below 1.0 and the GPU-resident share of the Adam states is still "
        "too large (each 25 % moved saved ~3.8 GiB on Qwen3-30B-A3B)",
        "compare the peak memory with the fraction; `mbridge-offload estimate --optimizer-offload-fraction F` for "
        "a few fractions",
        (),  # sized by the planner
        ("or add pipeline parallelism (model.pipeline_model_parallel_size)",),
        rules_out=fc.rules_out_oom_partial,
        without_config=False,
    ),
    FailureMode(
        "oom_full_optimizer_offload",
        "OOM with all optimizer states offloaded",
        OOM_PATTERNS,
        "with optimizer_offload_fraction=1.0 the remaining GPU memory is weights, gradients and activations; more "
        "optimizer offload cannot help",
        "look at the allocator snapshot or `mbridge-offload estimate`: activations and weights dominate",
        (),  # sized by the planner
        ("recompute, more tensor/pipeline parallelism or a smaller train.micro_batch_size",),
        rules_out=fc.rules_out_oom_full,
        without_config=False,
    ),
    FailureMode(
        "oom_no_offload",
        "OOM without offloading",
        OOM_PATTERNS,
        "nothing is offloaded yet; where the memory goes (activations, optimizer states, weights) decides the lever",
        "`mbridge-offload recommend CONFIG` predicts the memory before/after",
        (),  # sized by the planner
        ("recompute, optimizer or activation offload, or more parallelism: the planner ranks them",),
        rules_out=fc.rules_out_oom_none,
        without_config=False,
    ),
    FailureMode(
        "slowdown",
        "Step time much slower with offloading",
        (),  # no upstream message: the caller names it (symptom slowdown)
        "the CPU Adam step dominates: the penalty is roughly linear in optimizer_offload_fraction (1.9x at 25 %, "
        "4.2x at 100 % on Qwen3-30B-A3B); D2H/H2D overlap wins only ~7 % back",
        "compare step times at two fractions; profile the optimizer step (CPU time vs copies)",
        fix_slowdown,
        ("more CPU cores per GPU (OMP_NUM_THREADS) speed the CPU step up",),
        rules_out=fc.rules_out_slowdown,
        explain=fc.explain_slowdown,
    ),
    FailureMode(
        "no_saving",
        "Optimizer offload saves no memory",
        (),  # no upstream message: the caller names it (symptom no_saving)
        "optimizer.optimizer_cpu_offload is off, or on with optimizer_offload_fraction 0.0 (Bridge's default): the "
        "HybridDeviceOptimizer then keeps every state on the GPU",
        "check optimizer.optimizer_cpu_offload and optimizer.optimizer_offload_fraction in the effective config "
        "(`mbridge-offload validate`)",
        lambda cfg, _m: fc.fix_no_saving(cfg),
        rules_out=fc.rules_out_no_saving,
        explain=fc.explain_no_saving,
    ),
    FailureMode(
        "pinned_memory",
        "Pinned host memory could not be allocated",
        # The CUDA runtime's and PyTorch's errors when pinning fails: on an error line, never a setting's name
        # in a config dump (``pin_memory: true``).
        (
            r"(?:Error|error)\b[^\n]{0,300}(?:cudaHostAlloc|cudaHostRegister|cudaErrorInvalidValue|pin_memory|"
            r"page-locked|RLIMIT_MEMLOCK|memlock)",
            r"cannot (?:allocate|register) (?:pinned|page-locked)",
        ),
        "offloaded optimizer states, CPU grads and activation buffers are pinned (page-locked); the container's "
        "memlock limit or the host RAM is too small for them",
        "`ulimit -l` inside the container (should be unlimited); `free -g` during the run",
        lambda cfg, _m: fc.fix_pinned(cfg),
        ("or run the container with --ulimit memlock=-1, or lower optimizer_offload_fraction",),
        ("verl-project/verl#6690",),
    ),
    FailureMode(
        "host_oom",
        "The host ran out of memory",
        # The kernel's, the C library's and the launcher's words for it (dmesg, errno 12, the shell, torchrun).
        (
            r"Cannot allocate memory",
            r"oom-kill",
            r"Out of memory: Killed process",
            r"(?m)^\s*Killed\s*$",
            r"Signal 9 \(SIGKILL\) received",
        ),
        "offloaded state lives in host RAM (~16 bytes per offloaded parameter, pinned) shared by all GPUs of the node",
        "`dmesg | grep -i oom` on the node; `mbridge-offload estimate` reports host_gb",
        fix_slowdown,
        ("give the job more host memory or fewer GPUs per node",),
    ),
)


# A GPU OOM that neither the text nor a config attributes to a mechanism: no fix is guessed (advising to switch off
# something nobody said was on would mislead); the report asks for what tells the readings apart.
OOM_UNATTRIBUTED = FailureMode(
    "oom_unattributed",
    "GPU out of memory (which offload is on is not known yet)",
    OOM_PATTERNS,
    "the text shows a GPU out-of-memory error, but neither it nor a config says whether activation offloading, "
    "optimizer offloading (and at which fraction) or nothing is offloaded; each has a different fix",
    "pass the run's config (`--config FILE`; MCP: config) or the log lines that show the offload settings: diagnose "
    "then tells the activation-offload, partial/full optimizer-offload and no-offload readings apart",
    (),
    (
        "`mbridge-offload estimate CONFIG` shows where the per-GPU memory goes; `mbridge-offload recommend CONFIG` "
        "picks the smallest offload that fits",
    ),
    needs=(
        "the failing run's config (--config FILE, MCP config): which offloads are on decides the reading and the fix",
        "the log around the OOM (--log FILE): the allocation that failed and the step it happened at",
    ),
)
