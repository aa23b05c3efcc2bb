"""Generate tests/data/bridge-0.6.2/perf/: the run_config.yaml of every Bridge 0.6.2 perf recipe that offloads.

The recipes are enumerated from the installed package, never listed by hand: every function named
``<model>_<task>_<N>gpu_<gpu>_<precision>_config`` in ``megatron.bridge.perf_recipes``. A recipe is a candidate when
its code, or a Bridge function it calls, assigns ``cpu_offloading``, ``fine_grained_activation_offloading`` or a
non-empty ``offload_modules`` (a fast source scan); each candidate is then built for real (offline, the Hugging Face
``config.json`` files served from tests/data/hf-configs/), and it is an offload recipe when the built
``ConfigContainer`` has layer-level or fine-grained offloading on. For each one the file Bridge itself writes next to
every checkpoint (``cfg.to_yaml``) goes to ``<out>/<recipe>.yaml``; ``<out>/index.json`` maps each recipe to its GPU,
number of GPUs, precision and offload settings, and lists the candidates that could not be built offline, with why.

Run (after `make bridge-env`):  .venv/bin/python -m tests.support.gen_bridge_perf [--out DIR]
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import os
import pkgutil
import re
import signal
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from tests.support import bridge062

OUT = bridge062.ROOT / "tests" / "data" / "bridge-0.6.2" / "perf"
RECIPE_NAME = re.compile(
    r"^(?P<model>\w+?)_(?P<gpus>\d+)gpu_(?P<gpu>[a-z0-9]+)_(?P<precision>[a-z0-9]+)(?P<variant>_\w+)?_config$"
)
OFFLOAD_SWITCHES = ("cpu_offloading", "fine_grained_activation_offloading", "offload_modules")
BUILD_SECONDS = 60


def recipe_functions() -> dict[str, object]:
    """Every perf recipe function in the installed package, by name."""
    import megatron.bridge.perf_recipes as perf

    found: dict[str, object] = {}
    for info in pkgutil.walk_packages(perf.__path__, perf.__name__ + "."):
        module = importlib.import_module(info.name)
        for name, fn in vars(module).items():
            if inspect.isfunction(fn) and fn.__module__ == module.__name__ and RECIPE_NAME.match(name):
                found[name] = fn
    return dict(sorted(found.items()))


def _switches_on(node: ast.Assign) -> bool:
    """``x.cpu_offloading = <not False>`` / ``x.offload_modules = <not []>``: code that may switch offloading on."""
    targets = [t for t in node.targets if isinstance(t, ast.Attribute) and t.attr in OFFLOAD_SWITCHES]
    if not targets:
        return False
    value = node.value
    if isinstance(value, ast.Constant) and value.value in (False, None):
        return False
    return not (isinstance(value, ast.List) and not value.elts)


def may_offload(fn, seen: set[int] | None = None) -> bool:
    """Whether ``fn`` or a Bridge function it calls (transitively) assigns an offload switch a truthy value."""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return False
    seen.add(id(fn))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _switches_on(node):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            callee = getattr(fn, "__globals__", {}).get(node.func.id)
            in_bridge = inspect.isfunction(callee) and callee.__module__.startswith("megatron.bridge")
            if in_bridge and may_offload(callee, seen):
                return True
    return False


def _deadline(signum, frame):
    raise TimeoutError(f"the build passed {BUILD_SECONDS} s")


def build(fn):
    """The recipe's ConfigContainer, or the one-line reason it cannot be built here."""
    signal.signal(signal.SIGALRM, _deadline)
    signal.alarm(BUILD_SECONDS)
    # Offline, a recipe that sleeps is backing off between hub retries; its outcome is the same without the waits.
    sleep, time.sleep = time.sleep, lambda seconds: None
    try:
        return fn(), None
    except Exception as exc:  # a recipe that cannot build offline: recorded with its reason, not hidden
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    finally:
        time.sleep = sleep
        signal.alarm(0)


def offload_of(cfg) -> dict | None:
    """The offload settings of a built ConfigContainer, or None when it offloads nothing."""
    model = cfg.model
    if getattr(model, "fine_grained_activation_offloading", False):
        return {
            "kind": "fine-grained",
            "offload_modules": list(model.offload_modules or []),
            "NVTE_CPU_OFFLOAD_V1": (cfg.env_vars or {}).get("NVTE_CPU_OFFLOAD_V1"),
        }
    if getattr(model, "cpu_offloading", False):
        return {
            "kind": "layer",
            "cpu_offloading_num_layers": model.cpu_offloading_num_layers,
            "cpu_offloading_activations": model.cpu_offloading_activations,
            "cpu_offloading_weights": model.cpu_offloading_weights,
        }
    return None


def _entry(name: str, cfg, offload: dict) -> dict:
    parts = RECIPE_NAME.match(name).groupdict()
    ddp = cfg.ddp
    return {
        "gpu": parts["gpu"],
        "num_gpus": int(parts["gpus"]),
        "precision": parts["precision"],
        "variant": (parts["variant"] or "").lstrip("_") or None,
        "offload": offload,
        "megatron_fsdp": bool(getattr(ddp, "use_megatron_fsdp", False)),
        "fixture": f"{name}.yaml",
    }


def generate(out: Path) -> dict:
    """Write the fixtures and the index into ``out``; returns the index."""
    out.mkdir(parents=True, exist_ok=True)
    functions = recipe_functions()
    index: dict = {
        "generated_by": "python -m tests.support.gen_bridge_perf",
        "megatron_bridge": "0.6.2",
        "megatron_core": "0.19.2",
        "transformer_engine": f"{bridge062.TE_VERSION} (import stub; see tests/support/bridge062.py)",
        "recipes_in_package": len(functions),
        "recipes": {},
        "skipped": {},
    }
    for name, fn in functions.items():
        if not may_offload(fn):
            continue
        cfg, why = build(fn)
        if cfg is None:
            index["skipped"][name] = f"cannot be built offline: {why}"
            continue
        offload = offload_of(cfg)
        if offload is None:
            continue
        cfg.to_yaml(str(out / f"{name}.yaml"))
        index["recipes"][name] = _entry(name, cfg, offload)
    (out / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    out = args.out.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        cache = bridge062.hub_cache(Path(tmp) / "hub")
        os.environ.update(bridge062.offline_env(cache))
        bridge062.activate()
        # Bridge's default checkpoint path is under the working directory: build from "/" so that the files do not
        # depend on where the checkout is (run_config.yaml then says /nemo_experiments/...).
        os.chdir("/")
        started = time.perf_counter()
        index = generate(out)
    print(
        f"{len(index['recipes'])} offload recipes written, {len(index['skipped'])} skipped, of "
        f"{index['recipes_in_package']} perf recipes ({time.perf_counter() - started:.0f} s)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
