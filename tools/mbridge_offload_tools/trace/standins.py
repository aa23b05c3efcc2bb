"""Transformer Engine stand-ins for the trace: modules whose *saved tensors* follow TE's source, nothing computed.

TE cannot be installed on a CPU host, and megatron-core's local attention (``DotProductAttention``) keeps the
``[b, heads, s, s]`` score and softmax matrices for backward, which no TE run does. Where the run uses TE (every
Bridge recipe), the trace uses these instead, in the child only. Each stand-in saves, through
``ctx.save_for_backward``, the tensors TE's own autograd function saves (``FACTS``, checked against TE's source by
``tests/tools/test_trace_standins.py``), with TE's shapes and dtypes; its outputs have the real shapes and are never
read (fake tensors).
"""

from __future__ import annotations

from typing import Any

import torch

# TE's source, per stand-in and release: the file, the autograd function, and the names its forward hands to
# ``save_for_backward`` (directly, or through ``prepare_for_saving(...)`` just before it). Checked against TE's git
# tags by ``tests/tools/test_trace_standins.py`` where a TransformerEngine checkout is given.
FACTS: dict[str, dict[str, Any]] = {
    "fused_attention": {
        "file": "transformer_engine/pytorch/attention/dot_product_attention/backends.py",
        "function": "FusedAttnFunc",
        # v2.9: qkvo_tensors = (q, k, v, out); v2.18: f16_tensors = (q, k, v, out_f16) outside FP8
        "saves": {"v2.9": ("*qkvo_tensors", "*aux_ctx_tensors"), "v2.18": ("*f16_tensors", "*aux_ctx_tensors")},
        "meaning": "q, k, v (GQA: k and v at the query-group count), the output, and aux_ctx_tensors: the softmax "
        "statistics (fp32, [b, heads, s_q, 1]) and the dropout RNG state (2 x int64)",
    },
    "rmsnorm": {
        "file": "transformer_engine/pytorch/ops/basic/rmsnorm.py",
        "function": "RMSNorm",
        "saves": {"v2.9": ("x", "rstdevs"), "v2.18": ("x", "rstdevs")},
        "meaning": "the norm's input, made contiguous (x = ... input_.contiguous() ...), and its fp32 reciprocal "
        "standard deviation per token",
    },
    "layernorm_linear": {
        "file": "transformer_engine/pytorch/module/layernorm_linear.py",
        "function": "_LayerNormLinear",
        "saves": {
            "v2.9": ("inputmat", "ln_out", "mu", "rsigma"),
            "v2.18": ("inputmat", "ln_out_to_save", "mu", "rsigma"),
        },
        "meaning": "the norm's input, the normalized output the GEMM reads (ln_out: the linear's saved input in "
        "megatron-core's local spec) and the statistics: the norm stand-in plus the local linear save the same",
    },
    "grouped_linear": {
        "file": "transformer_engine/pytorch/module/grouped_linear.py",
        "function": "_GroupedLinear",
        # v2.9 keeps the weights twice (weights_fp8 are the weights themselves outside FP8); v2.18 keeps
        # saved_weights only for its high-precision backward override (None otherwise)
        "saves": {
            "v2.9": ("*inputmats", "*weights_fp8", "*weights", "*biases"),
            "v2.18": ("*inputmats", "*weights_fp8", "*saved_weights", "*biases"),
        },
        "meaning": "the input split per GEMM (views of one tensor: one storage), the weights (no copy outside FP8) "
        "and biases; backward makes the input gradient, writes each weight's gradient into main_grad and hands "
        "autograd a dummy weight gradient (v2.18: get_dummy_wgrad, one cached tensor per shape and dtype)",
    },
}


# TE's FusedAdam (transformer_engine/pytorch/optimizers/fused_adam.py), the lines FusedAdamStandIn follows, per
# release: checked against TE's git tags by tests/tools/test_trace_standins.py where a checkout is given.
FUSED_ADAM_FACTS: dict[str, tuple[str, ...]] = {
    # the int16 remainders (store_param_remainders) and the fp32 copies of low-precision states held per group
    "v2.9": ("dtype=torch.int16", "unscaled_lists[name].append(unscaled)", "unscaled = state[state_name].float()"),
    # from v2.13: two bf16 moments are unscaled inside the kernel
    "v2.13": (
        "dtype=torch.int16",
        "unscaled_lists[name].append(unscaled)",
        "self.fuse_unscale = self.exp_avg_dtype == self.exp_avg_sq_dtype == torch.bfloat16",
    ),
    "v2.18": (
        "dtype=torch.int16",
        "unscaled_lists[name].append(unscaled)",
        "self.fuse_unscale = self.exp_avg_dtype == self.exp_avg_sq_dtype == torch.bfloat16",
    ),
}

# The Transformer Engine release the stand-ins follow where TE's allocations changed between releases: set for each
# traced spec from the run's ``te_version`` (trace/step.py; the planner's input, by default the release Megatron
# Bridge 0.6.2 pins).
TE_VERSION: tuple[int, ...] = (2, 17)


def _fsdp_main_grad(weight: Any) -> None:
    """Megatron-FSDP's ``main_grad`` of ``weight`` (``get_main_grad``, which TE calls from 2.10), fetched in the
    device mode: autograd's backward runs outside it, and the gradient bucket FSDP may allocate there is on "cuda"."""
    import patches

    with patches.CpuForCuda(patches.MODE_TRACKER[0] if patches.MODE_TRACKER else None):
        weight.main_grad = weight.get_main_grad()


class _Norm(torch.autograd.Function):
    """What TE's _LayerNorm / RMSNorm keeps for backward: its input, weight and the fp32 statistics per token."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # TE's RMSNorm op reads ``input_.contiguous()`` and saves that: a norm over a view (the key heads split out of
        # the QKV projection's output, under qk_layernorm) keeps its own copy, not the whole projection output
        x = x.contiguous()
        tokens = x.numel() // x.shape[-1]
        rsigma = x.new_empty(tokens, dtype=torch.float32)
        ctx.save_for_backward(x, weight, rsigma)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, weight, _rsigma = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight)


class NormStandIn(torch.nn.Module):
    """In place of TE's norms (and of megatron-core's WrappedTorchNorm, whose torch norm keeps fp32 copies): one
    weight (and a bias for LayerNorm), the saved tensors of TE's kernel."""

    def __init__(self, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.config = config
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype))
        self.bias = (
            torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype)) if config.normalization == "LayerNorm" else None
        )
        for param in (self.weight, self.bias):
            if param is not None:  # as megatron-core marks norm weights under sequence parallelism
                param.__dict__["sequence_parallel"] = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Norm.apply(x, self.weight)


class _FusedAttention(torch.autograd.Function):
    """What TE's FusedAttnFunc keeps for backward: q, k, v, out, softmax statistics, RNG state."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        sq, b, heads, _ = q.shape
        out = q.new_empty(sq, b, heads, v.shape[-1])  # MLA: the value's head dimension, not the query's
        stats = q.new_empty(b, heads, sq, 1, dtype=torch.float32)
        rng_state = q.new_empty(2, dtype=torch.int64)
        ctx.save_for_backward(q, k, v, out, stats, rng_state)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, _out, _stats, _rng = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class FusedAttentionStandIn(torch.nn.Module):
    """In place of ``TEDotProductAttention`` (constructor and forward as megatron-core's core attention takes them)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.config = config

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, *args: Any, **kw: Any
    ) -> torch.Tensor:
        if not all(x.is_contiguous() for x in (query, key, value)):
            # TE's get_qkv_layout (attention/dot_product_attention/utils.py) names a layout from the strides and
            # offsets; megatron-core's q/k (new tensors after RoPE) beside v (a slice of linear_qkv's output, its
            # strides unlike k's) match none, so TE makes all three contiguous: the saved v is a copy and the QKV
            # output is freed, not kept alive by the slice.
            query, key, value = (x.contiguous() for x in (query, key, value))
        cp = getattr(self.config, "context_parallel_size", 1)
        if cp > 1:  # TE's context-parallel attention (megatron-core's local one refuses CP > 1)
            from te_standins import context_parallel

            out = context_parallel.attention(query, key, value, cp)
        else:
            out = _FusedAttention.apply(query, key, value)
        sq, b, heads, dim = out.shape
        return out.view(sq, b, heads * dim)


class _Linear(torch.autograd.Function):
    """What TE's _Linear keeps and makes outside FP8: saves its input and weight; backward makes the input gradient
    and, with ``fuse_wgrad_accumulation``, writes the weight gradient into ``main_grad`` and hands autograd the cached
    dummy (as ``_GroupedLinear``)."""

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inp, weight)
        # TE keeps the weight's Python object (linear.py ``origin_weight_ref``): under saved-tensor hooks (activation
        # offload) the saved one comes back as a new tensor, without main_grad
        ctx.origin_weight = weight
        return inp.new_empty(*inp.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        inp, _ = ctx.saved_tensors
        weight = ctx.origin_weight
        if hasattr(weight, "__fsdp_param__"):  # Megatron-FSDP (TE >= 2.10): its gradient buffer's view
            _fsdp_main_grad(weight)
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            wgrad = _dummy_wgrad(grad, list(weight.main_grad.shape), weight.dtype)
        else:
            wgrad = torch.empty_like(weight)
        return torch.empty_like(inp), wgrad


class DuplicatedLinearStandIn(torch.nn.Module):
    """In place of megatron-core's ``TELinear`` with ``parallel_mode="duplicated"``: MLA's down projections under TE
    (``multi_latent_attention.py`` builds them duplicated when the spec names TELinear), the whole weight on every TP
    rank, the sequence-parallel shard in, no communication. megatron-core's local spec splits them over TP instead
    (``ColumnParallelLinear``, then a gather and a scatter), which no TE run does."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, parallel_mode: Any = None, **kw: Any) -> None:
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        # megatron-core's TELinear marks a duplicated weight under SP: its gradient is all-reduced over TP
        self.weight.__dict__["sequence_parallel"] = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        from te_standins import fp8

        if fp8.RECIPE is not None:  # TE's _Linear under FP8 (te_standins/fp8.py)
            return fp8.linear(x, self.weight), None
        return _Linear.apply(x, self.weight), None


class LayerNormColumnParallelLinearStandIn(torch.nn.Module):
    """In place of ``TELayerNormColumnParallelLinear`` where megatron-core asks the backend for a fused norm+linear
    (0.19.2's MLA resolver: the query projection without a query latent, under ``qk_layernorm``): the norm stand-in
    then megatron-core's own ``ColumnParallelLinear``, which keep what TE's ``_LayerNormLinear`` keeps
    (``FACTS["layernorm_linear"]``)."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, **kw: Any) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        self.norm = NormStandIn(config, input_size)
        known = (
            "init_method",
            "bias",
            "gather_output",
            "skip_bias_add",
            "is_expert",
            "tp_comm_buffer_name",
            "tp_group",
        )
        self.linear = ColumnParallelLinear(
            input_size, output_size, config=config, **{k: v for k, v in kw.items() if k in known}
        )

    @property
    def weight(self) -> torch.nn.Parameter:
        """The linear's weight, as TE's module has it (0.19.2's Mamba mixer tags ``in_proj.weight``)."""
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> Any:
        return self.linear(self.norm(x))


def use_te_mla_projections() -> None:
    """Make megatron-core's MLA build its projections as TE does: ``DuplicatedLinearStandIn`` is its TELinear (the
    down projections) and, where the release asks the backend for one (0.19.2), the local backend's fused
    norm+linear is ``LayerNormColumnParallelLinearStandIn``."""
    from megatron.core.models import backends
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.TELinear = DuplicatedLinearStandIn
    backends.LocalSpecProvider.column_parallel_layer_norm_linear = lambda self: LayerNormColumnParallelLinearStandIn


# The release from which TE's fused cross entropy keeps an fp32 gradient, and the lines that say so per release
# (checked against TE's git tags by tests/tools/test_trace_standins.py where a checkout is given).
CE_FP32_GRAD_FROM = (2, 18)
CROSS_ENTROPY_FACTS: dict[str, dict[str, tuple[str, ...]]] = {
    "v2.17": {
        "transformer_engine/pytorch/cross_entropy.py": ("ctx.save_for_backward(inp.detach())",),
        "transformer_engine/pytorch/triton/cross_entropy.py": ("return loss, _input",),
    },
    "v2.18": {
        "transformer_engine/pytorch/cross_entropy.py": ("ctx.save_for_backward(grad_input.detach())",),
        "transformer_engine/pytorch/triton/cross_entropy.py": (
            "grad_input = torch.empty_like(_input, dtype=torch.float32)",
        ),
    },
}


class _CrossEntropy(torch.autograd.Function):
    """What TE's CrossEntropyFunction keeps and makes: the per-token loss (fp32) and the logits' gradient, saved —
    written over the logits before 2.18, a new fp32 tensor from 2.18 (autograd casts it to the logits' dtype when
    backward hands it on)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = logits.contiguous()
        grad = torch.empty_like(logits, dtype=torch.float32) if TE_VERSION >= CE_FP32_GRAD_FROM else logits
        ctx.save_for_backward(grad.detach())
        return logits.new_empty(logits.shape[:-1], dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:
        (grad,) = ctx.saved_tensors
        return grad, None


def te_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """In place of megatron-core's ``te_parallel_cross_entropy`` (TE's ``parallel_cross_entropy``): ``[s, b]`` fp32
    losses of ``[s, b, V/TP]`` logits."""
    return _CrossEntropy.apply(logits, labels)


def use_te_attention(layer_spec: Any, config: Any) -> None:
    """Swap the local spec's core attention for the fused-attention stand-in (in place); under MLA, its down
    projections for TE's duplicated linear, and no query norm without a query latent (TE's spec has none there: the
    local spec sets both norms from ``qk_layernorm``, which megatron-core refuses without ``q_lora_rank``)."""
    from megatron.core.transformer.identity_op import IdentityOp

    attention = layer_spec.submodules.self_attention.submodules
    attention.core_attention = FusedAttentionStandIn
    if getattr(config, "multi_latent_attention", False):
        use_te_mla_projections()
        attention.linear_kv_down_proj = attention.linear_q_down_proj = DuplicatedLinearStandIn
        if config.q_lora_rank is None:
            attention.q_layernorm = IdentityOp


class FusedAdamStandIn(torch.optim.Optimizer):
    """In place of TE's FusedAdam (what megatron-core builds when TE is installed, as in every Bridge run), with the
    state TE makes (FUSED_ADAM_FACTS): ``exp_avg`` and ``exp_avg_sq`` per parameter in their configured dtypes
    (a one-element fp32 scale beside each that is not fp32), made at the first step, and with ``master_weights``
    (megatron-core's precision-aware optimizer) the master copy: only the 16 low bits as int16 where TE stores
    remainders (bf16 parameter, fp32 master, ``store_param_remainders``), else in the master dtype. Its multi-tensor
    kernel updates them in place; what it allocates during a step is the fp32 "unscaled" copy of every state that
    is not fp32, held for the whole parameter group (``unscaled_lists``), except bf16 moments from v2.13 on
    (``fuse_unscale``) and int16 remainders. torch's AdamW, megatron-core's fallback without TE or apex, would add
    per-parameter temporaries no Bridge run has."""

    # TE releases from which bf16 moments are unscaled inside the kernel (fused_adam.py ``fuse_unscale``: v2.13).
    FUSE_UNSCALE_FROM = (2, 13)

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        *,
        exp_avg_dtype: Any = None,
        exp_avg_sq_dtype: Any = None,
        master_weights: bool = False,
        master_weight_dtype: Any = None,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
        **kwargs: Any,
    ) -> None:
        # megatron-core's OptimizerConfig checks that TE's FusedAdam takes these four by name (precision-aware path)
        self.state_dtypes = {"exp_avg": exp_avg_dtype or torch.float32, "exp_avg_sq": exp_avg_sq_dtype or torch.float32}
        self.master_weights = bool(master_weights)
        master = master_weight_dtype or torch.float32
        if self.master_weights:
            self.state_dtypes["master_param"] = master
        self.use_decoupled_grad = bool(use_decoupled_grad)
        # TE: "Works only when master params is in FP32"; megatron-core passes the flag from TE 2.1 on.
        self.store_param_remainders = bool(store_param_remainders) and self.master_weights and master == torch.float32
        self.fuse_unscale = (
            TE_VERSION >= self.FUSE_UNSCALE_FROM
            and self.state_dtypes["exp_avg"] == self.state_dtypes["exp_avg_sq"] == torch.bfloat16
        )
        super().__init__(
            params, {"lr": lr, **{k: v for k, v in kwargs.items() if k in ("weight_decay", "betas", "eps")}}
        )

    def _remainders(self, p: torch.Tensor) -> bool:
        return self.store_param_remainders and p.dtype == torch.bfloat16

    def initialize_state(self, p: torch.Tensor, store_param_remainders: bool = False) -> None:
        """TE's ``initialize_state``: the moments (zeros), the master copy, a scale per low-precision state."""
        state = self.state[p]
        for name, dtype in self.state_dtypes.items():
            if name == "master_param" and store_param_remainders:
                state[name] = torch.zeros_like(p, dtype=torch.int16)
                continue
            state[name] = torch.zeros_like(p, dtype=dtype)
            if dtype != torch.float32:
                state[f"{name}_scale"] = p.new_ones(1, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            unscaled: list[torch.Tensor] = []  # TE's unscaled_lists: alive until the group's kernels have run
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    self.initialize_state(p, self._remainders(p))
                grad = getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad
                if grad is None:
                    continue
                for name, dtype in self.state_dtypes.items():
                    if dtype == torch.float32 or (dtype == torch.bfloat16 and self.fuse_unscale):
                        continue
                    unscaled.append(state[name].float())
            del unscaled


# TE's get_dummy_wgrad cache (module/base.py, v2.18): one tensor per (shape, dtype), kept for the whole run. Emptied
# by reset() for each traced spec (a batch traces many models, each under its own fake mode).
_DUMMY_WGRADS: dict[tuple[Any, ...], torch.Tensor] = {}


def reset() -> None:
    """Forget what a previous trace left in the stand-ins' caches."""
    _DUMMY_WGRADS.clear()


def _dummy_wgrad(like: torch.Tensor, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    key = (*shape, dtype)
    if key not in _DUMMY_WGRADS:
        _DUMMY_WGRADS[key] = like.new_empty(shape, dtype=dtype)
    return _DUMMY_WGRADS[key].detach()


class _GroupedLinear(torch.autograd.Function):
    """What TE's _GroupedLinear keeps and makes (FACTS["grouped_linear"], the per-GEMM path outside FP8): one
    output ``[tokens, out]``; saved: the input (TE's per-GEMM splits are views of it) and the weights; backward:
    the input gradient, the weight gradients into ``main_grad`` (no allocation) and a cached dummy per shape
    handed to autograd, the input's data cleared (``clear_tensor_data``) once the weight gradients are done."""

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, m_splits: list[int], module: Any, *params: torch.Tensor) -> Any:
        weights = params[: module.num_gemms]
        inp_view = inp.reshape(-1, inp.shape[-1])
        out = inp.new_empty(sum(m_splits), weights[0].shape[0])  # the biases are added inside the GEMM
        from te_standins import fp8

        ctx.fp8 = fp8.RECIPE is not None
        keep = fp8.grouped_saved_input(inp_view) if ctx.fp8 else [inp_view]  # FP8: te_standins/fp8.py
        for w in weights if ctx.fp8 else ():
            fp8.weight_cache(w)
        ctx.save_for_backward(*keep, *params)
        ctx.inp_shape, ctx.module, ctx.biases = inp.shape, module, len(params) - len(weights)
        return out.view(-1, *inp.shape[1:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        inp_view, *_ = ctx.saved_tensors
        weights = ctx.module.weights()
        grad = grad.contiguous()
        if ctx.fp8:  # the output gradient quantized with both usages while the GEMMs run
            from te_standins import fp8

            quantized = fp8.quantize(grad, tuple(grad.shape), 2)
        dgrad = grad.new_empty(inp_view.shape[0], weights[0].shape[1]) if ctx.needs_input_grad[0] else None
        wgrads: list[Any] = [None] * len(weights)
        if weights[0].requires_grad:
            if ctx.module.fuse_wgrad_accumulation:
                for i, w in enumerate(weights):  # TE's handle_custom_ddp_from_mcore
                    if hasattr(w, "__fsdp_param__"):  # Megatron-FSDP (TE >= 2.10): its gradient buffer's view
                        _fsdp_main_grad(w)
                    if hasattr(w, "grad_added_to_main_grad"):
                        w.grad_added_to_main_grad = True
                        wgrads[i] = _dummy_wgrad(grad, list(w.main_grad.shape), w.dtype)
            else:  # one packed buffer, a view per GEMM
                packed = grad.new_empty(len(weights), *weights[0].shape)
                wgrads = [packed[i] for i in range(len(weights))]
            inp_view.data = inp_view.new_empty(0)  # clear_tensor_data(*inputmats)
        if ctx.fp8:
            del quantized
        out = dgrad.view(ctx.inp_shape) if dgrad is not None else None
        bgrads = [grad.new_empty(weights[0].shape[0]) for _ in range(ctx.biases)]  # from the wgrad GEMM
        return (out, None, None, *wgrads, *bgrads)


class GroupedLinearStandIn(torch.nn.Module):
    """In place of megatron-core's ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` (TE's
    ``GroupedLinear``, what ``TEGroupedMLP`` builds for ``moe_grouped_gemm``): one parameter per expert
    (``weight0..weight{n-1}``, ``[out, in]`` split over expert-TP as megatron-core's wrapper splits it, with its
    expert attributes), one autograd node per GEMM group instead of one linear per expert."""

    parallel_mode = "column"

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = True,
        pg_collection: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        from megatron.core import parallel_state

        self.config, self.num_gemms = config, num_gemms
        tp = pg_collection.expt_tp.size() if pg_collection is not None else None
        tp = tp or parallel_state.get_expert_tensor_parallel_world_size()
        if self.parallel_mode == "column":
            output_size //= tp
        else:
            input_size //= tp
        self.fuse_wgrad_accumulation = config.gradient_accumulation_fusion
        self.te_return_bias = skip_bias_add and bias
        self.use_bias = bias
        for i in range(num_gemms):
            w = torch.empty(output_size, input_size, dtype=config.params_dtype)
            self.register_parameter(f"weight{i}", torch.nn.Parameter(w))
        for i in range(num_gemms if bias else 0):
            b = torch.empty(output_size, dtype=config.params_dtype)
            self.register_parameter(f"bias{i}", torch.nn.Parameter(b))
        _expert_attributes(self, self.parallel_mode, is_expert, config)

    def weights(self) -> list[torch.Tensor]:
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def forward(self, x: torch.Tensor, m_splits: Any) -> tuple[torch.Tensor, Any]:
        splits = [int(n) for n in (m_splits.tolist() if hasattr(m_splits, "tolist") else m_splits)]
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else []
        if self.te_return_bias:  # TE hands the biases back unapplied (megatron-core adds them, scaled by probs)
            return _GroupedLinear.apply(x, splits, self, *self.weights()), biases
        return _GroupedLinear.apply(x, splits, self, *self.weights(), *biases), None


class RowGroupedLinearStandIn(GroupedLinearStandIn):
    parallel_mode = "row"


def _expert_attributes(module: torch.nn.Module, parallel_mode: str, is_expert: bool, config: Any) -> None:
    """The expert attributes megatron-core's TE wrapper sets (``allreduce`` picks DDP's expert buffers): its own
    ``_set_expert_parameter_attributes`` where the release has one (0.19.2), else 0.16.1's rule."""
    expert_parallel = config.expert_model_parallel_size > 1
    try:
        from megatron.core.extensions.transformer_engine import _set_expert_parameter_attributes
    except ImportError:
        for p in module.parameters():
            p.__dict__["allreduce"] = not (is_expert and expert_parallel)
        return
    etp = config.expert_tensor_parallel_size
    use_expert_pgs = is_expert and (expert_parallel or etp != config.tensor_model_parallel_size)
    _set_expert_parameter_attributes(module, parallel_mode, use_expert_pgs)
