"""Adapters to real megatron-core: our activation offload in ``TransformerBlock``, and a tiny GPT on CPU.

``transformer_block.py`` binds ``get_cpu_offload_context`` from Transformer Engine only ``if HAVE_TE`` (else
``None``, and ``TransformerBlock.__init__`` asserts); :func:`install_activation_offload` rebinds that module
global to ours. The block then stores the context in ``config._cpu_offloading_context``, whose one reader,
``tensor_parallel/layers.py``, tags linear inputs for TE's v1 algorithm and without TE asserts "CPU Offloading
cannot be enabled while TE is not present". Ours (like TE v2) ignores the tags, so without TE the installer also
clears that field after each block is built (the context stays reachable as ``block.offload_context``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

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
    """The signature of ``megatron.core.extensions.transformer_engine.get_cpu_offload_context``, whose calls are
    bound by name: six positional arguments in 0.16.1, seven in 0.19.2 (``retain_pinned_cpu_buffers``, where
    TE ≥ 2.10 and ours have ``manual_synchronization``)."""


_MCORE_WRAPPER = inspect.signature(_mcore_wrapper_shape)


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
        """What ``TransformerBlock.__init__`` calls in place of MCore's TE wrapper (``TypeError`` for another shape)."""
        bound = _MCORE_WRAPPER.bind(*args, **kwargs)
        bound.apply_defaults()
        self.calls.append({**bound.arguments, "positional": len(args)})
        a = dict(bound.arguments)
        a["offload_activations"], a["offload_weights"] = a.pop("activation_offloading"), a.pop("weight_offloading")
        context, sync_fn = activation.get_cpu_offload_context(**a, min_tensor_size=self.min_tensor_size)
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
    """Make megatron-core's ``TransformerBlock`` use our activation offload runtime (blocks built while installed).

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
    """
    if torch.cuda.is_available():
        yield
        return
    with contextlib.ExitStack() as shims:
        # A str where torch returns an int, on purpose: megatron passes it to torch.device(...) and .to(...).
        shims.enter_context(mock.patch.object(torch.cuda, "current_device", _cpu_current_device))  # SHIM 1
        for module in (torch.cuda, torch.cuda.random):
            shims.enter_context(mock.patch.object(module, "get_rng_state", _cpu_rng_state))  # SHIM 2
        yield


def ensure_model_parallel() -> None:
    """Initialise ``torch.distributed`` (world size 1, an in-memory store: no port, so parallel test processes
    cannot collide) and Megatron's parallel state, once per process."""
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
    """A real megatron-core ``GPTModel`` (local layer spec, RoPE, no dropout, max length ``seq``) built on the CPU.

    ``seed`` seeds both RNGs, so two calls give identical weights. With ``cpu_offloading=True`` our runtime is
    installed for the build (if it is not already; ``min_tensor_size`` is then its threshold) and the block's
    context is ``model.decoder.offload_context``. Without CUDA, call it (and run it) inside
    :func:`cpu_compat_shims`. ``config_overrides``: more ``TransformerConfig`` fields.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    ensure_model_parallel()
    with cpu_compat_shims():
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        fields: dict[str, Any] = dict(num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads)
        fields.update(use_cpu_initialization=True, transformer_impl="local", hidden_dropout=0.0, attention_dropout=0.0)
        fields.update(cpu_offloading=cpu_offloading, cpu_offloading_num_layers=cpu_offloading_num_layers)
        config = TransformerConfig(**{**fields, **config_overrides})
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
