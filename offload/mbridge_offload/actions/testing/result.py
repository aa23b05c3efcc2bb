"""The result of a test run, as the library, the CLI's ``--json`` and the MCP tool ``run_unit_tests`` report it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, computed_field, field_serializer

from mbridge_offload.actions.testing.subject import CodeUnderTest
from mbridge_offload.config.errors import InputError


class TestSuiteError(InputError):
    """Bad input for a test run (an unsafe -k expression, a path that is not a Bridge checkout, ...)."""

    __test__ = False  # not a pytest test class


class TestOutcome(BaseModel):
    """One test's result; ``message`` (the failure text) is reported under ``failures``, not per test."""

    __test__ = False  # not a pytest test class
    nodeid: str
    outcome: str
    duration_s: float = 0.0
    message: str | None = Field(default=None, exclude=True)


class TestFailure(BaseModel):
    nodeid: str
    message: str | None = None


class TestRunResult(BaseModel):
    """A test run as the library, the CLI's ``--json`` and the MCP tool all report it."""

    __test__ = False  # not a pytest test class
    suite: str
    command: list[str]
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    selected: int | None = None
    deselected: int = Field(default=0, exclude=True)
    duration_s: float = 0.0
    exit_code: int | None = None
    timed_out: bool = False
    nothing_selected: bool = False
    coverage: str = Field(
        default="",
        description="one paragraph: what this run covered (files, counts) and what it left out, and how to run it",
    )
    tests: list[TestOutcome] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    output_tail: str = Field(default="", exclude=True)
    details: dict[str, Any] | None = Field(
        default=None, description="parity suite: loss curves and deltas, the loss fall, split, bytes (no timing)"
    )
    under_test: CodeUnderTest | None = Field(
        default=None,
        description="the code under test: this project's runtime and rules (path, version, commit), a Megatron "
        "Bridge checkout's, or for parity the optimizer trained and the cluster recipe for megatron-core's own",
    )

    @computed_field(description="everything selected passed and at least one test ran")  # type: ignore[prop-decorator]
    @property
    def ok(self) -> bool:
        return (
            self.exit_code == 0
            and not self.timed_out
            and not self.nothing_selected
            and self.failed == 0
            and self.errors == 0
        )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def failures(self) -> list[TestFailure]:
        return [TestFailure(nodeid=t.nodeid, message=t.message) for t in self.tests if t.outcome in ("failed", "error")]

    @field_serializer("duration_s")
    def _rounded(self, value: float) -> float:
        return round(value, 3)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
