"""Megatron Bridge's ``ConfigContainer.validate()`` on the keys we read, with Bridge's own messages.

Read from Bridge 0.3.1 and 0.6.2's ``training/config.py``, in the order ``validate()`` runs them, after
``finalize()``. Bridge configs only (``Context.container``); its fine-grained checks are in
``rules/activation/build.py``, and checks on sections we do not read are not here.
"""

from __future__ import annotations

from typing import Any

from mbridge_offload.config.bridge import mixed_precision_section
from mbridge_offload.config.rules.base import STAGE_BRIDGE, Context, Match, Rule
from mbridge_offload.config.rules.mcore import given

_SYNC = "_validate_and_sync_distributed_optimizer_settings"


def _bridge(ctx: Context) -> bool:
    return ctx.container and ctx.frontend != "megatron-lm"


def _section(ctx: Context, name: str) -> dict[str, Any]:
    body = ctx.raw.get(name) if isinstance(ctx.raw, dict) else None
    return body if isinstance(body, dict) else {}


def _mxfp8_reuse(ctx: Context) -> bool:
    mp = mixed_precision_section(ctx.raw) if _bridge(ctx) else None
    fsdp = ctx.config.ddp.use_megatron_fsdp or bool(_section(ctx, "dist").get("use_megatron_fsdp"))
    return bool(mp and not fsdp and mp.get("fp8_param_gather") and mp.get("fp8_recipe") == "mxfp8") and not (
        mp or {}
    ).get("reuse_grad_buf_for_mxfp8_param_ag")


def _deterministic_fusion(ctx: Context) -> bool:
    return (
        _bridge(ctx)
        and bool(given(ctx, "deterministic_mode", False))
        and bool(given(ctx, "cross_entropy_loss_fusion", False))
    )


def _sync(ctx: Context, key: str):
    if not _bridge(ctx):
        return None
    ddp, opt = bool(getattr(ctx.config.ddp, key)), bool(getattr(ctx.opt, key))
    return Match({"ddp": ddp, "opt": opt}) if ddp != opt else None


def _both_precisions(section: str):
    def check(ctx: Context) -> bool:
        body = getattr(ctx.config, section)
        return _bridge(ctx) and bool(body.bf16) and bool(body.fp16)

    return check


def _precision_aware(ctx: Context):
    m, o = ctx.model, ctx.opt
    if not _bridge(ctx) or not o.use_precision_aware_optimizer or (m.bf16 and m.fp16) or (o.bf16 and o.fp16):
        return None  # the both-precisions asserts come first
    if m.bf16 and not o.bf16:
        return Match(message="optimizer.bf16=True must be set when model.bf16=True and use_precision_aware_optimizer"
                     "=True.", fix=["optimizer.bf16=true"])  # fmt: skip
    if m.fp16 and not o.fp16:
        return Match(message="optimizer.fp16=True must be set when model.fp16=True and use_precision_aware_optimizer"
                     "=True.", fix=["optimizer.fp16=true"])  # fmt: skip
    if not m.bf16 and not m.fp16 and (o.bf16 or o.fp16):
        return Match(fix=["optimizer.bf16=false", "optimizer.fp16=false"])
    return None


def _full_iteration(ctx: Context) -> bool:
    """Bridge's ``is_full_iteration_cuda_graph`` after the model's finalize(): 0.6 reads cuda_graph_impl
    full_iteration (or local with the old scope); it clears the scopes of an impl of none before megatron-core could
    migrate them. 0.3 reads local with the scope full_iteration."""
    impl, scopes = ctx.cuda_graph_impl, ctx._scopes()
    if ctx.target.version >= (0, 19, 0):
        if ctx.model.cuda_graph_impl == "none" and not (ctx.model.enable_cuda_graph or ctx.model.external_cuda_graph):
            return False
        return impl == "full_iteration" or (impl == "local" and "full_iteration" in scopes)
    return impl == "local" and "full_iteration" in scopes


def _nan_check(ctx: Context) -> bool:
    checked = _section(ctx, "rerun_state_machine").get("check_for_nan_in_loss", True)
    return _bridge(ctx) and _full_iteration(ctx) and bool(checked)


def _cp_seq_length(ctx: Context):
    cp, seq = ctx.model.context_parallel_size, ctx.model.seq_length
    if not _bridge(ctx) or not isinstance(cp, int) or cp <= 1 or not isinstance(seq, int):
        return None
    return Match({"seq": seq, "cp": cp}) if seq % (cp * 2) else None


def _seq_length_match(ctx: Context):
    model, data = ctx.model.seq_length, ctx.config.dataset.seq_length
    if not _bridge(ctx) or model is None or data is None or model == data:
        return None
    return Match({"model": model, "data": data})


def _rule(id: str, message: str, check, summary: str, keys: tuple[str, ...], **kw) -> Rule:
    return Rule(
        id=id,
        severity=kw.pop("severity", "error"),
        origin="bridge",
        stage=STAGE_BRIDGE,
        exception=kw.pop("exception", "AssertionError"),
        summary=summary,
        keys=keys,
        message=message,
        why=kw.pop("why", "Megatron Bridge's ConfigContainer.validate() asserts it at start-up (0.3.x and 0.6.x)."),
        check=check,
        **kw,
    )


_PAO = "optimizer.use_precision_aware_optimizer"
RULES: tuple[Rule, ...] = (
    _rule(
        "CFG-BRIDGE-MXFP8-REUSE-GRAD-BUF",
        "When fp8_param_gather=True and fp8_recipe='mxfp8', reuse_grad_buf_for_mxfp8_param_ag must be set to True",
        _mxfp8_reuse,
        "MXFP8 with FP8 parameter gather needs `reuse_grad_buf_for_mxfp8_param_ag` (Bridge 0.6, not FSDP).",
        ("mixed_precision.fp8_param_gather", "mixed_precision.fp8_recipe"),
        applies_to=">=0.19",
        fix=("++mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=true",),
        why="Bridge 0.6's ConfigContainer.validate() asserts it outside Megatron-FSDP; Bridge 0.3 has no such check.",
    ),
    _rule(
        "CFG-BRIDGE-DETERMINISTIC-CE-FUSION",
        "Cross Entropy Fusion is currently not deterministic.",
        _deterministic_fusion,
        "Deterministic mode excludes cross-entropy loss fusion (Bridge).",
        ("model.deterministic_mode", "model.cross_entropy_loss_fusion"),
        fix=("model.cross_entropy_loss_fusion=false",),
        why="Bridge's _validate_and_apply_deterministic_mode (0.3.x and 0.6.x); it then asserts NCCL_ALGO is set in "
        "the job's environment, which a config does not show.",
    ),
    _rule(
        "CFG-BRIDGE-DIST-OPT-SYNC",
        "Distributed optimizer settings were not in sync: ddp.use_distributed_optimizer={ddp}, "
        "optimizer.use_distributed_optimizer={opt}. Automatically enabling distributed optimizer for both settings.",
        lambda ctx: _sync(ctx, "use_distributed_optimizer"),
        "The distributed optimizer on in one of ddp / optimizer: Bridge switches it on in both (a warning).",
        ("ddp.use_distributed_optimizer", "optimizer.use_distributed_optimizer"),
        severity="warning",
        exception=None,
        fix=("ddp.use_distributed_optimizer=true", "optimizer.use_distributed_optimizer=true"),
        why=f"Bridge's {_SYNC} (0.3.x and 0.6.x) warns and enables both; it asserts nothing. Megatron-LM sets both "
        "from one flag; a plain megatron-core setup keeps them as written.",
    ),
    _rule(
        "CFG-BRIDGE-OVERLAP-PARAM-GATHER-SYNC",
        "overlap_param_gather settings were not in sync: ddp.overlap_param_gather={ddp}, "
        "optimizer.overlap_param_gather={opt}. Automatically enabling overlap_param_gather for both settings.",
        lambda ctx: _sync(ctx, "overlap_param_gather"),
        "`overlap_param_gather` on in one of ddp / optimizer: Bridge 0.6 switches it on in both (a warning).",
        ("ddp.overlap_param_gather", "optimizer.overlap_param_gather"),
        severity="warning",
        exception=None,
        applies_to=">=0.19",
        fix=("ddp.overlap_param_gather=true", "optimizer.overlap_param_gather=true"),
        why=f"Bridge 0.6's {_SYNC} warns and enables both; Bridge 0.3 leaves them as written.",
    ),
    _rule(
        "CFG-BRIDGE-MODEL-BF16-FP16",
        "Model config cannot have both bf16=True and fp16=True. Please set only one precision mode.",
        _both_precisions("model"),
        "`model.bf16` and `model.fp16` exclude each other (Bridge).",
        ("model.bf16", "model.fp16"),
        fix=("model.fp16=false",),
    ),
    _rule(
        "CFG-BRIDGE-OPTIMIZER-BF16-FP16",
        "Optimizer config cannot have both bf16=True and fp16=True. Please set only one precision mode.",
        _both_precisions("optimizer"),
        "`optimizer.bf16` and `optimizer.fp16` exclude each other (Bridge).",
        ("optimizer.bf16", "optimizer.fp16"),
        fix=("optimizer.fp16=false",),
    ),
    _rule(
        "CFG-BRIDGE-PRECISION-AWARE-DTYPE",
        "optimizer.bf16 and optimizer.fp16 must both be False when model is using fp32 precision (model.bf16=False, "
        "model.fp16=False) and use_precision_aware_optimizer=True.",
        _precision_aware,
        "With the precision-aware optimizer, the optimizer's bf16/fp16 must match the model's (Bridge).",
        ("model.bf16", "model.fp16", "optimizer.bf16", "optimizer.fp16", _PAO),
        why="Bridge's _validate_mixed_precision_consistency (0.3.x and 0.6.x). A mixed_precision section copies the "
        "same values into both, so this meets configs that set precision per section.",
    ),
    _rule(
        "CFG-BRIDGE-FULL-ITERATION-NAN-CHECK",
        "check_for_nan_in_loss must be disabled when using full_iteration CUDA graph. "
        "Set rerun_state_machine.check_for_nan_in_loss=False.",
        _nan_check,
        "The full-iteration CUDA graph needs `rerun_state_machine.check_for_nan_in_loss: false` (Bridge).",
        ("model.cuda_graph_impl", "model.cuda_graph_scope", "rerun_state_machine.check_for_nan_in_loss"),
        fix=("++rerun_state_machine.check_for_nan_in_loss=false",),
        why="Bridge's ConfigContainer.validate() asserts it; the check is on by default (RerunStateMachineConfig). "
        "Bridge 0.6 reads cuda_graph_impl=full_iteration, Bridge 0.3 cuda_graph_impl=local with the scope "
        "full_iteration. This is the one CUDA graph megatron-core 0.19 allows with layer-level offloading.",
    ),
    _rule(
        "CFG-BRIDGE-CP-SEQ-LENGTH",
        "Sequence length must be divisible by 2 * context parallel size if context parallel is used.",
        _cp_seq_length,
        "With context parallelism, `model.seq_length` must be a multiple of 2 × CP (Bridge).",
        ("model.seq_length", "model.context_parallel_size"),
        why="Bridge's ConfigContainer.validate() (0.3.x and 0.6.x): each CP rank takes two chunks of the sequence.",
    ),
    _rule(
        "CFG-BRIDGE-SEQ-LENGTH-MATCH",
        "Please ensure sequence length configuration in model config and dataset config match.\n"
        "Sequence length in model config: {model}, Sequence length in dataset config: {data}",
        _seq_length_match,
        "`model.seq_length` and `dataset.seq_length` must be equal (Bridge).",
        ("model.seq_length", "dataset.seq_length"),
        fix=("dataset.seq_length={model}",),
    ),
)
