"""The planner's inputs, declared once: type, bounds, default and help of each.

``PlanInputs`` is the single declaration. The CLI flags and the MCP tool parameters of every tool that takes planner
inputs are generated from its fields (``mbridge_offload_tools.interface``), so the three can never drift apart. Every
numeric input has bounds; NaN and infinity are refused, and the error names the input, the value and the bound.

Where a value comes from is part of the answer: ``resolve`` (``plan/inputs/resolve.py``) merges, in order, the
defaults, the model preset's recipe, a config (Bridge YAML/JSON or Megatron-LM argv) and the flags, and keeps the
source of each value so that every answer can list its assumptions. Never imports torch.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mbridge_offload.config.rules.base import TE_VERSION_ASSUMED
from mbridge_offload.plan.inputs.hardware import DEFAULT_MARGIN

# Upper bounds: far above any real run, low enough that the arithmetic stays exact and fast.
MAX_GPUS = 1_000_000
MAX_PARALLEL = 65_536
MAX_LAYERS = 1_024  # the deepest published models have ~200; the estimator walks every layer
MAX_EXPERTS = 1_024  # and every local expert (published MoEs: up to 512)
MAX_WIDTH = 1_000_000
MAX_SEQ = 100_000_000
MAX_BATCH = 100_000_000
# What recommend may change (``levers``), declared once: the planner's search (plan/search/levers.py), the CLI and MCP
# help and the generated references read this tuple. A new name is additive; an unknown one is bad input (exit 2).
LEVERS = (
    "recompute",
    "activation",
    "fine-grained",
    "optimizer",
    "cp",
    "tp",
    "mbs",
    "grad-reduce",
    "ce-fusion",
    "vpp",
    "expandable-segments",
)
DEFAULT_LEVERS = ("recompute", "activation", "fine-grained", "optimizer")

GROUPS = ("model", "parallel", "precision", "recompute", "offload", "hardware", "time", "decision", "measured")


_UNSET: Any = object()  # no fallback declared (``None`` is a value a fallback may have)


def _field(
    default: Any = None,
    *,
    group: str,
    help: str,
    key: str | None = None,
    effective: bool = False,
    fallback: Any = _UNSET,
    why: str = "megatron-core default",
    when: str | None = None,
    aliases: tuple[str, ...] = (),
    **bounds: Any,
) -> Any:
    """One planner input, declared once: a ``Field`` with everything else the tools need to know about it.

    Args:
        group: its section of --help (one of ``GROUPS``).
        key: the dotted config key it reads (Bridge ConfigContainer; Megatron-LM argv is mapped onto the same keys).
        effective: read from the effective config only (decided by several keys, e.g. the mixed_precision block),
            not swept or named as one key.
        fallback, why: the value used when neither flag, log, config nor preset gives one, and its source (listed
            as an assumption; megatron-core's default unless said).
        when: the fallback applies only when that feature is on (``fine_grained``, ``loss_fusion``).
        aliases: older CLI spellings still accepted.
    """
    extra: dict[str, Any] = {"group": group}
    if key is not None:
        extra["key"], extra["effective"] = key, effective
    if fallback is not _UNSET:
        extra["fallback"], extra["why"], extra["when"] = fallback, why, when
    if aliases:
        extra["aliases"] = list(aliases)
    return Field(default, description=help, json_schema_extra=extra, **bounds)


# One declarer per --help section (``GROUPS``): each field's group is the one it is declared with.
_model, _parallel, _precision, _recompute, _offload, _hardware, _time, _decision, _measured = (
    partial(_field, group=g) for g in GROUPS
)


# The parallel sizes: each at least 1, at most MAX_PARALLEL.
_size = partial(_parallel, ge=1, le=MAX_PARALLEL)


_MARGIN_WHY = (
    f"{DEFAULT_MARGIN:.0%} of the usable GPU memory a recommendation keeps free (an estimate's fits has no "
    "margin): what the tightest published NVIDIA layer-offload recipe keeps free by this model (Bridge 0.6.2 "
    "Llama 3 70B on 64 GB200, FP8-CS, 40 layers: 2.2 %), rounded down"
)


Dtype = Literal["bf16", "fp16", "fp32"]
StateDtype = Literal["bf16", "fp16", "fp32", "fp8"]
FsdpStrategy = Literal["no_shard", "optim", "optim_grads", "optim_grads_params"]
Fp8Recipe = Literal["none", "tensorwise", "delayed", "mxfp8", "blockwise"]


class PlanInputs(BaseModel):
    """Everything ``estimate`` and ``recommend`` read. ``None`` = not given here (a lower layer or the default)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, protected_namespaces=())

    # --- what is trained
    model: str | None = _model(help="model preset (its recipe's settings fill what is not given)")
    num_layers: int | None = _model(key="model.num_layers", help="transformer layers", ge=1, le=MAX_LAYERS)
    hidden_size: int | None = _model(key="model.hidden_size", help="hidden size", ge=1, le=MAX_WIDTH)
    ffn_hidden_size: int | None = _model(key="model.ffn_hidden_size", help="dense MLP width", ge=1, le=MAX_WIDTH)
    num_attention_heads: int | None = _model(
        key="model.num_attention_heads", help="attention heads", ge=1, le=MAX_WIDTH
    )
    num_query_groups: int | None = _model(
        key="model.num_query_groups", help="KV heads (GQA groups)", ge=1, le=MAX_WIDTH
    )
    kv_channels: int | None = _model(key="model.kv_channels", help="head dimension", ge=1, le=MAX_WIDTH)
    vocab_size: int | None = _model(key="model.vocab_size", help="vocabulary size", ge=1, le=MAX_SEQ)
    num_moe_experts: int | None = _model(key="model.num_moe_experts", help="routed experts (MoE)", ge=1, le=MAX_EXPERTS)
    moe_ffn_hidden_size: int | None = _model(
        key="model.moe_ffn_hidden_size", help="expert MLP width", ge=1, le=MAX_WIDTH
    )
    moe_router_topk: int | None = _model(key="model.moe_router_topk", help="experts per token", ge=1, le=MAX_EXPERTS)
    share_embeddings_and_output_weights: bool | None = _model(
        key="model.share_embeddings_and_output_weights",
        help="model.share_embeddings_and_output_weights: one matrix for the input embedding and the output layer "
        "(default: the config's, the preset's or the model family's; else the frontend's, listed as assumed)",
    )
    # --- parallelism and batch
    num_gpus: int | None = _parallel(help="GPUs in the job", ge=1, le=MAX_GPUS)
    tp: int | None = _size(fallback=1, key="model.tensor_model_parallel_size", help="tensor parallel size")
    pp: int | None = _size(fallback=1, key="model.pipeline_model_parallel_size", help="pipeline parallel size")
    vpp: int | None = _size(key="model.virtual_pipeline_model_parallel_size", help="virtual pipeline stages per rank")
    cp: int | None = _size(fallback=1, key="model.context_parallel_size", help="context parallel size")
    ep: int | None = _size(fallback=1, key="model.expert_model_parallel_size", help="expert parallel size")
    etp: int | None = _size(
        key="model.expert_tensor_parallel_size", help="expert tensor parallel size (megatron-core default: TP)"
    )
    sequence_parallel: bool | None = _parallel(
        key="model.sequence_parallel", help="sequence parallelism (default: on when TP > 1)"
    )
    seq_length: int | None = _parallel(key="model.seq_length", help="sequence length", ge=1, le=MAX_SEQ)
    micro_batch_size: int | None = _parallel(
        fallback=1,
        why="Bridge recipe default",
        key="train.micro_batch_size",
        help="micro-batch size",
        ge=1,
        le=MAX_BATCH,
    )
    global_batch_size: int | None = _parallel(
        key="train.global_batch_size", help="global batch size", ge=1, le=MAX_BATCH
    )
    num_layers_in_first_pipeline_stage: int | None = _parallel(
        key="model.num_layers_in_first_pipeline_stage",
        help="model.num_layers_in_first_pipeline_stage (uneven PP)",
        ge=1,
        le=MAX_LAYERS,
    )
    num_layers_in_last_pipeline_stage: int | None = _parallel(
        key="model.num_layers_in_last_pipeline_stage",
        help="model.num_layers_in_last_pipeline_stage (uneven PP)",
        ge=1,
        le=MAX_LAYERS,
    )
    pipeline_layout: str | None = _parallel(
        key="model.pipeline_model_parallel_layout",
        help="model.pipeline_model_parallel_layout, e.g. 'Et*4|(tttt|)*14tmL' (decides the layers of each stage)",
        max_length=4096,
    )
    use_megatron_fsdp: bool | None = _parallel(
        fallback=False,
        why="megatron-core default: DDP with the distributed optimizer",
        key="ddp.use_megatron_fsdp",
        help="ddp.use_megatron_fsdp (Megatron-FSDP)",
    )
    fsdp_sharding_strategy: FsdpStrategy | None = _parallel(
        fallback="no_shard",
        why="megatron-core default ddp.data_parallel_sharding_strategy",
        key="ddp.data_parallel_sharding_strategy",
        help="ddp.data_parallel_sharding_strategy under Megatron-FSDP",
    )
    # --- precision
    params_dtype: Dtype | None = _precision(
        fallback="bf16", why="Bridge recipes train in bf16", key="model.params_dtype", help="parameter dtype"
    )
    grad_reduce_in_fp32: bool | None = _precision(
        fallback=True,
        why="Bridge recipes set ddp.grad_reduce_in_fp32=True (megatron-core's default is False)",
        key="ddp.grad_reduce_in_fp32",
        help="ddp.grad_reduce_in_fp32 (fp32 grad buffers)",
    )
    distributed_optimizer: bool | None = _precision(
        fallback=True,
        why="Bridge recipes use the distributed optimizer",
        key="optimizer.use_distributed_optimizer",
        help="use_distributed_optimizer",
    )
    precision_aware_optimizer: bool | None = _precision(
        fallback=False, key="optimizer.use_precision_aware_optimizer", help="use_precision_aware_optimizer"
    )
    main_params_dtype: StateDtype | None = _precision(
        fallback="fp32", key="optimizer.main_params_dtype", help="precision-aware: master param dtype"
    )
    exp_avg_dtype: StateDtype | None = _precision(
        fallback="fp32", key="optimizer.exp_avg_dtype", help="precision-aware: exp_avg dtype"
    )
    exp_avg_sq_dtype: StateDtype | None = _precision(
        fallback="fp32", key="optimizer.exp_avg_sq_dtype", help="precision-aware: exp_avg_sq dtype"
    )
    fp8_recipe: Fp8Recipe | None = _precision(
        fallback="none",
        why="bf16 compute: no FP8 recipe given",
        key="model.fp8_recipe",
        effective=True,
        help="FP8 compute recipe (none = bf16; GEMM inputs saved in 1 byte otherwise)",
    )
    fp8_param: bool | None = _precision(
        fallback=False,
        why="megatron-core default fp8_param_gather=False",
        key="model.fp8_param",
        effective=True,
        help="fp8_param_gather: FP8 weights (1 byte per element)",
    )
    cross_entropy_loss_fusion: bool | None = _precision(
        fallback=False,
        why="megatron-core default: fp32 logits kept for the loss",
        key="model.cross_entropy_loss_fusion",
        help="model.cross_entropy_loss_fusion (fused cross-entropy kernel)",
    )
    cross_entropy_fusion_impl: Literal["native", "te"] | None = _precision(
        fallback="native",
        why="megatron-core default: its fused kernel still casts the logits to fp32",
        when="loss_fusion",
        key="model.cross_entropy_fusion_impl",
        help="model.cross_entropy_fusion_impl with the fusion on: native (still an fp32 copy of the logits) or te "
        "(Transformer Engine's kernel: in place on the bf16 logits before TE 2.18, an fp32 gradient from 2.18)",
    )
    te_version: str | None = _precision(
        fallback=TE_VERSION_ASSUMED,
        why="the Transformer Engine release Megatron Bridge 0.6.2 pins (what validate assumes)",
        help="Transformer Engine release of the run, e.g. 2.9 or 2.10.0 (validate's te_version): its fused cross "
        "entropy keeps an fp32 gradient of the logits from 2.18, and FusedAdam unscales two bf16 moments in its "
        "kernel from 2.13",
        max_length=64,
    )
    fsdp_main_grads_dtype: Dtype | None = _precision(
        key="ddp.megatron_fsdp_main_grads_dtype",
        help="ddp.megatron_fsdp_main_grads_dtype (default: the parameter dtype)",
    )
    # --- activation recompute
    recompute_granularity: Literal["none", "selective", "full"] | None = _recompute(
        fallback="none",
        why="megatron-core default: no activation recompute",
        key="model.recompute_granularity",
        help="model.recompute_granularity",
        aliases=("--recompute",),
    )
    recompute_method: Literal["uniform", "block"] | None = _recompute(
        key="model.recompute_method", help="full recompute method"
    )
    recompute_num_layers: int | None = _recompute(
        key="model.recompute_num_layers",
        help="layers per recompute group (uniform) or recomputed layers (block)",
        ge=1,
        le=MAX_LAYERS,
    )
    recompute_modules: list[str] | None = _recompute(key="model.recompute_modules", help="selective recompute modules")
    # --- offload and upstream constraints
    optimizer_offload_fraction: float | None = _offload(
        fallback=0.0,
        why="no optimizer offload",
        key="optimizer.optimizer_offload_fraction",
        help="optimizer states on the CPU (0..1)",
        ge=0.0,
        le=1.0,
    )
    activation_offload_layers: int | None = _offload(
        fallback=0,
        why="no activation offload",
        key="model.cpu_offloading_num_layers",
        help="model.cpu_offloading_num_layers",
        ge=0,
        le=MAX_LAYERS,
    )
    overlap: bool | None = _offload(
        fallback=False,
        why="megatron-core default overlap_cpu_optimizer_d2h_h2d=False",
        key="optimizer.overlap_cpu_optimizer_d2h_h2d",
        help="optimizer.overlap_cpu_optimizer_d2h_h2d",
    )
    hybrid_optimizer: Literal["megatron-core", "ours"] | None = _offload(
        fallback="megatron-core",
        why="what Bridge builds with optimizer.optimizer_cpu_offload=True",
        help="which HybridDeviceOptimizer runs with optimizer.optimizer_cpu_offload: megatron-core (what Bridge "
        "builds; it keeps fp32 gradient copies on the GPU) or ours (after "
        "mbridge_offload_runtime.optimizer.install_optimizer_offload())",
    )
    cuda_graph_impl: Literal["none", "local", "transformer_engine", "full_iteration"] | None = _offload(
        fallback="none",
        key="model.cuda_graph_impl",
        help="model.cuda_graph_impl (blocks activation offload unless none/full_iteration)",
    )
    fine_grained_activation_offloading: bool | None = _offload(
        fallback=False,
        key="model.fine_grained_activation_offloading",
        help="model.fine_grained_activation_offloading (blocks layer-level offload)",
    )
    offload_modules: list[str] | None = _offload(
        key="model.offload_modules",
        help="model.offload_modules: fine-grained offload points (0.19.2: attn_norm qkv_linear core_attn attn_proj "
        "mlp_norm expert_fc1 moe_act fused_group_mlp); switches fine-grained offloading on unless it is set off",
    )
    min_offloaded_tensor_size: int | None = _offload(
        fallback=1048576,
        why="megatron-core default (elements)",
        when="fine_grained",
        key="model.min_offloaded_tensor_size",
        help="model.min_offloaded_tensor_size: smaller saved tensors stay (elements)",
        ge=0,
        le=2**40,
    )
    activation_offload_fraction: float | None = _offload(
        fallback=1.0,
        when="fine_grained",
        key="model.activation_offload_fraction",
        help="model.activation_offload_fraction: share of each chunk's offload groups (0..1)",
        ge=0.0,
        le=1.0,
    )
    moe_paged_stash: bool | None = _offload(
        fallback=False, key="model.moe_paged_stash", help="blocks layer-level offload"
    )
    # --- hardware
    gpu: str | None = _hardware(
        fallback="h100-80gb",
        why="the GPU of the upstream card",
        help="GPU preset (h100-80gb, h200-141gb, gh200, gb200, gb300, a100-80gb, b200, b300)",
    )
    gpu_memory_gb: float | None = _hardware(
        help="GPU memory the device exposes, decimal GB (instead of the preset's)", gt=0, le=1e5
    )
    host_ram_gb: float | None = _hardware(
        help="host RAM per GPU, GB: the node's RAM over its GPUs (default: the preset's)", gt=0, le=1e7
    )
    gpus_per_node: int | None = _hardware(
        help="GPUs sharing one node's host RAM (default: the preset's)", ge=1, le=1024
    )
    link_gbps: float | None = _hardware(help="GPU<->host GB/s per direction (theoretical)", gt=0, le=1e5)
    host_bw_gbps: float | None = _hardware(help="host memory GB/s per GPU (theoretical)", gt=0, le=1e5)
    cpu_cores: int | None = _hardware(help="CPU cores per GPU", ge=1, le=MAX_GPUS)
    # --- step time
    cpu_threads: int | None = _time(
        fallback=1,
        why="torchrun sets OMP_NUM_THREADS=1 per rank when it starts several per node",
        help="CPU threads per rank (OMP_NUM_THREADS; torchrun sets 1)",
        ge=1,
        le=MAX_GPUS,
    )
    cpu_adam_params_per_s: float | None = _time(
        help="CPU AdamW params/s per core (else the named host profile's, else the preset's)", gt=0, le=1e13
    )
    baseline_step_s: float | None = _time(help="measured step time without offload, s", gt=0, le=1e6)
    mfu: float | None = _time(
        help="compute efficiency (fraction of peak on the compute terms) instead of the fitted one", gt=0, le=1
    )
    host_profile: str | None = _time(
        help="a host profile from `calibrate` (its measured CPU AdamW rate): a NAME in .mbridge-offload/"
        "host-profiles/ of the project (the server's roots), or a FILE; used only when given",
        max_length=4096,
    )
    calibration: str | None = _time(
        help="the older name of host_profile: a host profile FILE (from `calibrate`)", max_length=4096
    )
    overlap_grad_reduce: bool | None = _time(
        fallback=True,
        why="Bridge recipes set ddp.overlap_grad_reduce=True (megatron-core's default is False)",
        key="ddp.overlap_grad_reduce",
        help="ddp.overlap_grad_reduce (gradient reduce-scatter behind the backward)",
    )
    overlap_param_gather: bool | None = _time(
        fallback=True,
        why="Bridge recipes set ddp.overlap_param_gather=True (megatron-core's default is False)",
        key="ddp.overlap_param_gather",
        help="ddp.overlap_param_gather (parameter all-gather behind the forward)",
    )
    tp_comm_overlap: bool | None = _time(
        fallback=False,
        why="Bridge's CommOverlapConfig default (its performance recipes switch it on for TP > 1)",
        key="model.tp_comm_overlap",
        help="comm_overlap.tp_comm_overlap (TE userbuffers hide most TP traffic)",
    )
    # --- decision
    margin: float | None = _decision(
        fallback=DEFAULT_MARGIN,
        why=_MARGIN_WHY,
        help=f"fraction of usable GPU memory a recommendation keeps free (default {DEFAULT_MARGIN:g}: what NVIDIA's "
        "tightest published offload recipe keeps, rounded down)",
        ge=0.0,
        lt=1.0,
    )
    headroom_gib: float | None = _decision(
        help="free memory, GiB, that a 'comfortable' option keeps and that the fallback of a run that already fits "
        "must free (default: a tenth of the allocatable budget)",
        gt=0,
        le=1e4,
    )
    levers: list[str] | None = _decision(
        help="what recommend may change, comma-separated: "
        + ", ".join(LEVERS)
        + " (default: "
        + ", ".join(DEFAULT_LEVERS)
        + ": recompute, selective by module or full, and the three offloads; the others "
        "are then shown as alternatives: cp, tp, mbs and vpp change the layout, grad-reduce reduces gradients in bf16, "
        "ce-fusion switches on Transformer Engine's fused cross entropy, expandable-segments sets "
        "PYTORCH_CUDA_ALLOC_CONF where an OOM message shows fragmentation)"
    )
    # --- the user's own run: the measured run is the config as written (before overrides) with the hardware
    # inputs, or without a config the flags; measured_settings and what the log prints about its run override it
    measured_peak_gib: float | None = _measured(
        help="measured peak allocated of the measured run, GiB (Megatron's 'max allocated' / 1024): a point, "
        "compared with the worst stage; the measured run is the config as written (before overrides) with the "
        "hardware inputs, or without a config the flags; another run asked about is predicted as measured + "
        "model(asked) - model(measured)",
        gt=0,
        le=1e5,
    )
    measured_step_s: float | None = _measured(
        help="measured step time of the measured run (see measured_peak_gib), s", gt=0, le=1e6
    )
    measured_log: str | None = _measured(
        help="the measured run's log, a path or the text: PyTorch's CUDA OOM message (a lower bound: allocated + "
        "requested), Megatron/Bridge memory reports and max_memory_allocated prints (points), step-time lines; each "
        "compared with its rank's pipeline stage (calibration lists them); the settings it prints about its run "
        "(micro_batch_size, seq_length, global batch, world size, TP/PP/CP/EP) describe the measured run"
    )
    ooms: bool | None = _measured(
        help="the measured run ran out of GPU memory (an OOM message in measured_log says so too)"
    )
    measured_settings: list[str] | None = _measured(
        help="NAME=VALUE planner inputs of the measured run where it differs from the run asked about, e.g. "
        "micro_batch_size=1 (without a config the flags describe the asked run; with one, these override the config "
        "as written for the measured run)"
    )

    @field_validator("te_version")
    @classmethod
    def _te_release(cls, value: str | None) -> str | None:
        """The spellings validate accepts for the same input, with its message for the others."""
        from mbridge_offload.config.validate import check_te_version

        return None if value is None else check_te_version(value)


FIELDS = tuple(PlanInputs.model_fields)


def _extra(field: str) -> dict[str, Any]:
    """What ``_field`` declared beside pydantic's own arguments: ``group`` and, where there are any, ``aliases``."""
    extra = PlanInputs.model_fields[field].json_schema_extra
    return extra if isinstance(extra, dict) else {}  # always a dict here: ``_field`` never passes a callable


def config_key(field: str) -> str | None:
    """The dotted config key an input reads (``model.tensor_model_parallel_size`` for ``tp``), if it reads one."""
    key = _extra(field).get("key")
    return None if key is None else str(key)


# Input -> the one config key it reads (the effective-only inputs left out: several keys decide them).
CONFIG_KEYS: dict[str, str] = {
    n: str(_extra(n)["key"]) for n in FIELDS if _extra(n).get("key") and not _extra(n).get("effective")
}
# Inputs read from the effective config besides CONFIG_KEYS (FP8: model.* or the mixed_precision block).
EFFECTIVE_KEYS: dict[str, str] = {n: str(_extra(n)["key"]) for n in FIELDS if _extra(n).get("effective")}


def fallbacks(when: str | None = None) -> dict[str, tuple[Any, str]]:
    """``{input: (value, why)}``: what applies when nothing gives a value; ``when`` picks a feature's own ones."""
    return {n: (e["fallback"], str(e["why"])) for n in FIELDS if "fallback" in (e := _extra(n)) and e["when"] == when}


def flag_name(field: str) -> str:
    """The CLI flag of an input: its name in kebab case, ``--seq-length`` (the one rule for every tool)."""
    return "--" + field.replace("_", "-")


def cli_aliases(field: str) -> tuple[str, ...]:
    """The older CLI spellings of an input that stay accepted, e.g. ``--recompute`` for ``--recompute-granularity``."""
    return tuple(str(a) for a in _extra(field).get("aliases", ()))


def group_of(field: str) -> str:
    """The input's group (one of ``GROUPS``): its section of ``--help``."""
    return str(_extra(field)["group"])


# The model's sizes (the "model" inputs that read a config key, tying aside): they build ``ModelSpec``, and a model
# preset gives each of them (``presets.recipe_values``).
ARCHITECTURE = tuple(
    n for n in FIELDS if group_of(n) == "model" and config_key(n) and n != "share_embeddings_and_output_weights"
)
