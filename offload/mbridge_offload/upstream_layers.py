"""What each offload and recompute setting does in each model class of megatron-core 0.16.1 and 0.19.2.

One table read from megatron-core's source: rows are settings, columns model classes, and each cell says
**applies**, **no effect** (accepted, does nothing there) or **refused**, with the :class:`Evidence` that decides
it per release. Containers (GPT block, hybrid stack, MTP block) decide the stack-level settings; for a module-level
setting a container's cell says whether the setting reaches its layers. The config rules (``layer_reach``), the
planner and ``references/upstream-layers.md`` read it; ``tests/test_upstream_layers.py`` checks every cell's
evidence against the installed sources of both releases.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from mbridge_offload import upstream_sites as us
from mbridge_offload.upstream_sites import RELEASES, STACK_CLASS, Evidence

Verdict = Literal["applies", "no effect", "refused"]
VERDICTS: tuple[str, ...] = ("applies", "no effect", "refused")

# The release the planner models (megatron-core 0.19.2, the default validation target).
PLANNER_RELEASE = "0.19.2"


@dataclass(frozen=True)
class Setting:
    """A row: ``key`` is stable (``offload_modules:core_attn``), ``config`` what the user writes."""

    key: str
    group: str
    config: str


@dataclass(frozen=True)
class Layer:
    """A column: ``key`` is stable, ``classes`` names megatron-core's classes per release."""

    key: str
    title: str
    classes: dict[str, str]


@dataclass(frozen=True)
class Cell:
    setting: str
    layer: str
    release: str
    verdict: Verdict
    evidence: Evidence
    note: str = ""

    @property
    def site(self) -> us.Site:
        return self.evidence.at(self.release)


LAYER_OFFLOAD, FINE_GRAINED, OPTIMIZER, RECOMPUTE = (
    "layer-level offload",
    "fine-grained offload",
    "optimizer offload",
    "recompute",
)
# The names megatron-core 0.19.2 accepts in ``offload_modules`` (transformer_config.py, __post_init__).
ALLOWED_OFFLOAD_MODULES: tuple[str, ...] = (
    "attn_norm",
    "qkv_linear",
    "core_attn",
    "attn_proj",
    "mlp_norm",
    "expert_fc1",
    "moe_act",
    "fused_group_mlp",
)
_RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "moe_act", "shared_experts", "mla_up_proj")

SETTINGS: tuple[Setting, ...] = (
    Setting("cpu_offloading", LAYER_OFFLOAD, "model.cpu_offloading=true (cpu_offloading_activations)"),
    Setting("cpu_offloading_weights", LAYER_OFFLOAD, "model.cpu_offloading_weights=true"),
    *(Setting(f"offload_modules:{m}", FINE_GRAINED, f"model.offload_modules=[{m}]") for m in ALLOWED_OFFLOAD_MODULES),
    Setting("optimizer_cpu_offload", OPTIMIZER, "optimizer.optimizer_cpu_offload=true"),
    Setting("recompute:full-uniform", RECOMPUTE, "model.recompute_granularity=full, recompute_method=uniform"),
    Setting("recompute:full-block", RECOMPUTE, "model.recompute_granularity=full, recompute_method=block"),
    *(
        Setting(f"recompute_modules:{m}", RECOMPUTE, f"model.recompute_granularity=selective, recompute_modules=[{m}]")
        for m in _RECOMPUTE_MODULES
    ),
)

LAYERS: tuple[Layer, ...] = (
    Layer("block", "GPT block", {r: "GPTModel / TransformerBlock" for r in RELEASES}),
    Layer("dense", "dense layer", {r: "TransformerLayer (TE spec: SelfAttention + MLP)" for r in RELEASES}),
    Layer("hybrid", "hybrid stack", {r: STACK_CLASS[r][0] for r in RELEASES}),
    Layer("mamba", "Mamba mixer", {r: "MambaLayer / MambaMixer" for r in RELEASES}),
    Layer("mla", "MLA attention", {r: "MultiLatentAttention" for r in RELEASES}),
    Layer("moe", "MoE layer", {r: "MoELayer / TEGroupedMLP" for r in RELEASES}),
    Layer("mtp", "MTP block", {r: "MultiTokenPredictionLayer" for r in RELEASES}),
)


@dataclass(frozen=True)
class _V:
    verdict: Verdict
    evidence: Evidence
    note: str = ""


def _ok(evidence: Evidence, note: str = "") -> _V:
    return _V("applies", evidence, note)


def _no(evidence: Evidence, note: str = "") -> _V:
    return _V("no effect", evidence, note)


def _refused(evidence: Evidence, note: str = "") -> _V:
    return _V("refused", evidence, note)


Spec = _V | tuple[_V, _V]  # one verdict for both releases, or (0.16.1, 0.19.2)

_CELLS: list[Cell] = []


def _row(setting: str, **by_layer: Spec) -> None:
    if setting not in {s.key for s in SETTINGS} or set(by_layer) != {c.key for c in LAYERS}:
        raise RuntimeError(f"row {setting}: every setting needs one spec per layer column")
    for layer, spec in by_layer.items():
        per_release = spec if isinstance(spec, tuple) else (spec, spec)
        for release, v in zip(RELEASES, per_release, strict=True):
            _CELLS.append(Cell(setting, layer, release, v.verdict, v.evidence, v.note))


# ------------------------------------------------------------------------------------ layer-level offload
_STACK_NOTE = "never opens the layer-level CPU-offload context (only TransformerBlock does): nothing is offloaded"
_IN_BLOCK = "inside a TransformerBlock (in a hybrid stack: no effect)"
_MTP_NOTE = "MTP depths run after the decoder block, outside its context: they are never offloaded"
_row(
    "cpu_offloading",
    block=_ok(us.BLOCK_CONTEXT),
    dense=_ok(us.BLOCK_ENTER, "every saved tensor of the layer's forward goes through the block's context"),
    hybrid=_no(us.STACK_NO_CONTEXT, _STACK_NOTE),
    mamba=_no(us.STACK_NO_CONTEXT, "Mamba layers live only in the hybrid stack, which " + _STACK_NOTE),
    mla=_ok(us.BLOCK_ENTER, _IN_BLOCK),
    moe=_ok(us.BLOCK_ENTER, _IN_BLOCK),
    mtp=_no(us.MTP_NULL_CONTEXT, _MTP_NOTE),
)
_WEIGHTS = "handed to Transformer Engine, which ignores weight offload since 2025 (rule ACT-WEIGHTS-DEPRECATED)"
_row(
    "cpu_offloading_weights",
    block=_ok(us.BLOCK_WEIGHTS, _WEIGHTS),
    dense=_ok(us.BLOCK_WEIGHTS, _WEIGHTS),
    hybrid=_no(us.STACK_NO_CONTEXT, _STACK_NOTE),
    mamba=_no(us.STACK_NO_CONTEXT, "Mamba layers live only in the hybrid stack, which " + _STACK_NOTE),
    mla=_ok(us.BLOCK_WEIGHTS, _WEIGHTS),
    moe=_ok(us.BLOCK_WEIGHTS, _WEIGHTS),
    mtp=_no(us.MTP_NULL_CONTEXT, _MTP_NOTE),
)

# ------------------------------------------------------------------------------------ fine-grained offload
_CHUNK = _ok(
    us.GPT_CHUNK, "is run by GPTModel, which opens the fine-grained chunk; what a layer offloads is its column's"
)
_HYBRID_CHUNK = (
    _no(
        us.HYBRID_CHUNK,
        "is built by MambaModel, which never opens a fine-grained chunk: every offload group is a no-op",
    ),
    _ok(us.HYBRID_CHUNK, "is built by HybridModel, which opens the chunk; what a layer offloads is its column's"),
)
_MAMBA_NONE = _no(us.MAMBA_NONE, "the Mamba mixer's activations are never offloaded or recomputed by module")
_MTP_PASS = _ok(us.MTP_LAYER_BUILD, "as in the decoder's layer it copies (the dense, MLA or MoE column)")
_ATTN_SIDE = "read by the attention: the MoE layer is the MLP side (see the dense or MLA column)"
_MLP_SIDE = "read on the MLP side (see the dense or MoE column)"


def _fg_attention(module: str, dense: Evidence, mla: Evidence) -> None:
    _row(
        f"offload_modules:{module}",
        block=_CHUNK,
        dense=_ok(dense),
        hybrid=_HYBRID_CHUNK,
        mamba=_MAMBA_NONE,
        mla=_ok(mla),
        moe=_no(dense, _ATTN_SIDE),
        mtp=_MTP_PASS,
    )


_NORM_WHAT = "the norm is a module of its own only where the layer spec gives one (else IdentityOp)"
_FUSED_NORM = "the TE spec fuses this norm into the next linear layer (IdentityOp): no norm module to act on"
_row(
    "offload_modules:attn_norm",
    block=_CHUNK,
    dense=_no(us.join("dense-attn-norm", _NORM_WHAT, us.FG_ATTN_NORM, us.SPEC_DENSE_FUSED), _FUSED_NORM),
    hybrid=_HYBRID_CHUNK,
    mamba=_MAMBA_NONE,
    mla=_ok(
        us.join("mla-attn-norm", _NORM_WHAT, us.FG_ATTN_NORM, us.SPEC_MLA_NORM),
        "MLA's input norm is a module of its own (0.19.2 with mla_down_proj_fusion: fused, no effect)",
    ),
    moe=_no(us.FG_ATTN_NORM, _ATTN_SIDE),
    mtp=_MTP_PASS,
)
_fg_attention("qkv_linear", us.FG_QKV, us.MLA_FG_QKV)
_fg_attention("core_attn", us.FG_CORE, us.MLA_FG_CORE)
_fg_attention("attn_proj", us.FG_PROJ, us.MLA_FG_PROJ)
_row(
    "offload_modules:mlp_norm",
    block=_CHUNK,
    dense=_no(us.join("dense-mlp-norm", _NORM_WHAT, us.FG_MLP_NORM, us.SPEC_DENSE_FUSED), _FUSED_NORM),
    hybrid=_HYBRID_CHUNK,
    mamba=_MAMBA_NONE,
    mla=_no(us.FG_MLP_NORM, _MLP_SIDE),
    moe=_ok(us.join("moe-mlp-norm", _NORM_WHAT, us.FG_MLP_NORM, us.SPEC_MOE_NORM), "the pre-MLP norm feeds the router"),
    mtp=_MTP_PASS,
)
_EXPERTS_ONLY = "read only by the MoE experts"


def _fg_experts(module: str, evidence: Evidence, note: str) -> None:
    _row(
        f"offload_modules:{module}",
        block=_CHUNK,
        dense=_no(evidence, _EXPERTS_ONLY),
        hybrid=_HYBRID_CHUNK,
        mamba=_MAMBA_NONE,
        mla=_no(evidence, _EXPERTS_ONLY),
        moe=_ok(evidence, note),
        mtp=_MTP_PASS,
    )


_GROUPED = "TEGroupedMLP only (moe_grouped_gemm with TE); SequentialMLP experts never read it"
_fg_experts("expert_fc1", us.FG_EXPERT_FC1, _GROUPED)
_fg_experts("moe_act", us.FG_MOE_ACT, _GROUPED)
_NOT_016 = _refused(us.FG_FUSED, "0.16.1 does not accept fused_group_mlp in offload_modules")
_row(
    "offload_modules:fused_group_mlp",
    block=(_NOT_016, _CHUNK),
    dense=(_NOT_016, _no(us.FG_FUSED, _EXPERTS_ONLY)),
    hybrid=(_NOT_016, _HYBRID_CHUNK[1]),
    mamba=(_NOT_016, _MAMBA_NONE),
    mla=(_NOT_016, _no(us.FG_FUSED, _EXPERTS_ONLY)),
    moe=(_NOT_016, _ok(us.FG_FUSED, "TEGroupedMLP with use_transformer_engine_op_fuser (refused without it)")),
    mtp=(_NOT_016, _MTP_PASS),
)

# ------------------------------------------------------------------------------------ optimizer offload
_HDO = _ok(us.OPTIMIZER_HDO, "the optimizer splits parameters by size, not by layer class")
_row("optimizer_cpu_offload", block=_HDO, dense=_HDO, hybrid=_HDO, mamba=_HDO, mla=_HDO, moe=_HDO, mtp=_HDO)

# ------------------------------------------------------------------------------------ full recompute
_FULL_016 = "has no checkpointed forward: full recompute does nothing"
_full_stack = (_no(us.STACK_FULL, _FULL_016), _ok(us.STACK_FULL, "checkpoints every layer, Mamba layers included"))
_full_mamba = (
    _no(us.MAMBA_FULL, "sits only in MambaStack, which " + _FULL_016),
    _ok(us.MAMBA_FULL, "runs inside the stack's checkpoint"),
)
for _method, _mtp in (
    ("uniform", _ok(us.MTP_FULL_UNIFORM, "only with recompute_num_layers = 1: otherwise the first forward asserts")),
    ("block", _no(us.MTP_FULL_BLOCK, "megatron-core warns 'not supported for MTP yet. Skipping recompute.'")),
):
    _row(
        f"recompute:full-{_method}",
        block=_ok(us.BLOCK_FULL),
        dense=_ok(us.BLOCK_FULL),
        hybrid=_full_stack,
        mamba=_full_mamba,
        mla=_ok(us.BLOCK_FULL, "inside a TransformerBlock (in a hybrid stack: as the stack)"),
        moe=_ok(us.BLOCK_FULL, "inside a TransformerBlock (in a hybrid stack: as the stack)"),
        mtp=_mtp,
    )

# ------------------------------------------------------------------------------------ selective recompute
_SEL = "set by each module whatever its container"
_row(
    "recompute_modules:core_attn",
    block=_ok(us.REC_CORE, _SEL),
    dense=_ok(us.REC_CORE),
    hybrid=_ok(us.REC_CORE, "reaches its attention (*) layers"),
    mamba=_MAMBA_NONE,
    mla=_ok(us.MLA_REC_CORE),
    moe=_no(us.REC_CORE, _ATTN_SIDE),
    mtp=_MTP_PASS,
)
_row(
    "recompute_modules:layernorm",
    block=_ok(us.REC_INPUT_NORM, _SEL),
    dense=_no(us.join("dense-layernorm", _NORM_WHAT, us.REC_INPUT_NORM, us.SPEC_DENSE_FUSED), _FUSED_NORM),
    hybrid=_ok(
        us.join("hybrid-layernorm", _NORM_WHAT, us.REC_PRE_MLP_NORM, us.SPEC_HYBRID),
        "reaches only the MoE (E) layers' pre-MLP norm: the * and - layers fuse theirs",
    ),
    mamba=_MAMBA_NONE,
    mla=_ok(us.join("mla-layernorm", _NORM_WHAT, us.REC_INPUT_NORM, us.SPEC_MLA_NORM), "MLA's separate input norm"),
    moe=_ok(
        us.join("moe-layernorm", _NORM_WHAT, us.REC_PRE_MLP_NORM, us.SPEC_MOE_NORM),
        "the pre-MLP norm feeding the router",
    ),
    mtp=_MTP_PASS,
)
_row(
    "recompute_modules:mlp",
    block=_ok(us.REC_MLP, _SEL),
    dense=_ok(us.REC_MLP),
    hybrid=_ok(us.REC_MLP, "reaches its MLP (-) layers"),
    mamba=_MAMBA_NONE,
    mla=_no(us.REC_MLP, _MLP_SIDE),
    moe=_no(us.REC_MLP, "MoE layers take moe, moe_act and shared_experts instead"),
    mtp=_MTP_PASS,
)


def _moe_row(module: str, evidence: Evidence, note: str = "") -> None:
    _row(
        f"recompute_modules:{module}",
        block=_ok(evidence, _SEL),
        dense=_no(evidence, "read only by the MoE layer"),
        hybrid=_ok(evidence, "reaches its MoE (E) layers"),
        mamba=_MAMBA_NONE,
        mla=_no(evidence, "read only by the MoE layer"),
        moe=_ok(evidence, note),
        mtp=_MTP_PASS,
    )


_moe_row("moe", us.REC_MOE)
_moe_row(
    "moe_act",
    us.join(
        "moe-act",
        "TEGroupedMLP recomputes its activation; refused without moe_grouped_gemm",
        us.REC_MOE_ACT,
        us.REC_MOE_ACT_REFUSED,
    ),
    "refused without moe_grouped_gemm",
)
_moe_row("shared_experts", us.REC_SHARED, "only with shared experts")
_row(
    "recompute_modules:mla_up_proj",
    block=_ok(us.REC_MLA_UP, _SEL),
    dense=_refused(us.REC_MLA_UP_REFUSED, "refused unless multi_latent_attention is on"),
    hybrid=(
        _no(us.REC_MLA_UP, "builds no MLA layer in 0.16.1"),
        _ok(us.REC_MLA_UP, "reaches its MLA (+) layers"),
    ),
    mamba=_MAMBA_NONE,
    mla=_ok(us.REC_MLA_UP),
    moe=_no(us.REC_MLA_UP, _ATTN_SIDE),
    mtp=_MTP_PASS,
)

CELLS: tuple[Cell, ...] = tuple(_CELLS)


# ------------------------------------------------------------------------------------ queries


@functools.cache
def _index() -> dict[tuple[str, str, str], Cell]:
    return {(c.setting, c.layer, c.release): c for c in CELLS}


def release_of(version: tuple[int, ...]) -> str:
    """The table's release for a megatron-core version: 0.16.1 below 0.19, else 0.19.2 (HEAD reads as 0.19.2)."""
    return "0.16.1" if tuple(version[:2]) < (0, 19) else "0.19.2"


def cell(setting: str, layer: str, release: str = PLANNER_RELEASE) -> Cell:
    """The cell of ``setting`` in ``layer`` for ``release`` (KeyError: an unknown one)."""
    return _index()[(setting, layer, release)]


def applies(setting: str, layer: str, release: str = PLANNER_RELEASE) -> bool:
    return cell(setting, layer, release).verdict == "applies"


def because(setting: str, layer: str, release: str = PLANNER_RELEASE) -> str:
    """One clause for a message: the class, what it does (the cell's note, a predicate), and where."""
    c = cell(setting, layer, release)
    classes = next(lay.classes[release] for lay in LAYERS if lay.key == layer)
    return f"megatron-core {release}'s {classes} {c.note or c.evidence.what} ({c.site.where})"
