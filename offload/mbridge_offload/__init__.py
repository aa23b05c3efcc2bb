"""mbridge-offload: CPU offloading for Megatron Bridge / Megatron Core training.

The rooms (``docs/architecture.md`` has the module map): ``config`` (the config model, its readers, the rule
catalogue in ``config.rules`` and ``config.validate``) and ``plan`` (``plan.model``, ``plan.memory.stage``,
``plan.time.step``, ``plan.search.planner``) are plain Python and never import torch; ``actions`` (``actions.apply``,
``actions.diagnose``, ``actions.testing``) imports torch only inside ``actions.testing.parity``. The ``runtime`` owns
torch:
``runtime.device``, ``runtime.activation``, ``runtime.optimizer`` and the megatron-core adapters in
``runtime.megatron``. ``upstream`` holds the upstream facts that the rules, the planner and the runtime share;
``upstream_layers`` is the table of what each offload and recompute setting does in each model class, with the
megatron-core lines behind it in ``upstream_sites``.
"""

__version__ = "0.1.0"
