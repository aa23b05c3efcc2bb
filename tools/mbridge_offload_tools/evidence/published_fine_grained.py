"""Published figures on fine-grained activation offloading (``data/published_fine_grained.yaml``) against the
planner's estimate, and the recipe rows of ``docs/planner.md`` (what each recipe's ``offload_modules`` save).

Every number on our side is the planner's ordinary ``estimate`` for the case's inputs, with and without the
modules; nothing is fitted to the published figures (the tolerances are in the data file, stated with the source).
Never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from mbridge_offload.plan.memory import fine_grained
from mbridge_offload.plan.model.params import stage_layers
from mbridge_offload.upstream_layers import ALLOWED_OFFLOAD_MODULES
from mbridge_offload_tools.evidence import data_files


def load() -> dict[str, Any]:
    """The data file, parsed (``data/published_fine_grained.yaml``)."""
    return data_files.load("published_fine_grained")


def recipe(recipe_id: str) -> dict[str, Any]:
    """One ``recipes`` entry, with ``inputs`` resolved through ``inputs_from``."""
    by_id = {r["id"]: r for r in load()["recipes"]}
    entry = dict(by_id[recipe_id])
    if "inputs_from" in entry:
        entry["inputs"] = by_id[entry["inputs_from"]]["inputs"]
    return entry


@dataclass
class RecipeRow:
    """A recipe's worst-stage peak without and with its ``offload_modules`` (our estimate, decimal GB)."""

    id: str
    recipe: str
    modules: list[str]
    without_gb: float | None
    with_gb: float | None
    host_gb: float | None
    step_time_factor: float | None
    note: str

    @property
    def saving_gb(self) -> float | None:
        if self.without_gb is None or self.with_gb is None:
            return None
        return self.without_gb - self.with_gb

    @property
    def saving_fraction(self) -> float | None:
        saving = self.saving_gb
        return saving / self.without_gb if saving is not None and self.without_gb else None


@lru_cache(maxsize=16)
def recipe_row(recipe_id: str) -> RecipeRow:
    """The planner's estimate for a recipe with and without its modules."""
    from mbridge_offload.plan.service import estimate_for_inputs

    entry = recipe(recipe_id)
    note = entry.get("not_expressible") or entry.get("assumed", "")
    if "inputs" not in entry:
        return RecipeRow(recipe_id, entry["recipe"], entry["modules"], None, None, None, None, f"not estimated: {note}")
    inputs = dict(entry["inputs"])
    before = estimate_for_inputs(**inputs)
    after = estimate_for_inputs(**inputs, offload_modules=list(entry["modules"]))
    return RecipeRow(
        recipe_id,
        entry["recipe"],
        list(entry["modules"]),
        before.memory_gb.total,
        after.memory_gb.total,
        after.host_gb,
        after.step_time_factor,
        note,
    )


@dataclass
class CheckResult:
    id: str
    value: float
    low: float
    high: float
    source: str

    @property
    def passed(self) -> bool:
        return self.low <= self.value <= self.high


def _theoretical_drop_bytes(inputs: dict[str, Any], modules: list[str]) -> float:
    """Offloaded bytes in flight on the worst stage, counted from the saved tensors directly: the groups of every
    in-flight chunk minus the one group per module megatron-core keeps (margin / prefetch)."""
    from dataclasses import replace

    from mbridge_offload.plan.inputs.resolve import resolve
    from mbridge_offload.plan.memory import activations

    r = resolve(inputs)
    s = replace(r.setup, offload_modules=tuple(modules))
    stage = 0  # the first stage holds the most micro-batches
    names = {n for mod in modules for n in fine_grained.POINTS[mod].tensors}
    per_layer = [
        sum(
            t.nbytes
            for t in activations._stored(activations.layer_activations(r.model, s, i), s)
            if t.name in names and t.numel >= s.min_offloaded_tensor_size
        )
        for i in stage_layers(r.model, s)[stage]
    ]
    groups = activations.in_flight(s, stage) * len(per_layer)
    return (groups - len(modules)) * sum(per_layer) / len(per_layer)


def evaluate() -> list[CheckResult]:
    """Every ``checks`` entry: our value, the published range widened by its tolerance."""
    out = []
    for check in load()["checks"]:
        row = recipe_row(check["case"])
        fig, tol = check["figure"], float(check["tolerance"])
        if "memory_reduction_min" in fig:
            value = float(row.saving_fraction or 0.0)
            low, high = fig["memory_reduction_min"] - tol, fig["memory_reduction_max"] + tol
        elif "overhead_min" in fig:
            value = float((row.step_time_factor or 1.0) - 1.0)
            low, high = fig["overhead_min"] - tol, fig["overhead_max"] + tol
        else:
            entry = recipe(check["case"])
            value = (row.saving_gb or 0.0) * 1e9 / _theoretical_drop_bytes(entry["inputs"], entry["modules"])
            low, high = fig["measured_over_theoretical"] - tol, fig["measured_over_theoretical"] + tol
        out.append(CheckResult(check["id"], value, low, high, check["source"]))
    return out


def render_modules_table() -> str:
    """What each ``offload_modules`` entry of megatron-core 0.19.2 moves (from ``fine_grained.POINTS``)."""
    lines = ["| module | offload scope (megatron-core 0.19.2) | saved tensors moved | note |", "|---|---|---|---|"]
    for name in ALLOWED_OFFLOAD_MODULES:
        p = fine_grained.POINTS[name]
        moved = ", ".join(f"`{t}`" for t in p.tensors)
        if p.transfer_only:
            moved += " (also copies " + ", ".join(f"`{t}`" for t in p.transfer_only) + ", freed only by attn_proj)"
        lines.append(f"| `{name}` | {p.scope} | {moved} | {p.note} |")
    return "\n".join(lines)


def render_recipe_rows() -> str:
    """The fine-grained recipes' rows: peak without and with their modules, our estimate (plugs into the recipe
    table of docs/planner.md)."""
    lines = [
        "| recipe | offload_modules | peak without (GB) | peak with (GB) | saving | pinned host (GB) | step × "
        "| assumed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in load()["recipes"]:
        row = recipe_row(entry["id"])
        mods = ", ".join(row.modules)
        if row.without_gb is None:
            lines.append(f"| {row.recipe} | {mods} | – | – | – | – | – | {row.note} |")
            continue
        lines.append(
            f"| {row.recipe} | {mods} | {row.without_gb:.1f} | {row.with_gb:.1f} | {row.saving_gb:.1f} GB "
            f"({row.saving_fraction:.1%}) | {row.host_gb:.1f} | {row.step_time_factor:.3f} | {row.note} |"
        )
    return "\n".join(lines)


def render_checks() -> str:
    lines = ["| check | published | ours (simulated) | accepted range | verdict |", "|---|---|---|---|---|"]
    figures = {c["id"]: c["figure"] for c in load()["checks"]}
    for res in evaluate():
        fig = ", ".join(f"{k} {v:g}" for k, v in figures[res.id].items())
        verdict = "within" if res.passed else "OUTSIDE"
        lines.append(f"| {res.id} | {fig} | {res.value:.4f} | {res.low:.4f} … {res.high:.4f} | {verdict} |")
    return "\n".join(lines)


def render_section() -> str:
    """The ``fine-grained`` section of docs/planner.md."""
    return "\n\n".join(
        [
            "What each module moves (read from the source; tensor names are those of `plan/memory/activations.py`):",
            render_modules_table(),
            "Published figures against our estimate "
            "(`mbridge_offload_tools/evidence/data/published_fine_grained.yaml`, tolerances stated "
            "there before evaluation):",
            render_checks(),
            "Fine-grained perf recipes, our estimate of the worst stage with and without their `offload_modules`:",
            render_recipe_rows(),
        ]
    )
