"""mbridge-offload: CPU offloading for Megatron Bridge / Megatron Core training.

The rooms (``docs/architecture.md`` has the module map): ``config`` (the config model, its readers, the rule
catalogue in ``config.rules`` and ``config.validate``) and ``plan`` (``plan.model``, ``plan.memory.stage``,
``plan.time.step``, ``plan.search.planner``) are plain Python and never import torch; ``actions`` (``actions.apply``,
``actions.diagnose``, ``actions.testing``) imports torch only inside ``actions.testing.parity``. The runtime that
owns torch (the HybridDeviceOptimizer, the activation offload, their device and ordering layers, and the upstream
facts the planner shares with it) is a package of its own, `mbridge_offload_runtime`, installable alone; the old
name ``runtime`` here is a deprecated alias of it for one release. ``upstream_layers`` is the table of what each
offload and recompute setting does in each model class, with the megatron-core lines behind it in
``upstream_sites``.
"""

__version__ = "0.1.0"
