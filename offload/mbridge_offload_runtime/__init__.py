"""mbridge-offload-runtime: CPU offloading for plain PyTorch and Megatron Core training, with only torch needed.

``README.md`` beside this file shows the pieces. This ``__init__`` imports nothing, so that
``mbridge_offload_runtime.upstream`` can be read without torch.
"""

__version__ = "0.1.0"
