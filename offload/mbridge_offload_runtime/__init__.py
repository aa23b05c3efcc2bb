"""mbridge-offload-runtime: CPU offloading for plain PyTorch and Megatron Core training, with only torch needed.

The pieces (``README.md`` beside this file shows them in use):

- ``mbridge_offload_runtime.optimizer``: ``HybridDeviceOptimizer`` (Megatron Core's constructor, flat host buckets,
  copies on side streams) and ``install_optimizer_offload`` (the install into Megatron's optimizer factory);
- ``mbridge_offload_runtime.activation``: layer-level activation offloading (``offload_layers``, and Transformer
  Engine's ``get_cpu_offload_context`` call shape);
- ``mbridge_offload_runtime.device``: streams, events and pinned buffers behind one interface, CUDA or CPU;
- ``mbridge_offload_runtime.ordering``: CUDA's happens-before on the CPU, so a missing wait fails a CPU test;
- ``mbridge_offload_runtime.megatron``: the megatron-core adapters of the activation offload;
- ``mbridge_offload_runtime.upstream``: the upstream facts (torch-free) the runtime and the planner share.

This ``__init__`` imports nothing, so ``mbridge_offload_runtime.upstream`` can be read without torch.
"""

__version__ = "0.1.0"
