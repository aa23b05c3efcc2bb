"""Pydantic models of the config namespaces that CPU offloading touches.

Field names and defaults mirror megatron-core's dataclasses as Bridge subclasses them, so a ``to_yaml()`` dump, a
partial YAML or overrides load without surprises. Two departures (``docs/parameters.md``): architecture sizes
default to None ("not given", so rules that need them skip), and dtype fields accept every spelling Bridge writes
and normalise to ``fp32``/``bf16``/``fp16``/``fp8``. Unknown keys are kept and ignored. No torch.
"""

from __future__ import annotations

import difflib
import functools
import typing
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

_DTYPE_ALIASES = {
    "float32": "fp32",
    "fp32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "fp16": "fp16",
    "half": "fp16",
    "uint8": "fp8",
    "fp8": "fp8",
}


def _accepts_none(annotation: Any) -> bool:
    return annotation is None or type(None) in typing.get_args(annotation) or annotation is Any


def normalize_dtype(value: Any) -> str | None:
    """Map a dtype as Bridge configs spell it to ``fp32``/``bf16``/``fp16``/``fp8`` (ValueError: not a dtype)."""
    if value is None:
        return None
    if isinstance(value, dict):  # Bridge's to_yaml(): {_target_: torch.bfloat16, _call_: false}
        value = value.get("_target_")
        if value is None:
            return None
    text = str(value).strip().lower()
    text = text.removeprefix("torch.")
    if text in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[text]
    raise ValueError(f"{value!r} is not a dtype (use fp32, bf16 or fp16)")


def _truthiness(cls: type[BaseModel], key: str, value: Any) -> Any:
    # megatron-core's dataclasses do not convert types: a flag given as the string 'false' is truthy there
    # (``if self.cpu_offloading:``). Read strings of flags the way megatron-core does; the rule CFG-STRING-FLAG
    # warns about them.
    info = cls.model_fields.get(key)
    if isinstance(value, str) and info is not None and info.annotation is bool:
        return bool(value)
    return value


@functools.cache
def _validated_fields(cls: type[BaseModel]) -> frozenset[str]:
    decorators = cls.__pydantic_decorators__.field_validators.values()
    return frozenset(name for d in decorators for name in d.info.fields)


@functools.cache
def _adapter(cls: type[BaseModel], key: str) -> TypeAdapter:
    info = cls.model_fields[key]
    # The field's constraints (ge=1) count too: a value outside them is megatron-core's to judge, like a type.
    annotation: Any = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    return TypeAdapter(annotation)


def _as_upstream_keeps_it(cls: type[BaseModel], key: str, value: Any) -> tuple[bool, Any]:
    """``(keep, value)`` for a field of a megatron-core dataclass section: a flag is read by truthiness (a list,
    a number or null too), and a value of the wrong type is left out of the typed section (the field keeps its
    default) because megatron-core's dataclass keeps it as written; the raw config still holds it, and the rules
    read it from there (``Context.seen``), reporting upstream's own TypeError where upstream compares it."""
    info = cls.model_fields.get(key)
    if info is None:
        return True, value
    if info.annotation is bool:
        return True, bool(value)
    if value is None and not _accepts_none(info.annotation):
        return False, None
    if key in _validated_fields(cls):  # its own validator reads the spellings (dtypes) and says what is wrong
        return True, value
    try:
        _adapter(cls, key).validate_python(value)
    except ValidationError:
        return False, None
    return True, value


class Section(BaseModel):
    """A config namespace: typed known fields, unknown keys kept as extras."""

    model_config = ConfigDict(extra="allow", validate_default=False, protected_namespaces=())
    # The sections that mirror megatron-core's dataclasses, which convert nothing and check types only where they
    # compare a value: there a value of the wrong type is not a load error (see _as_upstream_keeps_it).
    keeps_values_as_written: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Bridge's to_yaml() writes `null` for fields whose dataclass default is None in that release (e.g.
        # offload_modules in 0.3.x); where our field takes no None, null means "the default".
        if isinstance(data, dict) and cls.keeps_values_as_written:
            kept = {k: _as_upstream_keeps_it(cls, k, v) for k, v in data.items()}
            return {k: v for k, (keep, v) in kept.items() if keep}
        if isinstance(data, dict):
            return {
                k: _truthiness(cls, k, v)
                for k, v in data.items()
                if not (v is None and k in cls.model_fields and not _accepts_none(cls.model_fields[k].annotation))
            }
        return data

    def extras(self) -> dict[str, Any]:
        return dict(self.__pydantic_extra__ or {})

    @classmethod
    def known_fields(cls) -> list[str]:
        return list(cls.model_fields)


DType = str | None


class ModelSection(Section):
    """``model.*``: architecture, parallelism, recompute, CUDA graphs and activation offloading."""

    keeps_values_as_written = True

    # Architecture (sizes are None = not given; upstream's placeholder default is 0).
    # int | float: megatron-core's dataclass keeps 4.0 and 2.5 as given (CFG-NOT-INTEGER warns about a fraction).
    num_layers: int | float | None = None
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    kv_channels: int | None = None
    seq_length: int | None = None
    vocab_size: int | None = None
    gated_linear_unit: bool = False
    add_bias_linear: bool = True
    share_embeddings_and_output_weights: bool | None = None
    multi_latent_attention: bool = False
    # MoE
    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int | list[int] | str = 1
    moe_paged_stash: bool = False
    # Parallelism
    tensor_model_parallel_size: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1)
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = Field(1, ge=1)
    expert_model_parallel_size: int = Field(1, ge=1)
    expert_tensor_parallel_size: int | None = None
    sequence_parallel: bool = False
    pipeline_dtype: DType = None
    # Precision
    bf16: bool = False
    fp16: bool = False
    params_dtype: DType = None
    fp8: str | None = None
    # Activation recomputation
    # Any string: megatron-core itself refuses other values (validate's upstream run says so), and the
    # strings "none"/"null" are not None there either.
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: list[str] | None = None
    # CUDA graphs (cuda_graph_scope default differs by release: "full" in 0.16, None in 0.19)
    cuda_graph_impl: str | None = "none"  # null is refused by megatron-core ("Invalid cuda graph implementation")
    cuda_graph_scope: str | list[str] | None = None
    enable_cuda_graph: bool = False
    external_cuda_graph: bool = False
    cuda_graph_warmup_steps: int = 3
    use_transformer_engine_op_fuser: bool = False
    moe_expert_rank_capacity_factor: float | None = None
    moe_grouped_gemm: bool = False
    distribute_saved_activations: bool = False
    transformer_impl: str = "transformer_engine"
    # Layer-level activation offloading (MCore model_parallel_config.py, "CPU Offloading")
    cpu_offloading: bool = False
    cpu_offloading_num_layers: int | float = 0
    cpu_offloading_activations: bool = True
    cpu_offloading_weights: bool = False
    cpu_offloading_double_buffering: bool = False
    cpu_offloading_retain_pinned_cpu_buffers: bool = False
    # Fine-grained activation offloading (MCore transformer_config.py)
    fine_grained_activation_offloading: bool = False
    offload_modules: list[str] = Field(default_factory=list)
    min_offloaded_tensor_size: int | float = 1024 * 1024
    activation_offload_fraction: float = 1.0
    delay_offload_until_cuda_graph: bool = False
    delta_offload_bytes_across_pp_ranks: int | float = 0
    fine_grained_offloading_max_inflight_offloads: int | None = None

    @field_validator("pipeline_dtype", "params_dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> str | None:
        return normalize_dtype(value)


class OptimizerSection(Section):
    """``optimizer.*``: Megatron Core ``OptimizerConfig`` fields that offloading reads."""

    keeps_values_as_written = True

    optimizer: str = "adam"
    lr: float | None = None
    min_lr: float | None = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    bf16: bool = False
    fp16: bool = False
    params_dtype: DType = None
    fp8_recipe: str | None = None
    use_distributed_optimizer: bool = False
    use_precision_aware_optimizer: bool = False
    decoupled_weight_decay: bool = True
    store_param_remainders: bool = True
    main_grads_dtype: DType = "fp32"
    main_params_dtype: DType = "fp32"
    exp_avg_dtype: DType = "fp32"
    exp_avg_sq_dtype: DType = "fp32"
    overlap_param_gather: bool = False
    # Optimizer offload (MCore optimizer_config.py, "Optimizer Offload")
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0
    use_torch_optimizer_for_cpu_offload: bool = False
    overlap_cpu_optimizer_d2h_h2d: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True
    # An argument of get_megatron_optimizer upstream; read from here when a caller passes it through.
    skip_megatron_wrapping: bool = False

    @field_validator(
        "params_dtype", "main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype", mode="before"
    )
    @classmethod
    def _dtype(cls, value: Any) -> str | None:
        return normalize_dtype(value)


class DDPSection(Section):
    """``ddp.*``: the DistributedDataParallelConfig fields that interact with offloading."""

    keeps_values_as_written = True

    use_distributed_optimizer: bool = False
    use_megatron_fsdp: bool = False
    use_custom_fsdp: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    fp8_param_gather: bool = False
    megatron_fsdp_version: int | str | None = None


class TrainSection(Section):
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    train_iters: int | None = None


class DatasetSection(Section):
    seq_length: int | None = None


class OffloadConfig(Section):
    """The effective training config, as far as offloading is concerned.

    Mirrors Bridge's ``ConfigContainer``: ``model``, ``optimizer``, ``ddp``, ``train``, ``dataset`` are typed;
    every other section (``checkpoint``, ``logger``, ``scheduler`` …) is kept as-is.
    """

    model: ModelSection = Field(default_factory=ModelSection)
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    ddp: DDPSection = Field(default_factory=DDPSection)
    train: TrainSection = Field(default_factory=TrainSection)
    dataset: DatasetSection = Field(default_factory=DatasetSection)
    # Facts about the environment that some rules read (TE version, NVTE_CPU_OFFLOAD_V1); not part of Bridge.
    env: dict[str, str] = Field(default_factory=dict)
    # The config as written, before ``--set`` overrides (``sources.load`` keeps it): the run a user's log measured.
    _written: tuple[OffloadConfig, dict[str, Any]] | None = PrivateAttr(default=None)

    @property
    def written(self) -> tuple[OffloadConfig, dict[str, Any]] | None:
        """``(config, raw)`` as written when overrides changed it, else None (this config is as written)."""
        return self._written

    @property
    def seq_length(self) -> int | None:
        return self.model.seq_length or self.dataset.seq_length


SECTIONS: dict[str, type[Section]] = {
    "model": ModelSection,
    "optimizer": OptimizerSection,
    "ddp": DDPSection,
    "train": TrainSection,
    "dataset": DatasetSection,
}

# The keys this project is about; used for the effective-config report and for did-you-mean hints.
OFFLOAD_KEYS: tuple[str, ...] = (
    "model.cpu_offloading",
    "model.cpu_offloading_num_layers",
    "model.cpu_offloading_activations",
    "model.cpu_offloading_weights",
    "model.cpu_offloading_double_buffering",
    "model.cpu_offloading_retain_pinned_cpu_buffers",
    "model.fine_grained_activation_offloading",
    "model.offload_modules",
    "model.min_offloaded_tensor_size",
    "model.activation_offload_fraction",
    "optimizer.optimizer_cpu_offload",
    "optimizer.optimizer_offload_fraction",
    "optimizer.use_torch_optimizer_for_cpu_offload",
    "optimizer.overlap_cpu_optimizer_d2h_h2d",
    "optimizer.pin_cpu_grads",
    "optimizer.pin_cpu_params",
)

# Keys whose values decide whether the offload rules fire; reported with the offload keys.
RELATED_KEYS: tuple[str, ...] = (
    "model.num_layers",
    "model.pipeline_model_parallel_size",
    "model.virtual_pipeline_model_parallel_size",
    "model.recompute_granularity",
    "model.cuda_graph_impl",
    "model.moe_paged_stash",
    "model.transformer_impl",
    "optimizer.optimizer",
    "optimizer.use_distributed_optimizer",
    "optimizer.use_precision_aware_optimizer",
    "optimizer.decoupled_weight_decay",
    "ddp.use_megatron_fsdp",
)


# Float fields whose bounds our rules and planner rely on (a fraction of layers, of optimizer state): NaN/±inf there
# is refused as bad input. Every other float field takes them as upstream's dataclass does
# (optimizer.grad_norm_skip_threshold: .inf is Bridge's own default; lr, clip_grad, adam_* carry no check upstream).
_FINITE_FLOATS = {("optimizer", "optimizer_offload_fraction"), ("model", "activation_offload_fraction")}


def refuses_non_finite(section: str, key: str) -> bool:
    """Whether ``section.key`` takes only finite numbers: a count (an ``int`` field) or a bound that is ours."""
    cls = OffloadConfig.model_fields[section].annotation if section in OffloadConfig.model_fields else None
    info = cls.model_fields.get(key) if isinstance(cls, type) and issubclass(cls, Section) else None
    if info is None:
        return False  # an unknown key: kept as written
    annotation = info.annotation
    return annotation is int or int in typing.get_args(annotation) or (section, key) in _FINITE_FLOATS


def get_value(cfg: OffloadConfig, dotted: str) -> Any:
    """``get_value(cfg, "model.cpu_offloading")`` → the effective value (defaults included)."""
    section, _, key = dotted.partition(".")
    node = getattr(cfg, section, None)  # an untyped section (Bridge's env_vars) is a plain dict, or absent
    return node.get(key) if isinstance(node, dict) else getattr(node, key, None)


def effective_values(cfg: OffloadConfig) -> dict[str, Any]:
    """The offload-related keys with their effective values, for reports."""
    return {key: get_value(cfg, key) for key in OFFLOAD_KEYS + RELATED_KEYS}


def field_default(dotted: str) -> Any:
    """The default of a dotted key, as the config model defines it (the single source of truth)."""
    section, _, key = dotted.partition(".")
    info = SECTIONS[section].model_fields[key]
    return info.get_default(call_default_factory=True)


def suggest_key(section: str, key: str) -> str | None:
    """A did-you-mean for an unknown key that looks like a misspelled offload key, else None."""
    candidates = [k.partition(".")[2] for k in OFFLOAD_KEYS if k.startswith(section + ".")]
    if section in SECTIONS:
        candidates += [k for k in SECTIONS[section].model_fields if "offload" in k]
    match = difflib.get_close_matches(key, sorted(set(candidates)), n=1, cutoff=0.75)
    if match:
        return f"{section}.{match[0]}"
    # A key that mentions offloading but matches nothing close is still worth a warning.
    if "offload" in key.lower():
        loose = difflib.get_close_matches(key, sorted(set(candidates)), n=1, cutoff=0.5)
        return f"{section}.{loose[0]}" if loose else None
    return None


def unknown_offload_keys(raw: dict[str, Any]) -> list[tuple[str, str]]:
    """``(given_key, suggestion)`` for every unknown key in a typed section that looks like an offload typo."""
    found: list[tuple[str, str]] = []
    for section, cls in SECTIONS.items():
        body = raw.get(section)
        if not isinstance(body, dict):
            continue
        for key in body:
            if key in cls.model_fields or key.startswith("_"):
                continue
            hint = suggest_key(section, key)
            if hint:
                found.append((f"{section}.{key}", hint))
    return found
