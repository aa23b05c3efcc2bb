"""Deprecated alias of ``mbridge_offload_runtime`` (kept for one release): a submodule imported by this old name is
the very module of the new name, not a copy, so classes, ``isinstance`` checks and monkeypatches agree."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

_OLD, _NEW = __name__, "mbridge_offload_runtime"


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_OLD + "."):
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = _NEW + spec.name[len(_OLD) :]
        warnings.warn(
            f"{spec.name} moved to {new} (the runtime is its own package now); the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self._spec = module.__spec__  # the import system sets the alias spec on it next; exec_module restores it
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    # First in line: the packages under the old name are the new ones, whose ``__path__`` the path finder would
    # otherwise search and load a second copy of each submodule from.
    sys.meta_path.insert(0, _Alias())
