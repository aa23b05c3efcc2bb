"""Install our ``HybridDeviceOptimizer`` into megatron-core's optimizer factory (``optimizer_cpu_offload``).

megatron-core (0.16.1 and 0.19.2) builds the hybrid optimizer by calling the module global
``HybridDeviceOptimizer`` of ``megatron/core/optimizer/__init__.py``; ``distrib_optimizer.py`` holds its own
global of that name, re-creates the optimizer with it (``HybridDeviceOptimizer(params=..., **defaults)``) and
routes checkpointing through its ``isinstance`` checks. So the name is rebound in every loaded ``megatron.*``
module that imported upstream's class; upstream's class itself stays in ``cpu_offloading/hybrid_optimizer.py``.
"""

from __future__ import annotations

import sys
from types import ModuleType

from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer

__all__ = ["OptimizerOffloadInstall", "install_optimizer_offload"]

# Where megatron-core binds the class it builds and checks (0.16.1 and 0.19.2): imported here so that the
# rebinding covers them even when the caller has not imported them yet.
_FACTORY_MODULES = ("megatron.core.optimizer", "megatron.core.optimizer.distrib_optimizer")
_UPSTREAM_HOME = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"


class OptimizerOffloadInstall:
    """The rebindings :func:`install_optimizer_offload` made; ``remove()`` (or leaving ``with``) undoes them."""

    def __init__(self) -> None:
        import importlib

        for name in _FACTORY_MODULES:
            importlib.import_module(name)
        self.upstream = importlib.import_module(_UPSTREAM_HOME).HybridDeviceOptimizer
        self.patched: list[ModuleType] = []

    def apply(self) -> OptimizerOffloadInstall:
        for name, module in list(sys.modules.items()):
            if module is None or name == _UPSTREAM_HOME or not (name == "megatron" or name.startswith("megatron.")):
                continue
            if getattr(module, "HybridDeviceOptimizer", None) is self.upstream:
                vars(module)["HybridDeviceOptimizer"] = HybridDeviceOptimizer  # a module found at run time
                self.patched.append(module)
        return self

    @property
    def active(self) -> bool:
        return bool(self.patched)

    def remove(self) -> None:
        for module in self.patched:
            vars(module)["HybridDeviceOptimizer"] = self.upstream
        self.patched = []

    def __enter__(self) -> OptimizerOffloadInstall:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def install_optimizer_offload() -> OptimizerOffloadInstall:
    """Make megatron-core's ``get_megatron_optimizer`` build our ``HybridDeviceOptimizer``.

    Call it before building the optimizer; with ``optimizer_cpu_offload=True`` the factory then constructs ours,
    with or without the distributed optimizer. Import Megatron Bridge's training modules first if they are used,
    so that their copies of the name are rebound too.

    Example:
        >>> with install_optimizer_offload():
        ...     opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, optimizer_cpu_offload=True), [ddp_model])

    Returns:
        The installation; use it as a context manager or call ``remove()`` to restore upstream's class.

    Raises:
        ImportError: megatron-core is not installed.
    """
    return OptimizerOffloadInstall().apply()
