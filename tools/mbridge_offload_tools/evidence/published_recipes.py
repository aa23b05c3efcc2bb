"""Peak memory NVIDIA publishes for Megatron Bridge recipes (``data/published_recipes.yaml``) against the planner.

Each row is the planner's ordinary ``estimate`` for the settings the recipe ran with (no per-row tuning), compared
with the published peak allocated memory and step time; every row is held out (the data file says why). Rendered
into ``docs/planner.md`` (``render_table``) and held to its tolerance by ``tests/plan/test_phases.py``. Never imports
torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mbridge_offload_tools.evidence import data_files


def load() -> dict[str, Any]:
    """The data file, parsed (``data/published_recipes.yaml``)."""
    return data_files.load("published_recipes")


@dataclass
class RecipeRow:
    """One published recipe with the planner's prediction for it."""

    id: str
    measured_gib: float
    predicted_gib: float
    peak_phase: str
    worst_stage: int
    measured_step_s: float | None
    predicted_step_s: float
    tolerance: dict[str, float]

    @property
    def memory_error(self) -> float:
        return self.predicted_gib / self.measured_gib - 1

    @property
    def step_error(self) -> float | None:
        return None if self.measured_step_s is None else self.predicted_step_s / self.measured_step_s - 1


def predict(row: dict[str, Any]) -> RecipeRow:
    """The planner's answer for one row's inputs."""
    from mbridge_offload.plan.service import estimate_for_inputs

    est = estimate_for_inputs(**row["inputs"])
    measured = row["measured"]
    return RecipeRow(
        id=row["id"],
        measured_gib=measured["peak_allocated_gib"],
        predicted_gib=est.memory_gib.total,
        peak_phase=est.peak_phase or "",
        worst_stage=est.worst_stage,
        measured_step_s=measured.get("step_s"),
        predicted_step_s=est.time_s.step,
        tolerance=row["tolerance"],
    )


def accuracy() -> list[RecipeRow]:
    """Every checked row with the planner's prediction."""
    return [predict(row) for row in load()["rows"]]


def render_table() -> str:
    """The markdown table of ``docs/planner.md`` (generated; see mbridge_offload_tools.docgen.registry)."""
    lines = [
        "| recipe | peak allocated, published (GiB) | predicted | error | phase (stage) | s/update, published | "
        "predicted | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in accuracy():
        step = "—" if r.measured_step_s is None else f"{r.measured_step_s:g}"
        step_error = "—" if r.step_error is None else f"{r.step_error:+.1%}"
        lines.append(
            f"| {r.id} | {r.measured_gib:g} | {r.predicted_gib:.1f} | {r.memory_error:+.1%} | {r.peak_phase} "
            f"({r.worst_stage}) | {step} | {r.predicted_step_s:.0f} | {step_error} |"
        )
    unchecked = ", ".join(c["id"] for c in load().get("context", []))
    lines += [
        "",
        "Every row is held out: nothing in the planner is fitted to it. Settings the docstring states and those "
        "assumed (with why) are listed per row in `tools/mbridge_offload_tools/evidence/data/published_recipes.yaml`; "
        f"published peaks recorded but not checked (no architecture for the model, or a bound): {unchecked}.",
    ]
    return "\n".join(lines) + "\n"
