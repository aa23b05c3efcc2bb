"""Optimizer offloading: ``HybridDeviceOptimizer``, with Megatron Core's constructor."""

from mbridge_offload.runtime.optimizer.hybrid import HybridDeviceOptimizer

__all__ = ["HybridDeviceOptimizer"]
