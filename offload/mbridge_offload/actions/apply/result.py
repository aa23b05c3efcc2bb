"""What ``apply`` reports: its error, each key edit with its reason, and the result it returns.

The result is the library's value, the CLI's ``--json`` and the MCP tool's output alike. Never imports torch.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, computed_field

from mbridge_offload.config.effective import EffectiveValue
from mbridge_offload.config.sources import ConfigError


class ApplyError(ConfigError):
    """The requested edit cannot be made as asked; the message says what to change instead."""


class Change(BaseModel):
    """One key edit, with the reason for it."""

    key: str = Field(description="dotted key, e.g. optimizer.optimizer_offload_fraction")
    old: Any = None
    new: Any = None
    why: str

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class ApplyResult(BaseModel):
    """The result of :func:`apply_offload`: the library's value, the CLI's ``--json`` and the MCP output."""

    ok: bool = Field(description="the edited config passes validation")
    mode: str = Field(description="the mode applied (the planner's choice for mode=recommended)")
    changes: list[Change]
    findings: list[dict[str, Any]] = Field(description="validator findings on the edited config")
    written: str | None = Field(None, description="the path written, or null for a dry run / refusal")
    backup: str | None = Field(None, description="the backup of the file replaced, if one was")
    diff: str = Field(description="unified diff of the config")
    overrides: list[str] = Field(description="the same edit as command-line overrides")
    refused: str | None = Field(None, description="why nothing was written although a write was asked for")
    notes: list[str] = Field(default_factory=list)
    assumptions: list[dict[str, Any]] = Field(
        default_factory=list,
        description="mode=recommended / --option: the planner's inputs, each {name, value, source, note}, as "
        "recommend lists them (GPU, GPU count, the node's host RAM and GPUs per node, ...); empty otherwise",
    )
    effective: dict[str, EffectiveValue] = Field(
        default_factory=dict,
        description="the edited config's one effective config (mbridge_offload.config.effective): dotted key → "
        "{value, source}, as validate prints it for the edited file",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="the environment facts the verdict assumed, as validate reports them: te_version (and "
        "te_version_source when assumed), NVTE_CPU_OFFLOAD_V1 as the job would see it",
    )
    text: str = Field("", exclude=True, description="the edited config text (library only)")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def why(self) -> list[str]:
        """``key: reason`` for each change."""
        return [f"{c.key}: {c.why}" for c in self.changes]

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
