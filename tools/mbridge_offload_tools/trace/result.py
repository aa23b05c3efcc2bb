"""The shape of ``trace`` / ``trace_memory``'s answer: the MCP output schema, and the CLI's JSON validated against it.

``trace.run.trace_answer`` validates its dict against :class:`TraceAnswer` before it leaves, so the CLI's JSON and
the MCP result cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class TracedPhase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="forward_backward, loss or optimizer_step")
    memory_gib: float = Field(ge=0, description="the phase's peak allocated, GiB")
    breakdown_gib: dict[str, float] = Field(description="that peak by category: " + "weights, gradients, optimizer, "
                                            "activations, other")  # fmt: skip


class TraceAnswer(BaseModel):
    """megatron-core's own step for one pipeline stage, traced on fake tensors (``docs/trace.md``)."""

    model_config = ConfigDict(extra="forbid")

    unit: str = Field(description="what the GiB figures count (allocated by tensors, simulated on CPU)")
    memory_gib: dict[str, float] = Field(description="the peak phase by category; total = the peak")
    phases: list[TracedPhase]
    peak_phase: str
    stage: int = Field(ge=0, description="the pipeline stage traced (the planner's worst unless asked)")
    by_module: dict[str, float] = Field(description="GiB alive at the peak by module (the 40 largest)")
    host_gib: float = Field(ge=0, description="host memory held at the end of the step (HDO's CPU share)")
    host_peak_gib: float = Field(ge=0)
    params: int = Field(ge=0, description="parameters on this rank")
    param_bytes: int = Field(ge=0)
    allocations: int = Field(ge=0, description="allocations the trace counted")
    seconds: float = Field(ge=0, description="how long the traced step took to simulate")
    under_test: dict[str, str | None] = Field(description="megatron-core release, layer spec, schedule, optimizer")
    model: str | None
    parallel: dict[str, int | None]
    notes: list[str]
    assumptions: list[dict[str, Any]] = Field(description="every planner input the spec used, with its source")
