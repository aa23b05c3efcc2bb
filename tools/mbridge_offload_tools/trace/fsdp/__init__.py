"""Megatron-FSDP in the trace: megatron-core's ``FullyShardedDataParallel`` on fake tensors (``docs/trace.md``)."""
