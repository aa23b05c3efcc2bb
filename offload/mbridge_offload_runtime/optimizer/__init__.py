"""Optimizer offloading: ``HybridDeviceOptimizer``, with Megatron Core's constructor, and its install into Megatron."""

from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer
from mbridge_offload_runtime.optimizer.megatron import OptimizerOffloadInstall, install_optimizer_offload

__all__ = ["HybridDeviceOptimizer", "OptimizerOffloadInstall", "install_optimizer_offload"]
