"""Adapters to real megatron-core: our activation offload in ``TransformerBlock``, and a tiny GPT on CPU.

Megatron Core takes its layer-level offload context from Transformer Engine: ``transformer_block.py`` binds
``get_cpu_offload_context`` from ``megatron.core.extensions.transformer_engine`` only ``if HAVE_TE``, else
leaves it ``None`` and asserts "CPU Offloading is enabled when TE is not present" in
``TransformerBlock.__init__``. :func:`install_activation_offload` rebinds that module global to our runtime
(``runtime.activation.get_cpu_offload_context`` behind an adapter that binds MCore's wrapper shape by name: six
positional arguments in 0.16.1, seven with ``retain_pinned_cpu_buffers`` in 0.19.2, while TE ≥ 2.10 — and our
runtime — put ``manual_synchronization`` seventh), so the block calls it exactly as it calls TE.

The block then stores the live context in ``config._cpu_offloading_context``. Its one reader is
``tensor_parallel/layers.py`` (Column/RowParallelLinear), which, inside the context, tags the linear input
with ``activation_offloading`` for TE's v1 algorithm, and without TE asserts "CPU Offloading cannot be
enabled while TE is not present". Our runtime (like TE v2) ignores those tags, so when TE is absent the
installer also wraps ``TransformerBlock.__init__`` to clear ``config._cpu_offloading_context`` after the
block is built; the context stays reachable as ``block.offload_context``. ``mlp.py`` only gates SwiGLU's tag
on ``HAVE_TE`` (no assert), so it needs nothing.

:func:`cpu_compat_shims` holds the two labelled shims that let a tiny ``GPTModel`` run forward and backward
on a CPU-only machine; :func:`build_tiny_gpt` builds one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mbridge_offload_runtime import activation

__all__ = [
    "ActivationOffloadInstall",
    "build_tiny_gpt",
    "cpu_compat_shims",
    "ensure_model_parallel",
    "install_activation_offload",
    "tiny_batch",
]


def _mcore_wrapper_shape(
    enabled: bool,
    num_layers: int,
    model_layers: int,
    activation_offloading: bool = True,
    weight_offloading: bool = False,
    double_buffering: bool = False,
    retain_pinned_cpu_buffers: bool = False,
) -> None:
    """The signature of ``megatron.core.extensions.transformer_engine.get_cpu_offload_context`` (0.16.1 has no
    ``retain_pinned_cpu_buffers``; 0.19.2 adds it seventh); used only to bind MCore's calls by name."""


_MCORE_WRAPPER = inspect.signature(_mcore_wrapper_shape)


# ---------------------------------------------------------------------------------------------------------
# install / uninstall
# ---------------------------------------------------------------------------------------------------------
class ActivationOffloadInstall:
    """The patches :func:`install_activation_offload` made; ``remove()`` (or leaving ``with``) undoes them."""

    def __init__(self, min_tensor_size: int) -> None:
        from megatron.core.tensor_parallel import layers
        from megatron.core.transformer import transformer_block

        self.min_tensor_size = min_tensor_size
        self.contexts: list[activation.OffloadContext] = []
        self.calls: list[dict[str, Any]] = []  # the arguments of each call MCore made, by name
        self._block_module = transformer_block
        self._layers_module = layers
        self._saved_factory = transformer_block.get_cpu_offload_context
        self._saved_init = transformer_block.TransformerBlock.__init__
        self.active = False

    def apply(self) -> ActivationOffloadInstall:
        self._block_module.get_cpu_offload_context = self._factory
        if not getattr(self._layers_module, "HAVE_TE", False):
            self._block_module.TransformerBlock.__init__ = self._wrap_init(self._saved_init)
        self.active = True
        return self

    def remove(self) -> None:
        if not self.active:
            return
        self._block_module.get_cpu_offload_context = self._saved_factory
        self._block_module.TransformerBlock.__init__ = self._saved_init
        self.active = False

    def __enter__(self) -> ActivationOffloadInstall:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _factory(self, *args: Any, **kwargs: Any) -> tuple[Any, Callable[[torch.Tensor], torch.Tensor]]:
        """What ``TransformerBlock.__init__`` calls in place of MCore's TE wrapper (MCore's shape, adapted).

        Megatron Core calls its own wrapper, not TE's function: ``(enabled, num_layers, model_layers,
        activation_offloading, weight_offloading, double_buffering[, retain_pinned_cpu_buffers])`` — six
        positional arguments in 0.16.1, seven in 0.19.2 (``retain_pinned_cpu_buffers`` seventh, where TE ≥ 2.10
        has ``manual_synchronization``). The arguments are bound by name, so ours gets each one where it belongs.

        Raises:
            TypeError: a call of another shape (more arguments, or unknown names).
        """
        bound = _MCORE_WRAPPER.bind(*args, **kwargs)
        bound.apply_defaults()
        self.calls.append({**bound.arguments, "positional": len(args)})
        a = bound.arguments
        context, sync_fn = activation.get_cpu_offload_context(
            a["enabled"],
            a["num_layers"],
            a["model_layers"],
            offload_activations=a["activation_offloading"],
            offload_weights=a["weight_offloading"],
            double_buffering=a["double_buffering"],
            retain_pinned_cpu_buffers=a["retain_pinned_cpu_buffers"],
            min_tensor_size=self.min_tensor_size,
        )
        if isinstance(context, activation.OffloadContext):
            self.contexts.append(context)
        return context, sync_fn

    @staticmethod
    def _wrap_init(original: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(original)
        def init(block: Any, *args: Any, **kwargs: Any) -> None:
            original(block, *args, **kwargs)
            # Why: without TE, layers.py asserts when it sees a live context; the tag it would set is TE-v1 only.
            block.config._cpu_offloading_context = None

        return init


def install_activation_offload(min_tensor_size: int = activation.DEFAULT_MIN_TENSOR_SIZE) -> ActivationOffloadInstall:
    """Make megatron-core's ``TransformerBlock`` use our activation offload runtime.

    Only blocks built while installed are affected (the block fetches its context in ``__init__``); removing
    the install leaves already-built models offloading.

    Args:
        min_tensor_size: saved tensors with fewer elements stay on the device (TE's default ``256 * 1024``).

    Returns:
        An :class:`ActivationOffloadInstall`; its ``contexts`` lists the contexts built so far.

    Example:
        >>> with install_activation_offload(min_tensor_size=4096):
        ...     model = GPTModel(config=TransformerConfig(..., cpu_offloading=True, cpu_offloading_num_layers=2), ...)
        >>> model.decoder.offload_context.stats
    """
    return ActivationOffloadInstall(min_tensor_size).apply()


# ---------------------------------------------------------------------------------------------------------
# CPU shims (labelled SHIM 1 and SHIM 2)
# ---------------------------------------------------------------------------------------------------------
_shim_depth = [0]
_saved_cuda: dict[str, Callable[..., Any]] = {}


def _cpu_rng_state(device: object = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_current_device() -> str:
    return "cpu"


@contextlib.contextmanager
def cpu_compat_shims() -> Iterator[None]:
    """The two shims that let megatron-core's tiny ``GPTModel`` run on a machine without CUDA.

    SHIM 1: ``torch.cuda.current_device()`` returns ``"cpu"`` — RoPE and the global memory buffer move
    tensors to ``torch.cuda.current_device()``.
    SHIM 2: ``torch.cuda.get_rng_state`` (and ``torch.cuda.random.get_rng_state``) return the CPU RNG state —
    ``model_parallel_cuda_manual_seed`` and the RNG tracker read the CUDA RNG.

    Nothing else is patched; both are restored on exit (re-entrant). A no-op where CUDA is present.

    Example:
        >>> with cpu_compat_shims():
        ...     model = build_tiny_gpt(num_layers=4, hidden=64, heads=4, vocab=128, seq=32)
        ...     loss = model(**tiny_batch(2, 32, 128)).mean()
        ...     loss.backward()
    """
    if torch.cuda.is_available():
        yield
        return
    if _shim_depth[0] == 0:
        _saved_cuda.update(
            current_device=torch.cuda.current_device,
            get_rng_state=torch.cuda.get_rng_state,
            random_get_rng_state=torch.cuda.random.get_rng_state,
        )
        # A str where torch returns an int, on purpose: megatron passes it to torch.device(...) and .to(...).
        vars(torch.cuda)["current_device"] = _cpu_current_device  # SHIM 1
        torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = _cpu_rng_state  # SHIM 2
    _shim_depth[0] += 1
    try:
        yield
    finally:
        _shim_depth[0] -= 1
        if _shim_depth[0] == 0:
            torch.cuda.current_device = _saved_cuda["current_device"]
            torch.cuda.get_rng_state = _saved_cuda["get_rng_state"]
            torch.cuda.random.get_rng_state = _saved_cuda["random_get_rng_state"]


# ---------------------------------------------------------------------------------------------------------
# a tiny real GPTModel
# ---------------------------------------------------------------------------------------------------------
def ensure_model_parallel() -> None:
    """Initialise ``torch.distributed`` (world size 1) and Megatron's parallel state, once per process.

    An in-memory store is used, so no port is opened and parallel test processes cannot collide.
    """
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def build_tiny_gpt(
    num_layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    vocab: int = 128,
    seq: int = 32,
    cpu_offloading: bool = False,
    cpu_offloading_num_layers: int = 0,
    *,
    min_tensor_size: int = activation.DEFAULT_MIN_TENSOR_SIZE,
    seed: int = 1234,
    **config_overrides: Any,
) -> torch.nn.Module:
    """A real megatron-core ``GPTModel`` (local layer spec, RoPE, no dropout) built on the CPU.

    Initialises ``torch.distributed`` and parallel state if needed; seeds both RNGs with ``seed`` so two
    calls give identical weights. With ``cpu_offloading=True`` our runtime is installed for the build (if it
    is not already) and the block's context is ``model.decoder.offload_context``. On a CPU-only machine call
    it (and run the model) inside :func:`cpu_compat_shims`.

    Args:
        num_layers, hidden, heads, vocab, seq: model size; ``seq`` is the maximum sequence length.
        cpu_offloading, cpu_offloading_num_layers: the ``TransformerConfig`` fields.
        min_tensor_size: offload threshold used when this call installs the runtime.
        seed: weight-init and model-parallel RNG seed.
        **config_overrides: more ``TransformerConfig`` fields.

    Raises:
        ValueError: from ``TransformerConfig`` (e.g. ``cpu_offloading_num_layers >= num_layers``).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    ensure_model_parallel()
    with cpu_compat_shims():
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        fields: dict[str, Any] = dict(
            num_layers=num_layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            use_cpu_initialization=True,
            transformer_impl="local",
            hidden_dropout=0.0,
            attention_dropout=0.0,
            cpu_offloading=cpu_offloading,
            cpu_offloading_num_layers=cpu_offloading_num_layers,
        )
        fields.update(config_overrides)
        config = TransformerConfig(**fields)
        installed = None
        if cpu_offloading and not _installed():
            installed = install_activation_offload(min_tensor_size)
        try:
            model = GPTModel(
                config=config,
                transformer_layer_spec=get_gpt_layer_local_spec(),
                vocab_size=vocab,
                max_sequence_length=seq,
                position_embedding_type="rope",
            )
        finally:
            if installed is not None:
                installed.remove()
    return model


def _installed() -> bool:
    from megatron.core.transformer import transformer_block

    factory = transformer_block.get_cpu_offload_context
    return isinstance(getattr(factory, "__self__", None), ActivationOffloadInstall)


def tiny_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Keyword arguments for ``GPTModel.forward``: random tokens, positions, a causal mask and shifted labels."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)  # True = masked out
    return {
        "input_ids": tokens[:, :-1],
        "position_ids": torch.arange(seq).unsqueeze(0).expand(batch, seq),
        "attention_mask": mask.view(1, 1, seq, seq),
        "labels": tokens[:, 1:],
    }
