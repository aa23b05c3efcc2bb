"""The hybrid Mamba stack in the trace: megatron-core's own ``MambaModel`` (0.16.1) / ``HybridModel`` (0.19.2) from
the planner's layer pattern (``hybrid.stack``), with stand-ins for the CUDA/Triton kernels its Mamba mixer calls
(mamba_ssm, causal_conv1d: ``hybrid.mamba_kernels``).

The child imports these modules by name (``hybrid.stack``), as it imports its siblings.
"""
