"""mbridge-offload: CPU offloading for Megatron Bridge / Megatron Core training.

The config side (``config``, ``sources``, ``rules``, ``validate``, ``memory``, ``plan``, ``apply``) is plain
Python and never imports torch. The runtime side (``activation``, ``optimizer``, ``device``, ``verify``,
``megatron``) owns torch.
"""

__version__ = "0.1.0"
