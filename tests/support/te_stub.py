"""LABELLED SHIM — a Transformer Engine import stub, for tests only.

Transformer Engine cannot be installed on a CPU machine (its PyTorch extension is sdist-only and needs
nvcc), yet ``megatron.bridge`` imports it unconditionally (``peft/lora_layers.py``), so Bridge's
``ConfigContainer`` cannot be reached without it. This stub serves every ``transformer_engine[.x]`` module
as a dummy package whose attributes are dummy classes, with ``__version__`` settable (default "2.12.0").
megatron.core must be imported *before* installing it, so that Megatron Core keeps ``HAVE_TE = False``.
Checks that depend on the TE version therefore follow the stubbed version, nothing more.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
import typing


class _DummyMeta(type):
    """Attribute access on a dummy class yields another dummy class (``te.pytorch.ops.Sequential``)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _DummyMeta(name, (_Dummy,), {})


class _Dummy(metaclass=_DummyMeta):
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Dummy()

    def __getattr__(self, name):
        return _Dummy()


class _StubModule(types.ModuleType):
    __path__: typing.ClassVar[list[str]] = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _DummyMeta(name, (_Dummy,), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, version: str):
        self.version = version

    def find_spec(self, fullname, path, target=None):
        if fullname == "transformer_engine" or fullname.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__version__ = self.version
        module.__path__ = []
        return module

    def exec_module(self, module):
        return None


def install(version: str = "2.12.0") -> _Finder:
    import megatron.core  # noqa: F401  (first, so that MCore keeps HAVE_TE = False)

    finder = _Finder(version)
    sys.meta_path.insert(0, finder)
    return finder


def uninstall(finder: _Finder) -> None:
    sys.meta_path.remove(finder)
    for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
        del sys.modules[name]
