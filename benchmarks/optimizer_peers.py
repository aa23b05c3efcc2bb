"""The peers the optimizer benchmarks compare against, each built the way it runs in production.

- **megatron-core's HybridDeviceOptimizer, as ``get_megatron_optimizer`` builds it** (0.16.1 and 0.19.2 build it the
  same way, in ``_get_megatron_optimizer_based_on_param_groups``, ``megatron/core/optimizer/__init__.py``): the GPU
  class is that module's ``Adam`` (Transformer Engine's ``FusedAdam``, else Apex's, else torch's ``AdamW`` — the
  fallback megatron-core itself takes, named in :func:`megatron_hdo_note`), the CPU class its ``CPUAdam``
  (``torch.optim.AdamW``), ``param_update_in_fp32=True``, the pinning flags from ``OptimizerConfig``'s defaults, and
  ``bias_correction=True, fused=True`` in the defaults (the groups carry ``fused``, so the CPU AdamW runs fused).
  :data:`FACTORY_KEYWORDS` is the keyword set of that call; a test reads it from both releases' source.
  Its achieved fraction is read from its own state (:func:`megatron_hdo_fraction`, ``gpu_params_map_cpu_copy``).
- **torchao's ``CPUOffloadOptimizer``** (CUDA and XPU only: its constructor refuses CPU parameters), with torch's
  fused AdamW on the host, where torchao imports.
- **DeepSpeed's ``DeepSpeedCPUAdam``** (its AVX CPU Adam, built on first use), as a host-side optimizer, where
  DeepSpeed imports and its op builds.

The peers are not installed in the shared environment: ``pip install --target .peers --no-deps torchao deepspeed``
(plus DeepSpeed's ``tqdm hjson py-cpuinfo ninja msgpack einops``) and ``PYTHONPATH=.peers``; each builder returns
None, with the reason in :func:`peer_status`, where its package is absent or refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# The keywords of megatron-core's HybridDeviceOptimizer(...) call in _get_megatron_optimizer_based_on_param_groups
# (the ``**optimizer_defaults`` of the adam branch spelled out), identical in 0.16.1 and 0.19.2.
FACTORY_KEYWORDS = frozenset(
    {
        "offload_fraction",
        "cpu_optimizer_cls",
        "gpu_optimizer_cls",
        "overlap_cpu_optimizer_d2h_h2d",
        "pin_cpu_grads",
        "pin_cpu_params",
        "param_update_in_fp32",
        "lr",
        "weight_decay",
        "betas",
        "eps",
        "bias_correction",
        "fused",
    }
)
_STATUS: dict[str, str] = {}


def peer_status() -> dict[str, str]:
    """Per peer, "ok" or why it could not be built (filled as the builders are called)."""
    return dict(_STATUS)


def megatron_hdo_classes() -> tuple[type, type, type, str] | None:
    """megatron-core's own HDO class and the GPU/CPU optimizer classes its factory picks, with a note on them."""
    try:
        from megatron.core import optimizer as factory
        from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer as Upstream
    except Exception as exc:  # absent or broken: the benchmark reports it
        _STATUS["megatron-core HDO"] = f"not importable ({type(exc).__name__}: {exc})"
        return None
    gpu_cls, cpu_cls = factory.Adam, factory.CPUAdam
    where = gpu_cls.__module__.split(".")[0]
    if getattr(factory, "USING_PYTORCH_OPTIMIZER", False):
        note = "GPU part: torch.optim.AdamW (Transformer Engine and Apex absent: megatron-core's own fallback)"
    else:
        note = f"GPU part: {where}'s {gpu_cls.__name__}"
    _STATUS["megatron-core HDO"] = "ok"
    return Upstream, gpu_cls, cpu_cls, f"{note}; CPU part: torch.optim.AdamW, fused"


def megatron_hdo(params: Iterable[torch.Tensor], fraction: float, overlap: bool = True, pin: bool = True) -> Any:
    """megatron-core's HDO with exactly the arguments ``get_megatron_optimizer`` passes (adam, bf16 defaults).

    Args:
        params: the parameters (for the distributed optimizer: its fp32 main shards, 1-D, one per model param).
        fraction: ``optimizer_offload_fraction``.
        overlap: ``overlap_cpu_optimizer_d2h_h2d``.
        pin: False only on a CPU-only machine (SHIM-PIN of ``tests/support/upstream_shims_hdo.py``: torch has no
            pinned allocator there); else the factory's ``pin_cpu_grads`` / ``pin_cpu_params`` defaults.

    Returns:
        The optimizer, or None where megatron-core is not importable.
    """
    classes = megatron_hdo_classes()
    if classes is None:
        return None
    from megatron.core.optimizer import OptimizerConfig

    upstream, gpu_cls, cpu_cls, _ = classes
    cfg = OptimizerConfig(
        optimizer="adam",
        lr=HYPER["lr"],
        weight_decay=HYPER["weight_decay"],
        adam_beta1=HYPER["betas"][0],
        adam_beta2=HYPER["betas"][1],
        adam_eps=HYPER["eps"],
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=fraction,
        overlap_cpu_optimizer_d2h_h2d=overlap,
    )
    kwargs = {
        "offload_fraction": cfg.optimizer_offload_fraction,
        "cpu_optimizer_cls": cpu_cls,
        "gpu_optimizer_cls": gpu_cls,
        "overlap_cpu_optimizer_d2h_h2d": cfg.overlap_cpu_optimizer_d2h_h2d,
        "pin_cpu_grads": cfg.pin_cpu_grads and pin,
        "pin_cpu_params": cfg.pin_cpu_params and pin,
        "param_update_in_fp32": True,
        "lr": cfg.lr,
        "weight_decay": cfg.weight_decay,
        "betas": (cfg.adam_beta1, cfg.adam_beta2),
        "eps": cfg.adam_eps,
        "bias_correction": True,
        "fused": True,
    }
    assert set(kwargs) == FACTORY_KEYWORDS
    return upstream(list(params), **kwargs)


def megatron_hdo_note() -> str:
    classes = megatron_hdo_classes()
    return "not importable" if classes is None else classes[3]


def megatron_hdo_fraction(opt: Any) -> float:
    """The fraction megatron-core's HDO offloaded, from its own state: its CPU copies over its device params."""
    offloaded = sum(p.numel() for p in opt.gpu_params_map_cpu_copy)
    total = sum(p.numel() for g in opt.param_groups for p in g["params"] if p.is_cuda)
    return offloaded / total if total else 0.0


def torchao_offload(params: Iterable[torch.Tensor]) -> Any:
    """torchao's CPUOffloadOptimizer with torch's fused AdamW on the host, or None (absent, or CPU parameters)."""
    try:
        from torchao.optim import CPUOffloadOptimizer
    except Exception as exc:
        _STATUS["torchao CPUOffloadOptimizer"] = f"not importable ({type(exc).__name__})"
        return None
    try:
        opt = CPUOffloadOptimizer(list(params), torch.optim.AdamW, fused=True, **HYPER)
    except Exception as exc:  # torchao refuses CPU parameters ("only supports CUDA & XPU")
        _STATUS["torchao CPUOffloadOptimizer"] = f"refused: {type(exc).__name__}: {exc}"
        return None
    _STATUS["torchao CPUOffloadOptimizer"] = "ok"
    return opt


def deepspeed_cpu_adam_cls() -> Callable[..., torch.optim.Optimizer] | None:
    """DeepSpeed's DeepSpeedCPUAdam (AdamW mode), or None where DeepSpeed or its op build is missing."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        probe = torch.nn.Parameter(torch.zeros(8))
        probe.grad = torch.zeros(8)
        DeepSpeedCPUAdam([probe], adamw_mode=True, **HYPER).step()  # builds the op on first use
    except Exception as exc:
        _STATUS["DeepSpeedCPUAdam"] = f"unavailable ({type(exc).__name__}: {str(exc)[:160]})"
        return None
    _STATUS["DeepSpeedCPUAdam"] = "ok"

    def make(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        return DeepSpeedCPUAdam(list(params), adamw_mode=True, **HYPER)

    return make
