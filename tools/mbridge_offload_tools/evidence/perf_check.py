"""The planner on Megatron Bridge's own offload perf recipes: NVIDIA's choice against our prediction.

Reads the index the ``bridge`` fixtures carry (``FIXTURES / "index.json"``: recipe → GPU, GPU count,
precision, offload settings, fixture file; each fixture is the ``run_config.yaml`` Bridge writes) and, per recipe:
``estimate`` on its own GPU and GPU count as NVIDIA ships it, ``estimate`` with its offloading switched off, and
``recommend`` from the switched-off config. Fine-grained recipes get a column their module fills
(``FINE_GRAINED_SAVING``); until then it says the saving is not modelled here. Never imports torch.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mbridge_offload.config.rules.base import TE_VERSION_ASSUMED

# Recipe GPU names (``…_<gpu>_…_config``) → planner presets.
GPU_NAMES = {"h100": "h100-80gb", "h200": "h200-141gb"}


@dataclass
class RecipeCheck:
    """One recipe's row: what NVIDIA set, what we predict with it and without, and what we would recommend."""

    recipe: str
    gpu: str
    num_gpus: int
    kind: str  # "layer" or "fine-grained"
    nvidia: str  # NVIDIA's offload choice, in words
    nvidia_layers: int | None
    with_gib: float | None = None
    with_fits: bool | None = None
    without_gib: float | None = None
    without_fits: bool | None = None
    budget_gib: float | None = None
    capacity_gib: float | None = None
    recommended_mode: str | None = None
    recommended_layers: int | None = None
    recommended_fits: bool | None = None
    recommended_overrides: list[str] = field(default_factory=list)
    fine_grained_saving: str = ""
    error: str | None = None


# The fine-grained module replaces this: (recipe check, loaded config) → the saving of its offload_modules.
FINE_GRAINED_SAVING: Callable[[RecipeCheck, Any], str] | None = None


# Where the ``bridge`` fixtures live in this repository (tests and docs read them; nothing writes there).
FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "data" / "bridge-0.6.2" / "perf"


def load_index(directory: Path = FIXTURES) -> dict[str, Any]:
    """The fixtures' index (``{"recipes": {name: entry}, "skipped": {...}}``); empty when there are none."""
    path = directory / "index.json"
    if not path.is_file():
        return {"recipes": {}, "skipped": {}}
    return dict(json.loads(path.read_text()))


def switched_off(raw: dict[str, Any]) -> dict[str, Any]:
    """The config with every activation and optimizer offload switch off (the recipe's baseline)."""
    out = copy.deepcopy(raw)
    model = out.setdefault("model", {})
    model["cpu_offloading"] = False
    model["fine_grained_activation_offloading"] = False
    model["offload_modules"] = []
    out.setdefault("optimizer", {})["optimizer_cpu_offload"] = False
    return out


def _nvidia(entry: dict[str, Any]) -> tuple[str, str, int | None]:
    offload = entry.get("offload") or {}
    kind = str(offload.get("kind", "layer"))
    if kind == "layer":
        k = offload.get("cpu_offloading_num_layers")
        return kind, f"layer-level, {k} layers", int(k) if k is not None else None
    return kind, "fine-grained: " + ", ".join(offload.get("offload_modules") or []), None


def _fixture_text(path: Path) -> str:
    """The fixture as text. Bridge writes ``optimizer.grad_norm_skip_threshold: .inf`` (the field's default); until
    the config reader accepts it (the ``bridge`` work), it is read here as null, which means that same default."""
    return re.sub(r":[ \t]*\.inf\b", ": null", path.read_text(encoding="utf-8"))


def _offload_lever_sets(kind: str) -> list[tuple[str, ...]]:
    """The lever of NVIDIA's own kind of offload first (the comparison is how much of it), then every non-empty
    subset of the offload levers, largest first."""
    from itertools import combinations

    from mbridge_offload.plan.search.levers import OFFLOAD_LEVERS

    own = {"layer": ("activation",), "fine-grained": ("fine-grained",)}.get(kind)
    n = len(OFFLOAD_LEVERS)
    return ([own] if own else []) + [c for k in range(n, 0, -1) for c in combinations(OFFLOAD_LEVERS, k)]


# The Transformer Engine release the recipes run on: the one the planner assumes by default, Bridge's release-branch
# lock (v0.6.0's uv.lock: transformer-engine 2.17.1+4329ff84, without the fp32 cross-entropy gradient of TE 2.18).
RECIPES_TE_VERSION = TE_VERSION_ASSUMED


def check_recipe(name: str, entry: dict[str, Any], directory: Path) -> RecipeCheck:
    """Estimate with and without the recipe's offloading and recommend from the switched-off config."""
    from mbridge_offload.config import sources
    from mbridge_offload.config.errors import InputError
    from mbridge_offload.plan.service import estimate_for_inputs, recommend_for_inputs

    kind, nvidia, layers = _nvidia(entry)
    gpu = GPU_NAMES.get(entry["gpu"], entry["gpu"])
    row = RecipeCheck(name, gpu, int(entry["num_gpus"]), kind, nvidia, layers)
    flags = {"gpu": gpu, "num_gpus": row.num_gpus, "te_version": RECIPES_TE_VERSION}
    try:
        loaded = sources.load(_fixture_text(directory / entry["fixture"]))
        shipped = estimate_for_inputs(loaded.config, loaded.raw, **flags)
        off_raw = switched_off(loaded.raw)
        off_cfg = sources.build_config(copy.deepcopy(off_raw), "<offload off>")
        off = estimate_for_inputs(off_cfg, off_raw, **flags)
        # NVIDIA's recipes answer "how much of this offload"; the comparison asks the planner the same (recompute
        # and the other offloads, which the default levers also weigh, are not what these recipes chose).
        rec = None
        for allowed in _offload_lever_sets(kind):  # those this run can use (asking for one it cannot is bad input)
            try:
                rec = recommend_for_inputs(off_cfg, off_raw, **flags, levers=list(allowed))
                break
            except InputError:
                continue
        if rec is None:  # no offload lever this run can use at all: the planner's own answer
            rec = recommend_for_inputs(off_cfg, off_raw, **flags)
    except (ValueError, KeyError, sources.ConfigError) as exc:
        row.error = str(exc)
        return row
    row.with_gib, row.with_fits = shipped.memory_gib.total, shipped.fits
    row.without_gib, row.without_fits = off.memory_gib.total, off.fits
    row.budget_gib, row.capacity_gib = shipped.budget_gib, shipped.gpu_memory_gib
    row.recommended_mode, row.recommended_layers = rec.mode, rec.activation_offload_layers or None
    row.recommended_overrides, row.recommended_fits = list(rec.overrides), rec.fits
    if kind != "layer":
        saving = FINE_GRAINED_SAVING
        row.fine_grained_saving = saving(row, loaded) if saving else "not modelled here (fine-grained module)"
    return row


def check_all(directory: Path = FIXTURES) -> list[RecipeCheck]:
    """Every offload recipe of the index, in name order."""
    recipes = load_index(directory)["recipes"]
    return [check_recipe(name, recipes[name], directory) for name in sorted(recipes)]
