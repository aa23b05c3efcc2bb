"""How it is trained: the settings of one run (``Setup``: parallelism, batch, precision, recompute, offload) and
the checks megatron-core would make on them (``check_setup``). Never imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mbridge_offload.config.rules.base import TE_VERSION_ASSUMED
from mbridge_offload.plan.memory import fine_grained
from mbridge_offload.plan.model.architecture import MAMBA, ModelSpec


@dataclass(frozen=True)
class Setup:
    """Parallelism, batch, precision and offload settings of one run (Bridge recipe defaults)."""

    num_gpus: int = 8
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool | None = None  # None: on when TP > 1, as Bridge recipes set it
    seq_length: int | None = None
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    params_dtype: str = "bf16"
    grad_reduce_in_fp32: bool = True  # Bridge recipes set ddp.grad_reduce_in_fp32=True
    distributed_optimizer: bool = True
    precision_aware_optimizer: bool = False
    main_params_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    store_param_remainders: bool = True
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] = ("core_attn",)
    optimizer_offload_fraction: float = 0.0
    # Which HybridDeviceOptimizer runs with optimizer_cpu_offload: megatron-core's own (what Bridge builds) or ours
    # (after mbridge_offload_runtime.optimizer.install_optimizer_offload()). They keep different GPU tensors: see
    # plan/memory/stage.py optimizer_memory.
    hybrid_optimizer: str = "megatron-core"
    # train.manual_gc: Bridge recipes set it (recipes/common.py), and its training loop then runs gc.collect() before
    # the first step, which frees the factory's first HybridDeviceOptimizer (a reference cycle); without it that
    # optimizer's fp32 copies stay allocated until Python's cyclic collector happens to run.
    manual_gc: bool = True
    activation_offload_layers: int = 0
    # Fine-grained activation offloading (model.offload_modules; on when non-empty): see plan/memory/fine_grained.py.
    offload_modules: tuple[str, ...] = ()
    min_offloaded_tensor_size: int = 1024 * 1024
    activation_offload_fraction: float = 1.0
    # Memory PyTorch's allocator hands out beyond the model's tensors: cuBLAS/TE workspaces, DistOpt's
    # all-gather/reduce-scatter staging, loss temporaries. In "max allocated"; the CUDA context is not.
    overhead_gb: float = 2.0
    # Megatron-FSDP (ddp.use_megatron_fsdp, ddp.data_parallel_sharding_strategy, ddp.megatron_fsdp_*_dtype).
    use_megatron_fsdp: bool = False
    fsdp_sharding_strategy: str = "no_shard"
    fsdp_main_params_dtype: str | None = "fp32"
    fsdp_main_grads_dtype: str | None = None  # None: the parameter dtype
    # FP8 compute (mixed_precision / model.fp8_recipe) and FP8 parameters (fp8_param_gather).
    fp8_recipe: str | None = None
    fp8_param: bool = False
    # Uneven pipeline stages: first/last stage layer counts, or decoder layers per virtual stage (layout order).
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    pipeline_layout: tuple[int, ...] | None = None
    cross_entropy_loss_fusion: bool = False  # model.cross_entropy_loss_fusion
    cross_entropy_fusion_impl: str = "native"  # model.cross_entropy_fusion_impl: native | te
    # The Transformer Engine release of the run, where what TE allocates changed between releases (its fused cross
    # entropy, FusedAdam's step): the one validate assumes (the release Megatron Bridge 0.6.2 pins) unless a
    # caller knows the run's (the published rows give the release their Bridge revision locks).
    te_version: str = TE_VERSION_ASSUMED
    # Communication overlap (step-time model only): ddp.overlap_grad_reduce / ddp.overlap_param_gather, which
    # Bridge recipes switch on, and comm_overlap.tp_comm_overlap (TE userbuffers), which its performance recipes do.
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    tp_comm_overlap: bool = False
    # MoE step-time settings (plan/time/moe.py): model.moe_token_dispatcher_type (alltoall | allgather | flex, flex
    # being DeepEP or HybridEP), model.overlap_moe_expert_parallel_comm, model.moe_router_force_load_balancing,
    # model.moe_grouped_gemm (Bridge's MoE recipes set it), model.cuda_graph_impl (full_iteration removes the per-layer
    # host sync of dropless dispatch).
    moe_token_dispatcher_type: str = "alltoall"
    overlap_moe_expert_parallel_comm: bool = False
    moe_router_force_load_balancing: bool = False
    moe_grouped_gemm: bool = True
    cuda_graph_impl: str = "none"
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (env_vars): changes no tensor, only how the caching allocator
    # maps them; the planner's yardstick reads it (search/options.py), the memory model does not.
    expandable_segments: bool = False

    def te_release(self) -> tuple[int, int]:
        """The run's Transformer Engine release as (major, minor), from any spelling validate accepts (``2.9``,
        ``v2.10.0``, ``2.9.0+cu12``, ``2``)."""
        numbers = [int(n) for n in re.findall(r"\d+", re.split(r"[+\-]", self.te_version.strip().lstrip("v"))[0])]
        major, minor = [*numbers, 0, 0][:2]
        return major, minor

    def te_at_least(self, major: int, minor: int) -> bool:
        """Whether the run's Transformer Engine is release ``major.minor`` or later."""
        return self.te_release() >= (major, minor)

    def te_cross_entropy(self) -> bool:
        """Whether the loss is Transformer Engine's fused cross entropy (``cross_entropy_fusion_impl: te``)."""
        return self.cross_entropy_loss_fusion and self.cross_entropy_fusion_impl == "te"

    def resolved_etp(self, model: ModelSpec) -> int:
        if self.etp is not None:
            return self.etp
        return model.default_etp if model.default_etp is not None else self.tp

    @property
    def sp(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    @property
    def dp(self) -> int:
        return self.num_gpus // (self.tp * self.pp * self.cp)

    def expert_dp(self, model: ModelSpec) -> int:
        return self.num_gpus // (self.pp * self.ep * self.resolved_etp(model))

    def num_microbatches(self) -> int | None:
        if self.global_batch_size is None:
            return None
        return max(1, self.global_batch_size // (self.micro_batch_size * self.dp))


def check_setup(model: ModelSpec, setup: Setup) -> None:
    """Reject what Megatron would reject, with the key, the value and the fix.

    Raises:
        ValueError: one line naming the violated constraint.
    """
    s = setup
    for name, value in (
        ("num_gpus", s.num_gpus),
        ("tp", s.tp),
        ("pp", s.pp),
        ("cp", s.cp),
        ("ep", s.ep),
        ("micro_batch_size", s.micro_batch_size),
    ):
        if value < 1:
            raise ValueError(f"{name} is {value}: it must be at least 1")
    etp = s.resolved_etp(model)
    if s.num_gpus % (s.tp * s.pp * s.cp):
        raise ValueError(f"num_gpus {s.num_gpus} is not divisible by TP·PP·CP = {s.tp * s.pp * s.cp}")
    _check_model_config(model, s, etp)
    if model.num_layers < s.pp:
        raise ValueError(f"PP {s.pp} exceeds num_layers {model.num_layers}")
    _check_hybrid(model, s)
    if s.pipeline_layout is not None:
        _check_layout(model, s)
    elif s.vpp is not None and (s.vpp < 1 or s.pp == 1 or model.num_layers % (s.pp * s.vpp)):
        uneven = s.num_layers_in_first_pipeline_stage or s.num_layers_in_last_pipeline_stage
        if s.vpp < 1 or s.pp == 1 or not uneven:
            raise ValueError(
                f"VPP {s.vpp} needs PP > 1 and num_layers {model.num_layers} divisible by PP·VPP "
                "(or an uneven split: pipeline_model_parallel_layout, num_layers_in_first/last_pipeline_stage)"
            )
    _check_uneven_interleaving(s)
    _check_interleaved_microbatches(s)
    seq = s.seq_length or model.seq_length
    if seq % s.cp or (s.cp > 1 and seq % (2 * s.cp)):
        raise ValueError(f"seq_length {seq} must be divisible by 2·CP = {2 * s.cp}")
    if model.is_moe:
        if model.experts % s.ep:  # MoELayer's build-time assert (no TransformerConfig check, so not the catalogue's)
            raise ValueError(f"EP {s.ep} does not divide num_moe_experts {model.num_moe_experts}")
        if s.num_gpus % (s.pp * s.ep * etp):
            raise ValueError(f"num_gpus {s.num_gpus} is not divisible by PP·EP·ETP = {s.pp * s.ep * etp}")
    elif s.ep > 1:
        raise ValueError(f"EP {s.ep} given for dense model {model.name}: expert parallelism needs MoE layers")
    if not 0.0 <= s.optimizer_offload_fraction <= 1.0:
        raise ValueError(f"optimizer_offload_fraction is {s.optimizer_offload_fraction}: it must be in [0.0, 1.0]")
    _check_hdo_wrapper(s)
    fine_grained.check(s)
    if s.activation_offload_layers:
        _check_activation_offload(model, s)


def _check_uneven_interleaving(s: Setup) -> None:
    """megatron-core's ``get_transformer_layer_offset`` (``transformer/transformer_layer.py``, the same in 0.16.1 and
    0.19.2): with VPP and ``num_layers_in_first/last_pipeline_stage``, every rank after the first divides by the
    number of middle stages, so a pipeline whose stages are all first or last fails at model build
    (ZeroDivisionError, which the config classes do not check: validate reports it from the build)."""
    given = sum(n is not None for n in (s.num_layers_in_first_pipeline_stage, s.num_layers_in_last_pipeline_stage))
    if s.vpp is None or s.pipeline_layout is not None or not given or s.pp - given > 0:
        return
    raise ValueError(
        f"VPP {s.vpp} with num_layers_in_first_pipeline_stage and num_layers_in_last_pipeline_stage on PP {s.pp} "
        "leaves no middle stage: megatron-core divides by the middle stages' count when it places the layers and "
        "fails at model build (ZeroDivisionError); give one of the two, raise PP, drop VPP or give "
        "pipeline_model_parallel_layout"
    )


def hdo_fails_at_first_step(s: Setup) -> str | None:
    """Why megatron-core's HybridDeviceOptimizer cannot step this run's parameters, or None (the fraction aside).

    Under ``Float16OptimizerWithFloat16Params`` (16-bit params without the distributed optimizer) the wrapper swaps
    each parameter in the HDO's groups for its fp32 main copy after the HDO mapped them, and the HDO's first step
    looks the new ones up (``_sync_hdo_param_groups_to_sub_optimizers``: KeyError, 0.16.1 and 0.19.2;
    NVIDIA/Megatron-LM#4042, its fix NVIDIA/Megatron-LM#4046 not merged). The trace fails the same way; ours
    follows the swap."""
    if s.distributed_optimizer or s.hybrid_optimizer != "megatron-core" or s.params_dtype == "fp32":
        return None
    return (
        f"optimizer offload with {s.params_dtype} parameters and no distributed optimizer: megatron-core's "
        "HybridDeviceOptimizer fails at its first step (KeyError in _sync_hdo_param_groups_to_sub_optimizers: "
        "Float16OptimizerWithFloat16Params replaces the parameters it mapped; NVIDIA/Megatron-LM#4042); switch on "
        "the distributed optimizer (ddp.use_distributed_optimizer and optimizer.use_distributed_optimizer), or run "
        "our HybridDeviceOptimizer (hybrid_optimizer=ours: mbridge_offload_runtime.optimizer.install_optimizer_offload)"
    )


def _check_hdo_wrapper(s: Setup) -> None:
    why = hdo_fails_at_first_step(s) if s.optimizer_offload_fraction > 0 else None
    if why:
        raise ValueError(why)


def _check_interleaved_microbatches(s: Setup) -> None:
    """megatron-core's interleaved schedule (``pipeline_parallel/schedules.py``,
    ``forward_backward_pipelining_with_interleaving``, the same in 0.16.1 and 0.19.2) refuses a micro-batch group
    ``g`` (``microbatch_group_size_per_vp_stage``, PP when unset, as here) outside ``[PP, M]`` (ValueError) and a
    last group ``M mod g`` in ``(0, PP)`` (RuntimeError): with ``g = PP``, M must be a multiple of PP."""
    m = s.num_microbatches()
    if s.vpp is None or s.pp == 1 or m is None or (m >= s.pp and m % s.pp == 0):
        return
    raise ValueError(
        f"VPP {s.vpp} with {m} micro-batches per step: megatron-core's interleaved schedule needs a multiple of "
        f"PP {s.pp} (global_batch_size / (micro_batch_size · DP)); raise global_batch_size to a multiple of "
        f"{s.pp * s.micro_batch_size * s.dp}, or drop VPP"
    )


def _check_model_config(model: ModelSpec, s: Setup, etp: int) -> None:
    """megatron-core's ``TransformerConfig`` checks of the sizes and the parallelism, as the validator runs them
    (``config.validate.model_errors``, one home): e.g. 0.19 accepts a TP that is a multiple of the query groups."""
    from mbridge_offload.config.validate import model_errors

    values: dict[str, object] = {
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "tensor_model_parallel_size": s.tp,
        "pipeline_model_parallel_size": s.pp,
        "context_parallel_size": s.cp,
        "sequence_parallel": s.sp and s.tp > 1,  # Bridge leaves it off at TP 1
    }
    if model.mla is None:
        values["num_query_groups"] = model.num_query_groups
    if model.is_moe:
        values.update(
            num_moe_experts=model.experts,
            expert_model_parallel_size=s.ep,
            expert_tensor_parallel_size=etp,
            moe_router_topk=model.moe_router_topk,
        )
    errors = model_errors(values)
    if errors:
        raise ValueError("; ".join(f"{message} ({rule})" for rule, message in errors))


def _check_hybrid(model: ModelSpec, s: Setup) -> None:
    """megatron-core's hybrid-model checks: the pattern has one symbol per layer; the Mamba mixer asserts that TP
    divides its heads and groups."""
    if model.layer_pattern is None:
        return
    if len(model.layer_pattern) != model.num_layers:
        raise ValueError(
            f"hybrid_layer_pattern has {len(model.layer_pattern)} layers but num_layers is {model.num_layers}"
        )
    if model.mamba is not None and MAMBA in model.layer_pattern:
        if model.mamba.num_heads % s.tp:
            raise ValueError("nheads must be evenly divisble by tp_size")
        if model.mamba.num_groups % s.tp:
            raise ValueError("ngroups must be evenly divisible by tp_size")


def _check_activation_offload(model: ModelSpec, s: Setup) -> None:
    """The rule catalogue's activation-offload errors (config.rules.activation), raised as ValueError."""
    from mbridge_offload.config.validate import activation_offload_errors

    errors = activation_offload_errors(
        {
            "num_layers": model.num_layers,
            "cpu_offloading_num_layers": s.activation_offload_layers,
            "pipeline_model_parallel_size": s.pp,
            "recompute_granularity": s.recompute_granularity,
        }
    )
    if errors:
        raise ValueError("; ".join(f"{message} ({rule})" for rule, message in errors))


# ------------------------------------------------------------------------------------------- parameters


def _check_layout(m: ModelSpec, s: Setup) -> None:
    layout = s.pipeline_layout or ()
    if len(layout) % s.pp:
        raise ValueError(f"pipeline_model_parallel_layout has {len(layout)} stages: it must be divisible by PP {s.pp}")
    if sum(layout) != m.num_layers:
        raise ValueError(
            f"pipeline_model_parallel_layout places {sum(layout)} decoder layers but num_layers is {m.num_layers}"
        )
