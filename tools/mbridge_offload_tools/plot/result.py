"""The answer of ``plot``: the points it drew and where the picture went (CLI ``--json`` and MCP structured output)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from mbridge_offload.config.effective import EffectiveValue
from mbridge_offload.plan.inputs.resolve import Assumption
from mbridge_offload.plan.results import EFFECTIVE_DOC, UNIT, MemoryBreakdown, StageGib

Kind = Literal["sweep", "phases", "options"]
KINDS: tuple[Kind, ...] = ("sweep", "phases", "options")
ImageFormat = Literal["svg", "png"]
MIME_TYPES: dict[str, str] = {"svg": "image/svg+xml", "png": "image/png"}


class SweepPoint(BaseModel):
    """One value of the swept input and ``estimate``'s answer there (the same numbers, not a copy of the model)."""

    value: int | float = Field(description="the swept input's value at this point (an int for a whole-number input)")
    memory_gib: MemoryBreakdown = Field(description="estimate's memory_gib at this value (worst pipeline stage)")
    memory_gb: MemoryBreakdown = Field(description="estimate's memory_gb at this value")
    stages_gib: list[StageGib] = Field(description="peak allocated per pipeline stage, GiB (estimate's stages)")
    worst_stage: int
    step_time_s: float = Field(description="estimate's time_s.step at this value")
    step_time_factor: float = Field(description="estimate's step_time_factor at this value")
    fits: bool = Field(description="estimate's fits at this value")
    budget_gib: float = Field(description="estimate's budget_gib at this value (the line drawn)")
    host_gb: float = Field(description="estimate's host_gb at this value")


class PhasePoint(BaseModel):
    """One phase of the step on one pipeline stage (``estimate``'s ``phases``)."""

    stage: int
    phase: str
    memory_gib: float
    memory_gb: float
    what: str = ""
    peak: bool = Field(description="this phase sets the stage's peak")


class OptionPoint(BaseModel):
    """One of ``recommend``'s ranked options (``options[rank]``)."""

    rank: int
    overrides: list[str]
    levers: list[str]
    memory_gib: float = Field(description="the option's memory_gib.total (worst pipeline stage)")
    stages_gib: list[StageGib]
    step_time_s: float
    step_time_factor: float
    fits: bool
    comfortable: bool
    alternative: bool
    margin_gib: float
    why: str


class Picture(BaseModel):
    """What a picture is drawn from (the docs commit exactly these values beside their pictures,
    docgen/docs/plots.py)."""

    kind: Kind
    sweep_key: str | None = Field(None, description="the swept planner input (kind sweep)")
    title: str
    budget_gib: float = Field(
        description="the budget line: estimate's allocatable peak (sweep, phases; at the first point), recommend's "
        "budget with its margin kept (options)"
    )
    given_gib: float | None = Field(None, description="options: the config as given (recommend's memory_gib.before)")
    given_step_s: float | None = Field(None, description="options: the config as given (estimate's time_s.step)")
    points: list[SweepPoint] | list[PhasePoint] | list[OptionPoint]
    peak_phase: str | None = Field(None, description="phases: the phase that sets the worst stage's peak")


class PlotResult(Picture):
    """``plot``: the picture's points, what they are of, and where the picture was written."""

    model: str
    gpu: str
    num_gpus: int
    format: ImageFormat = Field(description="the picture's format: svg or png")
    mime_type: str
    written: str | None = Field(None, description="the file written, or null (MCP without output)")
    backup: str | None = Field(None, description="the backup of the file it replaced (--force / overwrite)")
    unit: str = UNIT
    notes: list[str] = []
    assumptions: list[Assumption] = Field(description="the inputs of the answer (first point of a sweep) and sources")
    effective: dict[str, EffectiveValue] = Field(default_factory=dict, description=EFFECTIVE_DOC)

    def picture(self) -> dict[str, object]:
        """The values the picture is drawn from (:class:`Picture`'s fields), as JSON."""
        return self.model_dump(mode="json", include=set(Picture.model_fields))
