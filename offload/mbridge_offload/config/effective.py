"""The one effective config: how every tool reads a loaded config, once, with where each value came from.

A config file says only part of what a run uses. The rest comes, in this order, from the frontend's defaults
(megatron-core's dataclasses, a Bridge recipe, or Megatron-LM's argv defaults), Bridge's ``mixed_precision``
block, Bridge's model ``finalize()`` and ``comm_overlap`` section (:mod:`.bridge`), and the facts megatron-core or
Bridge derive from other keys (:attr:`Effective.filled`: e.g. ``pipeline_dtype = params_dtype`` under pipeline
parallelism, which every frontend fills in before megatron-core sees it). validate, the planner, diagnose, apply
and exact mode all read this object, and every answer prints it under ``effective``. No torch, nothing from plan/.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mbridge_offload.config import bridge
from mbridge_offload.config.megatron_lm.argv import MLM_CLI_DEFAULTS
from mbridge_offload.config.rules.base import DEFAULT_TARGET, Target, parse_target
from mbridge_offload.config.schema import OFFLOAD_KEYS, RELATED_KEYS, SECTIONS, OffloadConfig, get_value

# Sources that mean "nothing in the input decided this": the planner may put its own assumption in their place.
DEFAULT_SOURCES = frozenset({"megatron-core default", "Megatron-LM default"})

# The keys every answer reports: the offload keys, what decides whether their rules fire, and what the memory model
# reads (parallelism, precision, batch).
EFFECTIVE_KEYS: tuple[str, ...] = tuple(
    dict.fromkeys(
        (
            *OFFLOAD_KEYS,
            *RELATED_KEYS,
            "model.tensor_model_parallel_size",
            "model.context_parallel_size",
            "model.expert_model_parallel_size",
            "model.expert_tensor_parallel_size",
            "model.sequence_parallel",
            "model.tp_comm_overlap",
            "model.pipeline_dtype",
            "model.params_dtype",
            "model.bf16",
            "model.fp16",
            "model.fp8",
            "model.fp8_recipe",
            "model.fp8_param",
            "model.seq_length",
            "ddp.use_distributed_optimizer",
            "ddp.grad_reduce_in_fp32",
            "ddp.overlap_grad_reduce",
            "ddp.overlap_param_gather",
            "train.micro_batch_size",
            "train.global_batch_size",
        )
    )
)
_FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")


class EffectiveValue(BaseModel):
    """One value of the effective config and what decided it."""

    model_config = ConfigDict(extra="forbid")

    value: Any
    source: str = Field(
        description="config, argv, Bridge recipe default, mixed_precision, bridge finalize (0.6), megatron-core "
        "default, Megatron-LM default, Megatron-LM CLI default, or 'derived: <why>'"
    )


@dataclass(frozen=True)
class Effective:
    """A loaded config resolved once: the typed config and raw dict as megatron-core's checks see them (after
    ``mixed_precision`` and ``finalize()``), and each reported value with its source."""

    config: OffloadConfig
    raw: dict[str, Any]
    values: dict[str, EffectiveValue]
    target: Target
    frontend: str
    container: bool
    normalized: tuple[bridge.Change, ...] = ()
    written: frozenset[str] = field(default_factory=frozenset)
    source: str | None = None  # where the config came from (``recipe:NAME`` marks a Bridge recipe)
    # What the frontend sets before megatron-core's checks beyond ``normalized`` (key, as written, as set): exact mode
    # hands megatron-core these too, so that it judges what the run would build.
    filled: tuple[bridge.Change, ...] = ()

    def to_json(self) -> dict[str, dict[str, Any]]:
        """The ``effective`` block of every answer: dotted key → ``{"value", "source"}``."""
        return {k: v.model_dump(mode="json") for k, v in self.values.items()}

    def given(self, dotted: str) -> tuple[bool, Any]:
        """``(True, value)`` when the input decides ``dotted`` (written, mixed_precision, finalize or derived from
        what is written); ``(False, None)`` when only a frontend default does, so a planner may assume its own."""
        entry = self.values.get(dotted)
        if entry is not None:
            return (False, None) if entry.source in DEFAULT_SOURCES else (True, entry.value)
        if dotted in self.written:
            section, _, key = dotted.partition(".")
            node = getattr(self.config, section, None)
            return True, getattr(node, key, None) if node is not None else None
        return False, None


def _lookup(raw: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _written(raw: dict[str, Any]) -> frozenset[str]:
    out: set[str] = set()
    for section, body in raw.items():
        if isinstance(body, dict):
            out.update(f"{section}.{k}" for k in body if not str(k).startswith("_"))
    return frozenset(out)


def _as_upstream_sees_it(cfg: OffloadConfig, dotted: str, has: bool, value: Any) -> Any:
    """The typed value, or the value as written where the typed section left it out (a wrong type, or a number out
    of the field's bounds such as ``tensor_model_parallel_size: 0``): megatron-core's dataclass keeps it as written,
    so reporting the field's default there would hide the input (every tool then refuses it, naming it)."""
    typed = get_value(cfg, dotted)
    if not has:
        return typed
    section, _, key = dotted.partition(".")
    node = getattr(cfg, section, None)
    dropped = isinstance(node, BaseModel) and key in type(node).model_fields and key not in node.model_fields_set
    if value is not None and dropped:
        return value
    return typed if typed is not None else value


def _with_mixed_precision(raw: dict[str, Any]) -> dict[str, Any]:
    """Bridge's copy of the ``mixed_precision`` block onto every config that has the field: the block's fields a
    partial YAML does not write yet are added first (our schema mirrors upstream's fields), then bridge.py copies."""
    section = bridge.mixed_precision_section(raw)  # a recipe name resolved, Bridge's defaults filled in
    if section is None:
        return raw
    raw = copy.deepcopy(raw)
    for part in ("model", "optimizer", "ddp"):
        known = set(SECTIONS[part].known_fields())
        body = raw.setdefault(part, {}) if isinstance(raw.get(part, {}), dict) else None
        if body is None:
            continue
        for key in section:
            if key in known and key not in body:
                body[key] = None
    mixed = bridge.mixed_precision(raw)
    block = raw.get("mixed_precision")
    written: dict[str, Any] = block if isinstance(block, dict) else {}
    for part in ("model", "optimizer", "ddp"):  # a field the block writes as null keeps the config's default
        body = mixed.get(part)
        if isinstance(body, dict):
            for key in [k for k, v in body.items() if v is None and k in written and written.get(k) is None]:
                body.pop(key)
    return mixed


class _Builder:
    """Fills :attr:`Effective.values` key by key; one small method per derived fact."""

    def __init__(self, eff_config: OffloadConfig, raw: dict[str, Any], mixed: dict[str, Any], where: str) -> None:
        self.cfg, self.raw, self.mixed, self.where = eff_config, raw, mixed, where
        self.default = "Megatron-LM default" if where == "argv" else "megatron-core default"
        self.out: dict[str, EffectiveValue] = {}

    def source_of(self, dotted: str, finalized: dict[str, str]) -> str:
        if dotted in finalized:
            return finalized[dotted]
        written, value = _lookup(self.raw, dotted)
        mixed_has, mixed_value = _lookup(self.mixed, dotted)
        if mixed_has and (not written or mixed_value != value) and _lookup(self.mixed, "mixed_precision")[0]:
            return "mixed_precision"
        if written and self.where == "argv" and MLM_CLI_DEFAULTS.get(dotted, object()) == value:
            return "Megatron-LM CLI default"  # the parser writes it; it decides (not a planner's to replace)
        return self.where if written else self.default

    def put(self, dotted: str, value: Any, source: str) -> None:
        self.out[dotted] = EffectiveValue(value=value, source=source)


def _mp_or_model(b: _Builder, key: str) -> tuple[bool, Any, str]:
    # The block as Bridge instantiates and finalizes it (fp8_param unset takes fp8_param_gather), then the model.
    section = bridge.mixed_precision_section(b.raw) or {}
    if section.get(key) is not None:
        return True, section[key], "mixed_precision"
    has, value = _lookup(b.mixed, f"model.{key}")
    if has and value is not None:
        return True, value, b.where
    return False, None, b.default


def _derive_precision(b: _Builder) -> None:
    m = b.cfg.model
    if b.out["model.params_dtype"].source in DEFAULT_SOURCES and (m.bf16 or m.fp16):
        flag = "bf16" if m.bf16 else "fp16"
        b.put("model.params_dtype", flag, f"derived: model.{flag} is true (Bridge's mixed precision trains in it)")
    elif b.out["model.params_dtype"].value is None:
        b.put("model.params_dtype", "fp32", b.default)  # the dataclass default, torch.float32
    has_fp8, fp8, fp8_src = _mp_or_model(b, "fp8")
    b.put("model.fp8", fp8 if has_fp8 else None, fp8_src)
    has_recipe, recipe, recipe_src = _mp_or_model(b, "fp8_recipe")
    if not fp8 and not has_fp8 and not has_recipe:
        b.put("model.fp8_recipe", "none", b.default)
    elif not fp8:
        b.put("model.fp8_recipe", "none", f"derived: no FP8 compute (model.fp8 is {fp8!r})")
    else:
        name = str(recipe) if has_recipe and str(recipe) in _FP8_RECIPES else "delayed"
        b.put("model.fp8_recipe", name, recipe_src if has_recipe else "derived: megatron-core's default FP8 recipe")
    has_param, param, param_src = _mp_or_model(b, "fp8_param")
    if not has_param:
        has_param, param, param_src = _mp_or_model(b, "fp8_param_gather")
    if not has_param and b.cfg.ddp.fp8_param_gather:
        has_param, param, param_src = True, True, b.source_of("ddp.fp8_param_gather", {})
    if fp8:
        b.put("model.fp8_param", bool(param), param_src)
    else:
        b.put("model.fp8_param", False, "derived: no FP8 compute" if has_param else b.default)


def _derive_parallel(b: _Builder) -> None:
    m = b.cfg.model
    etp = b.out["model.expert_tensor_parallel_size"]
    if etp.value is None:
        b.put(
            "model.expert_tensor_parallel_size",
            m.tensor_model_parallel_size,
            "derived: megatron-core sets expert_tensor_parallel_size = tensor_model_parallel_size when unset",
        )


def _derive_optimizer(b: _Builder) -> None:
    opt, ddp = b.out["optimizer.use_distributed_optimizer"], b.out["ddp.use_distributed_optimizer"]
    if b.where != "argv" and not opt.value and ddp.value:
        # Bridge keeps optimizer.* and ddp.* in sync: either one switches the distributed optimizer on.
        b.put("optimizer.use_distributed_optimizer", True, "derived: ddp.use_distributed_optimizer is true")
    elif opt.source in DEFAULT_SOURCES and ddp.source not in DEFAULT_SOURCES:
        b.put(
            "optimizer.use_distributed_optimizer", ddp.value, f"derived: ddp.use_distributed_optimizer is {ddp.value}"
        )
    fraction = b.out["optimizer.optimizer_offload_fraction"]
    if not b.cfg.optimizer.optimizer_cpu_offload and fraction.value:
        b.put("optimizer.optimizer_offload_fraction", 0.0, "derived: optimizer.optimizer_cpu_offload is false")
    layers = b.out["model.cpu_offloading_num_layers"]
    if not b.cfg.model.cpu_offloading and layers.value:
        b.put("model.cpu_offloading_num_layers", 0, "derived: model.cpu_offloading is false")


def _derive_comm_overlap(b: _Builder) -> None:
    for key, value, source in bridge.comm_overlap(b.mixed, b.cfg):
        b.put(key, value, source)


def _derive_pipeline_dtype(b: _Builder) -> None:
    # A ConfigContainer's finalize() already ran above (a normalisation); any other input still reaches megatron-core
    # through a frontend that fills it: Bridge's finalize() (pipeline_dtype = params_dtype when PP > 1 and unset) for
    # a partial YAML or overrides merged onto a recipe, Megatron-LM's core_transformer_config_from_args
    # (pipeline_dtype = params_dtype, always) for a command line.
    if b.cfg.model.pipeline_model_parallel_size <= 1 or b.out["model.pipeline_dtype"].value is not None:
        return
    who = (
        "Megatron-LM's core_transformer_config_from_args sets pipeline_dtype = params_dtype"
        if b.where == "argv"
        else "Bridge's finalize() sets pipeline_dtype = params_dtype when PP > 1 and it is unset"
    )
    b.put("model.pipeline_dtype", b.out["model.params_dtype"].value, f"derived: {who}")


def _derive_seq(b: _Builder) -> None:
    if b.out["model.seq_length"].value is None and b.cfg.dataset.seq_length:
        b.put("model.seq_length", b.cfg.dataset.seq_length, f"derived: dataset.seq_length ({b.where})")


def resolve(
    config: OffloadConfig,
    raw: dict[str, Any] | None = None,
    target: Any = DEFAULT_TARGET,
    source: str | None = None,
) -> Effective:
    """Resolve a loaded config once: frontend defaults → ``mixed_precision`` → ``finalize()`` → derived facts.

    ``raw`` None: every value counts as written (a config built in code). Never raises for a config that
    ``build_config`` accepted.
    """
    from mbridge_offload.config.sources import ConfigError, build_config

    tgt = parse_target(target)
    raw = raw if raw is not None else config.model_dump(mode="json", exclude={"env"})
    frontend = config.env.get("frontend", "bridge")
    container = bridge.is_container(raw, source)
    where = "argv" if frontend == "megatron-lm" else "config"
    if source is not None and source.startswith("recipe:"):
        where = "Bridge recipe default"
    eff_config, mixed, changes = config, raw, list[bridge.Change]()
    if container:
        mixed = _with_mixed_precision(raw)
        if mixed is not raw:
            try:
                eff_config = build_config(copy.deepcopy(mixed))
                eff_config.env.update(config.env)
            except ConfigError:  # a block with a bad value: judged as written; validate names the value
                mixed = raw
        eff_config, mixed, changes = bridge.finalize(eff_config, mixed, tgt)
    label = f"bridge finalize ({tgt.bridge.split()[-1].removesuffix('.x')})"
    finalized = {key: label for key, _old, _new in changes}
    b = _Builder(eff_config, raw, mixed, where)
    for key in EFFECTIVE_KEYS:
        has, value = _lookup(mixed, key)
        b.put(key, _as_upstream_sees_it(eff_config, key, has, value), b.source_of(key, finalized))
    steps = [_derive_precision, _derive_parallel, _derive_optimizer, _derive_pipeline_dtype, _derive_seq]
    for step in [*steps[:2], _derive_comm_overlap, *steps[2:]] if container else steps:
        step(b)
    filled = tuple(
        (key, None, b.out[key].value)
        for key in ("model.pipeline_dtype",)
        if get_value(eff_config, key) is None and b.out[key].value is not None
    )
    written = _written(mixed)
    return Effective(eff_config, mixed, b.out, tgt, frontend, container, tuple(changes), written, source, filled)
