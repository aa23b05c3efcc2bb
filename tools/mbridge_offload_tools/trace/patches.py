"""What megatron-core needs from a CUDA machine, given on a CPU-only host: every patch of the trace, in one place.

Applied only inside the trace's child process (:func:`apply`), never in the CLI or the MCP server. The trace runs
on *fake CPU tensors* (``FakeTensorMode``: shapes, dtypes and storages, no data) rather than fake CUDA tensors or the
meta device: on a CPU build of torch, fake CUDA tensors fail in ``embedding`` and in ``index_put_`` with a CPU
scalar, and the meta device has no storages to count. Sizes do not depend on the device, so a CPU storage counts the
bytes the GPU would hold. Each patch says why it is needed.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _cpu(device: Any) -> Any:
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, _CurrentDevice):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int):  # torch.cuda.current_device()'s index, passed as a device
        return "cpu"
    return device


MODE_TRACKER: list[Any] = []  # the tracker the device mode reports to (set by step.trace)
_IS_CUDA = torch._C.TensorBase.__dict__["is_cuda"]
_NAMED = frozenset(("type", "cuda", "cpu", "pin_memory", "is_pinned", "to"))  # what the device mode answers by name


class _CurrentDevice(str):
    """What ``torch.cuda.current_device()`` answers: the string ``"cpu"`` (so that a factory run where the device
    mode is not active, as in autograd's backward, still makes a CPU fake tensor), marked as the GPU for the mode.
    Formatted as the index 0: Megatron-FSDP builds ``torch.device(f"cuda:{torch.cuda.current_device()}")``."""

    def __format__(self, spec: str) -> str:
        return format(0, spec)


def _device_kind(device: Any) -> str | None:
    """ "host" for an explicit CPU device string, "device" for the GPU, None when it does not say."""
    if device is None:
        return None
    if isinstance(device, (int, _CurrentDevice)):
        return "device"
    if isinstance(device, torch.device):  # torch.device(torch.cuda.current_device()) loses the mark: not host
        return "device" if device.type == "cuda" else None
    text = str(device)
    return "device" if text.startswith("cuda") else "host" if text.startswith("cpu") else None


class CpuForCuda(TorchFunctionMode):
    """Every ``device="cuda"`` argument becomes ``"cpu"``: megatron-core builds its causal mask, its DDP buffers and
    its schedule's counters on ``"cuda"`` (``torch.cuda.current_device()``), and ``tensor.cuda()`` /
    ``.to("cuda")`` would need a CUDA build. With a tracker, it also keeps the GPU/host split that the CPU side of
    optimizer offload needs (every fake tensor is a CPU tensor): ``.cpu()``, ``pin_memory``, ``.to("cpu")`` and an
    explicit ``device="cpu"`` make host tensors (a copy when the source is on the GPU), ``.cuda()`` / ``.to("cuda")``
    of a host tensor makes a GPU copy, and ``Tensor.is_cuda`` answers from that split (HybridDeviceOptimizer sorts
    parameters by it)."""

    def __init__(self, tracker: Any = None) -> None:
        super().__init__()
        self.tracker = tracker

    def _moved(self, src: Any, where: str) -> Any:
        """``src`` on ``where``: itself when it is there already, else a copy counted there."""
        tracker = self.tracker
        if tracker is None or tracker.is_host(src) == (where == "host"):
            return src
        tracker.force = where
        try:
            return src.clone()
        finally:
            tracker.force = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not kwargs and name not in _NAMED and getattr(func, "__self__", None) is not _IS_CUDA:
            return func(*args)  # no device to move, no host copy to make: most calls, at once
        kwargs = dict(kwargs or {})
        tracker = self.tracker
        if getattr(func, "__self__", None) is _IS_CUDA:
            return tracker is None or not tracker.is_host(args[0])
        if name == "type" and len(args) == 1 and not kwargs:
            # megatron-core's optimizers sort parameters by Tensor.type() == "torch.cuda.BFloat16Tensor".
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if name == "cuda":
            return self._moved(args[0], "device")
        if name in ("cpu", "pin_memory"):
            return self._moved(args[0], "host")
        if name == "is_pinned":
            return tracker is not None and tracker.is_host(args[0])
        if (
            name == "to"
            and len(args) > 1
            and _device_kind(args[1]) is not None
            and not isinstance(args[1], torch.dtype)
        ):
            return self._moved(args[0], _device_kind(args[1]) or "device")
        where = _device_kind(kwargs.get("device"))
        if kwargs.pop("pin_memory", False):
            where = "host"
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if name == "to" and where is not None and args and isinstance(args[0], torch.Tensor):
            return self._moved(func(*args, **{k: v for k, v in kwargs.items() if k != "device"}), where)
        if tracker is None or where is None:
            return func(*args, **kwargs)
        tracker.force = where
        try:
            return func(*args, **kwargs)
        finally:
            tracker.force = None


class _NullStream:
    """``torch.cuda.Stream`` stand-in: work is ordered on one host thread, so every stream is the current one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> _NullEvent:
        return _NullEvent()

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


class _NullEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def _null_context(*args: Any, **kwargs: Any) -> Any:
    yield


class _NoFp8:
    """TE's FP8GlobalStateManager outside an FP8 autocast (the traced runs compute in bf16: FP8 is refused)."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe() -> None:
        return None


def _patch(owner: Any, name: str, value: Any) -> None:
    """Replace ``owner.name`` (typed attributes of torch and megatron-core included) with ``value``."""
    setattr(owner, name, value)


class _Done:
    """A finished communication handle."""

    def wait(self) -> None:
        pass


@contextlib.contextmanager
def _one_by_one(*args: Any, **kwargs: Any) -> Any:
    yield _Done()


class _InPlaceWgrad:
    """apex/TE's ``fused_weight_gradient_mlp_cuda``: accumulates ``input^T @ grad`` into ``main_grad`` in place."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: Any, grad_output: Any, main_grad: Any) -> None:
        return None

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: Any, grad_output: Any, main_grad: Any) -> None:
        return None


def _recompute_storages() -> None:
    """megatron-core's CheckpointWithoutOutput (moe_act, mla_up_proj, layernorm recompute) frees a checkpointed output
    with ``untyped_storage().resize_(0)`` and grows it back in backward: the storage object lives on, so the tracker
    hears of the new size when it is resized, not when the storage dies."""
    resize = torch.UntypedStorage.resize_

    def resize_(self: Any, size: int) -> Any:
        out = resize(self, size)
        for tracker in MODE_TRACKER:
            tracker.resized(self)
        return out

    _patch(torch.UntypedStorage, "resize_", resize_)
    from megatron.core.tensor_parallel import random as tp_random

    if hasattr(tp_random, "_get_share_storage"):
        # 0.19.2 points the freed output's storage at the recomputed output's with a C++ extension it compiles at
        # the first recompute (load_inline: a compiler, minutes, a build cache in the user's home). The bytes are
        # the recomputed output's, already counted; the freed storage stays at 0 bytes.
        _patch(tp_random, "_get_share_storage", lambda: lambda output, recomputed: None)


def apply() -> None:
    """Patch torch.cuda and megatron-core for the trace (module docstring); call once, in the child only."""
    import torch._dynamo

    # megatron-core's fusions are torch.compile'd (jit_fuser); compiled code runs real kernels, which a fake tensor
    # cannot feed (a segfault). Dynamo skipped them while the tracker was a user dispatch mode; it is the fake mode
    # itself now (trace.tracker), so they run eagerly, as before, by switching Dynamo off.
    torch._dynamo.config.disable = True
    cuda = torch.cuda
    # megatron-core asks for the current device by index to place buffers (utils.get_tensor, DDP buffers,
    # VocabParallelEmbedding); an int index fails on a CPU build ("Cannot access accelerator device"). A "cpu"
    # string marked as the GPU (_CurrentDevice) places it on the CPU and tells the device mode it belongs on the GPU.
    _patch(cuda, "current_device", lambda: _CurrentDevice("cpu"))
    # Streams and events order copies on a GPU; on one host thread everything is already in order.
    _patch(cuda, "Stream", _NullStream)
    _patch(cuda, "Event", _NullEvent)
    _patch(cuda, "current_stream", lambda *a, **k: _NullStream())
    _patch(cuda, "default_stream", lambda *a, **k: _NullStream())
    _patch(cuda, "stream", _null_context)
    _patch(cuda, "synchronize", lambda *a, **k: None)
    # Nothing to free or measure on a device that is not there.
    _patch(cuda, "empty_cache", lambda: None)
    _recompute_storages()
    import torch.distributed as dist

    def all_gather_object(out: list[Any], obj: Any, group: Any = None) -> None:
        out[:] = [obj] * len(out)

    # Pickled objects travel as byte tensors whose sizes are read with .item(), which a fake tensor cannot answer;
    # with the fake group every rank is this one, so every rank's object is this rank's.
    _patch(dist, "all_gather_object", all_gather_object)
    from megatron.core.distributed import param_and_grad_buffer

    # DDP batches its bucket collectives in torch's _coalescing_manager, whose coalesced c10d ops have no fake-tensor
    # kernel; one by one (each has one) they write the same preallocated buffers, which is all the trace counts.
    _patch(param_and_grad_buffer, "_coalescing_manager", _one_by_one)
    apply_standins()
    apply_moe()
    from megatron.core.optimizer import clip_grads, optimizer

    # The gradient norm is read as a Python float (local_multi_tensor_l2_norm: float(l2_reduced)), which a fake
    # tensor cannot give. Its memory is one scalar per tensor (apex/TE's fused kernel on a GPU); the norm is 1.0.
    for module in (clip_grads, optimizer):
        _patch(module, "get_grad_norm_fp32", lambda *a, **k: 1.0)
    from megatron.core.tensor_parallel import layers

    # Bridge switches gradient_accumulation_fusion on wherever apex/TE's fused_weight_gradient_mlp_cuda is
    # installed (GPTModelProvider: fusions.can_enable_gradient_accumulation_fusion), so on every GPU run a linear's
    # weight gradient is accumulated into main_grad by that kernel, in place, with no weight-sized temporary
    # (tensor_parallel/layers.py, wgrad_gemm_accum_fp32/fp16). The kernel allocates nothing: in-place no-ops.
    _patch(layers, "_grad_accum_fusion_available", True)
    _patch(layers, "fused_weight_gradient_mlp_cuda", _InPlaceWgrad)
    from megatron.core.tensor_parallel import random

    # The RNG tracker forks CUDA RNG state around dropout in TP regions; a fake tensor draws no numbers.
    _patch(random.CudaRNGStatesTracker, "fork", _null_context)
    # Recompute (CheckpointFunction) saves and restores the CUDA RNG state around the rebuilt forward; the CPU
    # generator's state (a few KiB, as on a GPU) stands in for it.
    _patch(random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    _patch(random, "_set_cuda_rng_state", lambda *a, **k: None)
    # The rebuilt forward runs inside autograd's backward, where the device mode above is not active.
    backward = random.CheckpointFunction.backward

    def checkpoint_backward(ctx: Any, *args: Any) -> Any:
        with CpuForCuda(MODE_TRACKER[0] if MODE_TRACKER else None):
            return backward(ctx, *args)

    _patch(random.CheckpointFunction, "backward", staticmethod(checkpoint_backward))
    _patch(cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    _patch(cuda, "set_rng_state", lambda *a, **k: None)


def apply_standins() -> None:
    """Only the Transformer Engine stand-ins (``trace.standins``: norms and FusedAdam; attention goes in through the
    layer spec): what ``apply`` patches for TE, and all that a real GPU run of the same model needs
    (``benchmarks/gpu_trace_check.py`` runs it on CUDA tensors to hold the trace to the GPU's allocator)."""
    import megatron.core.optimizer as optimizers
    import standins

    # Every Bridge run has TE, so megatron-core builds TE's FusedAdam (in-place multi-tensor kernel); without TE it
    # falls back to torch's AdamW, whose temporaries no Bridge run has: TE's state and no temporaries instead.
    _patch(optimizers, "USING_PYTORCH_OPTIMIZER", False)
    _patch(optimizers, "Adam", standins.FusedAdamStandIn)
    from megatron.core.optimizer import distrib_optimizer

    _patch(distrib_optimizer, "Adam", standins.FusedAdamStandIn)  # its isinstance check
    from megatron.core.optimizer import optimizer_config

    for module in (optimizers, optimizer_config):
        _patch(module, "is_te_min_version", te_min_version)
    from megatron.core.transformer import torch_norm

    def norm_new(cls: Any, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        # The local spec's norm is torch's (WrappedTorchNorm), which refuses sequence parallelism and keeps fp32
        # intermediates no TE or apex kernel keeps: TE's saved tensors instead (trace.standins.NormStandIn).
        return standins.NormStandIn(config, hidden_size)

    _patch(torch_norm.WrappedTorchNorm, "__new__", norm_new)
    # megatron-core's CheckpointWithoutOutput (moe_act, mla_up_proj, layernorm recompute) sets ``self.fp8 = fp8 is
    # not None``, so its default fp8=False asks TE's FP8GlobalStateManager whether FP8 is on: with TE it answers no
    # (bf16 runs), without TE the name is undefined. The answer TE gives, and TE's no-op context for it.
    from megatron.core.tensor_parallel import random as tp_random

    if not getattr(tp_random, "HAVE_TE", True):
        _patch(tp_random, "FP8GlobalStateManager", _NoFp8)
        _patch(tp_random, "activation_recompute_forward", _null_context)
        _patch(tp_random, "fp8_autocast", _null_context)
    # cross_entropy_fusion_impl: te (Bridge's recipes): TE's fused cross entropy, as TE keeps it (trace.standins)
    from megatron.core.models.common.language_module import language_module

    _patch(language_module, "te_parallel_cross_entropy", standins.te_parallel_cross_entropy)


def te_min_version(version: str, check_equality: bool = True) -> bool:
    """megatron-core's ``is_te_min_version`` for the optimizer's modules, answered for the TE release the stand-ins
    follow (``standins.TE_VERSION``) rather than 0.0.0 (no TE here): megatron-core passes ``store_param_remainders``
    to FusedAdam from TE 2.1 on."""
    import standins

    wanted = tuple(int(part) for part in version.split(".")[:2])
    have = tuple(standins.TE_VERSION)
    return have >= wanted if check_equality else have > wanted


@contextlib.contextmanager
def te_fused_adam_importable() -> Iterator[None]:
    """While megatron-core's ``OptimizerConfig`` is built: ``transformer_engine.pytorch.optimizers.FusedAdam`` is the
    stand-in, for the precision-aware optimizer's check that TE's FusedAdam takes its dtype arguments. Only then:
    a ``transformer_engine`` module left in ``sys.modules`` would make other megatron-core code believe TE is here."""
    import types

    import standins

    names = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.optimizers")
    if any(n in sys.modules for n in names):
        yield
        return
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    sys.modules[names[-1]].FusedAdam = standins.FusedAdamStandIn  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for n in names:
            sys.modules.pop(n, None)


def balanced_counts(tokens: int, topk: int, experts: int) -> list[int]:
    """Tokens each expert receives from one rank under balanced routing: ``tokens·topk`` (token, expert) pairs spread
    over the experts as evenly as integers allow (the first experts take the remainder, so the traced rank, whose
    local experts come first, is the busiest). What the planner assumes, with ``moe_router_force_load_balancing``'s
    even spread."""
    pairs = tokens * topk
    return [pairs // experts + (1 if e < pairs % experts else 0) for e in range(experts)]


def _balanced_preprocess(original: Any) -> Any:
    """``MoEAlltoAllTokenDispatcher.preprocess`` with balanced routing (:func:`balanced_counts`).

    The dispatcher reads its all-to-all splits and each local expert's token count from the routing map's values
    (``routing_map.sum(0)``, then ``.cpu()`` / ``.tolist()`` / ``.numpy()``), which a fake tensor does not have. Its
    own code runs first (what it allocates is counted); then every count it would have read is set to the balanced
    one as host values: the all-to-all splits as lists, the per-chunk counts and chunk orders as numpy arrays (what
    megatron-core's own ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` gives), with every fake rank routing like
    this one. The permuted tokens are ``tokens·topk`` rows whatever the split (dropless), so only the split moves."""
    import numpy as np

    def preprocess(self: Any, routing_map: Any) -> Any:
        counts = original(self, routing_map)
        if self.drop_and_pad:  # capacity-padded: static counts already
            return counts
        tp, ep, local = self.tp_size, self.ep_size, self.num_local_experts
        per = balanced_counts(int(routing_map.size(0)), self.config.moe_router_topk, self.num_experts)
        mine = per[self.local_expert_indices[0] : self.local_expert_indices[-1] + 1]
        self.num_out_tokens = int(routing_map.size(0)) * self.config.moe_router_topk
        self.input_splits = [sum(per[j * local : (j + 1) * local]) for j in range(ep)]
        self.output_splits = [sum(mine)] * ep
        self.output_splits_tp = np.array([ep * sum(mine)] * tp)
        self.num_global_tokens_per_local_expert = np.array([mine] * (tp * ep))
        chunks = np.arange(self.num_experts * tp)
        self.sort_input_by_local_experts = chunks.reshape(-1, local).T.ravel()
        self.restore_output_by_local_experts = chunks.reshape(local, -1).T.ravel()
        if ep == 1 and tp == 1:
            self.input_splits = self.output_splits = self.output_splits_tp = None
        return np.array([tp * ep * n for n in mine])

    return preprocess


def _counted_permute(original: Any) -> Any:
    """``moe_utils.permute`` with its ``masked_select`` sized: megatron-core 0.16.1 selects the routed (token,
    expert) pairs with ``masked_select`` (0.19.2 with a fixed-shape argsort), whose output size is the mask's count
    of ones; under balanced dropless routing that is ``num_out_tokens`` (``tokens·topk``), which the tracker gives."""

    def permute(tokens: Any, routing_map: Any, *args: Any, **kwargs: Any) -> Any:
        tracker = MODE_TRACKER[0] if MODE_TRACKER else None
        count = kwargs.get("num_out_tokens", args[1] if len(args) > 1 else None)
        if tracker is None or count is None:
            return original(tokens, routing_map, *args, **kwargs)
        tracker.selected = int(count)
        try:
            return original(tokens, routing_map, *args, **kwargs)
        finally:
            tracker.selected = None

    return permute


class _SortedChunks(torch.autograd.Function):
    """What ``moe_utils.sort_chunks_by_idxs`` allocates, in one node: its ``torch.cat`` of the input's chunks in
    another order is one new tensor of the input's shape (the chunks are views); autograd keeps sizes only (cat's and
    split's backward save no tensor), and backward's ``split_with_sizes_backward`` concatenates the gradient's views
    into one new tensor of the input's shape."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.shape = x.shape
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.new_empty(ctx.shape)


def _sorted_chunks(original: Any) -> Any:
    """``sort_chunks_by_idxs`` with its allocations only (:class:`_SortedChunks`): it splits the tokens into one chunk
    per expert and rank (``experts x TP``: 256 for Qwen3-30B-A3B at TP 2) and concatenates them again, in forward,
    in recompute and in backward; each of those is a fake tensor made and dispatched, per MoE layer and micro-batch.
    The full path when the tracker's fast paths are off (held to it by tests/tools/test_trace.py)."""

    def sort_chunks_by_idxs(
        input: Any, split_sizes: Any, sorted_idxs: Any, probs: Any = None, fused: bool = False
    ) -> Any:
        tracker = MODE_TRACKER[0] if MODE_TRACKER else None
        sizes = [int(n) for n in split_sizes.tolist()]
        order = sorted(int(i) for i in sorted_idxs.tolist())
        if fused or tracker is None or not tracker.fast or order != list(range(len(sizes))):
            return original(input, split_sizes, sorted_idxs, probs=probs, fused=fused)
        if sum(sizes) != input.shape[0] or (probs is not None and sum(sizes) != probs.shape[0]):
            return original(input, split_sizes, sorted_idxs, probs=probs, fused=fused)
        return _SortedChunks.apply(input), (None if probs is None else _SortedChunks.apply(probs))

    return sort_chunks_by_idxs


def apply_moe() -> None:
    """Balanced routing for megatron-core's alltoall token dispatcher (:func:`_balanced_preprocess`): its counts are
    host values from the start, so its device-to-host copy point hands them on as they are."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # megatron-core 0.16.1 imports te_general_gemm only with Transformer Engine and then reads the name without a
    # guard in the router's gating GEMM (NameError without TE); None takes its torch path, as 0.19.2 does without TE.
    if not hasattr(moe_utils, "te_general_gemm"):
        _patch(moe_utils, "te_general_gemm", None)
    _patch(token_dispatcher, "permute", _counted_permute(moe_utils.permute))
    _patch(token_dispatcher, "sort_chunks_by_idxs", _sorted_chunks(moe_utils.sort_chunks_by_idxs))
    _grouped_experts()
    cls = token_dispatcher.MoEAlltoAllTokenDispatcher
    _patch(cls, "preprocess", _balanced_preprocess(cls.preprocess))
    _patch(cls, "_maybe_dtoh_and_synchronize", lambda self, point, tokens_per_expert=None: tokens_per_expert)
    # The host copies above are recorded on a stream in megatron-core (record_stream): streams are null here.
    _patch(torch.Tensor, "record_stream", lambda self, *a, **k: None)


def _grouped_experts() -> None:
    """``moe_grouped_gemm`` builds what megatron-core's TE backend builds for it (``TESpecProvider``:
    ``TEGroupedMLP`` over ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``), with the grouped
    linears stood in (``standins.GroupedLinearStandIn``); without it, the local ``SequentialMLP``. The local backend
    would build the legacy ``GroupedMLP`` (0.16.1, which needs the grouped_gemm package) or ``SequentialMLP`` (0.19.2)
    whatever the flag says: no Bridge recipe runs either of them for ``moe_grouped_gemm``."""
    import inspect
    from functools import partial

    import standins
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.moe import experts

    original = LocalSpecProvider.grouped_mlp_modules
    fc1, fc2 = standins.GroupedLinearStandIn, standins.RowGroupedLinearStandIn
    if len(inspect.signature(original).parameters) > 2:  # 0.16.1: (module, submodules)

        def legacy(self: Any, grouped: bool, legacy_grouped: bool) -> Any:
            if not grouped:
                return original(self, grouped, legacy_grouped)
            from megatron.core.transformer.mlp import MLPSubmodules

            return experts.TEGroupedMLP, MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)

        _patch(LocalSpecProvider, "grouped_mlp_modules", legacy)
        return

    def builder(self: Any, grouped: bool) -> Any:  # 0.19.2: a builder
        if not grouped:
            return original(self, grouped)
        return partial(experts.TEGroupedMLP, submodules=experts.GroupedMLPSubmodules(linear_fc1=fc1, linear_fc2=fc2))

    _patch(LocalSpecProvider, "grouped_mlp_modules", builder)
