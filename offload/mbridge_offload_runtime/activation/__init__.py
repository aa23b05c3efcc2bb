"""Layer-level activation offloading: Transformer Engine's context call shape, and a hook-based wrapper."""

from mbridge_offload_runtime.activation.context import ManualController, OffloadContext, get_cpu_offload_context
from mbridge_offload_runtime.activation.eligibility import Eligibility, keep_on_device, mark_not_offload
from mbridge_offload_runtime.activation.layers import OffloadHandle, offload_layers
from mbridge_offload_runtime.activation.schedule import DEFAULT_MIN_TENSOR_SIZE, OffloadStats

__all__ = [
    "DEFAULT_MIN_TENSOR_SIZE",
    "Eligibility",
    "ManualController",
    "OffloadContext",
    "OffloadHandle",
    "OffloadStats",
    "get_cpu_offload_context",
    "keep_on_device",
    "mark_not_offload",
    "offload_layers",
]
