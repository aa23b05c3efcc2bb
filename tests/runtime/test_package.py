"""The runtime is a package of its own: installable alone with torch as its only dependency, importable without
the agent side, and reachable under its old name ``mbridge_offload.runtime`` for one more release.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Run in the child: anything of the agent side (or its dependencies) that gets imported fails the import.
_BLOCK_AGENT_SIDE = """
import importlib.abc, sys
BLOCKED = ("mbridge_offload", "mbridge_offload_tools", "pydantic", "mcp", "ruamel", "hydra", "yaml")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"the runtime imported {name}")
sys.meta_path.insert(0, Block())
"""
_USE = """
import torch
import mbridge_offload_runtime, mbridge_offload_runtime.activation, mbridge_offload_runtime.megatron
from mbridge_offload_runtime.optimizer import HybridDeviceOptimizer
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-2)
model(torch.randn(3, 8)).sum().backward()
opt.step()
print(mbridge_offload_runtime.__file__, opt.offloaded_fraction)
"""


def test_the_runtime_installs_alone_and_runs_with_only_torch(tmp_path) -> None:
    src = tmp_path / "src"  # built from a copy: the build writes next to its pyproject, never into the tree
    shutil.copytree(ROOT / "offload" / "mbridge_offload_runtime", src / "mbridge_offload_runtime",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    shutil.copy(ROOT / "offload" / "pyproject.toml", src / "pyproject.toml")
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target"]
    done = subprocess.run([*pip, str(target), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    dist = next(target.glob("mbridge_offload_runtime-*.dist-info"))
    requires = [line for line in (dist / "METADATA").read_text().splitlines() if line.startswith("Requires-Dist")]
    assert requires == ["Requires-Dist: torch>=2.3"]
    # -I: no PYTHONPATH, no user site, no cwd; the installed copy comes first, torch from the environment.
    code = f"import sys; sys.path.insert(0, {str(target)!r})\n" + _BLOCK_AGENT_SIDE + _USE
    run = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    installed, fraction = run.stdout.split()
    assert installed.startswith(str(target)) and float(fraction) > 0


def test_the_upstream_facts_import_without_torch() -> None:
    code = (
        "import sys\nclass B:\n    def find_spec(self, n, p=None, t=None):\n"
        "        if n.split('.')[0] == 'torch': raise ImportError('torch imported')\n"
        "sys.meta_path.insert(0, B())\n"
        "from mbridge_offload_runtime.upstream import TE_MIN_OFFLOAD_NUMEL, hdo_offload_mask\n"
        "print(hdo_offload_mask([1, 1, 2], 0.5))"
    )
    head = f"import sys; sys.path.insert(0, {str(ROOT / 'offload')!r})\n"
    run = subprocess.run([sys.executable, "-I", "-c", head + code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-1500:]
    assert run.stdout.strip() == "[True, True, False]"


def test_the_old_import_path_is_the_new_module_and_warns() -> None:
    import mbridge_offload_runtime.optimizer.buckets as new

    for name in [n for n in sys.modules if n.startswith("mbridge_offload.runtime.")]:
        del sys.modules[name]
    with pytest.warns(DeprecationWarning, match="moved to mbridge_offload_runtime"):
        import mbridge_offload.runtime.optimizer.buckets as old
    assert old is new and old.__spec__.name == "mbridge_offload_runtime.optimizer.buckets"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from mbridge_offload.runtime.optimizer.hybrid import HybridDeviceOptimizer as Old
    from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer

    assert Old is HybridDeviceOptimizer


def test_the_readmes_examples_run_as_written(tmp_path) -> None:
    text = (ROOT / "offload" / "mbridge_offload_runtime" / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert len(blocks) == 2
    head = f"import sys; sys.path.insert(0, {str(ROOT / 'offload')!r})\n" + _BLOCK_AGENT_SIDE
    for block in blocks:
        run = subprocess.run([sys.executable, "-I", "-c", head + block], capture_output=True, text=True, timeout=300,
                             cwd=tmp_path)  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "opt.pt").is_file()
