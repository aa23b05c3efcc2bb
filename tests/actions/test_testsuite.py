"""offload/actions/testsuite.py: selection, nothing-selected detection, failures, timeouts, Bridge checkouts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from mbridge_offload.actions.testsuite import BRIDGE_SELECTOR, DEPTH_ENV, TestSuiteError, check_expression, run_tests

nested = pytest.mark.skipif(int(os.environ.get(DEPTH_ENV, "0") or 0) > 0, reason="nested inside run_unit_tests")

OPTIM_TESTS = """\
import pytest


class TestSyncHybridDeviceOptimizerFp32MasterCopies:
    def test_none_optimizer_is_a_no_op(self):
        assert True

    def test_walks_chained_optimizers(self):
        assert 1 + 1 == 3, "chained walk broke"


@pytest.mark.parametrize("cpu_offload", [True, False], ids=["cpu_offload", "no_offload"])
def test_fp32_state_loading_patch(cpu_offload):
    assert isinstance(cpu_offload, bool)


def test_unrelated_scheduler():
    assert True
"""

SPEC_TESTS = """\
def test_layer_spec_builds():
    config = {"cpu_offloading": False}  # mentions offloading only in a fixture, like upstream
    assert config
"""


@pytest.fixture
def bridge(tmp_path: Path) -> Path:
    root = tmp_path / "Megatron-Bridge"
    (root / "tests/unit_tests/training").mkdir(parents=True)
    (root / "tests/unit_tests/models").mkdir(parents=True)
    (root / "tests/unit_tests/training/test_optim.py").write_text(OPTIM_TESTS)
    (root / "tests/unit_tests/models/test_gpt_full_te_layer_autocast_spec.py").write_text(SPEC_TESTS)
    return root


@pytest.mark.parametrize("expr", ["a; b", "a && b", "$(id)", "`id`", "a | b", "a > /tmp/x", "-p evil", "a\nb"])
def test_unsafe_expressions_are_rejected(expr: str) -> None:
    with pytest.raises(TestSuiteError):
        check_expression(expr)


def test_unparsable_expression_is_rejected_with_pytests_reason() -> None:
    with pytest.raises(TestSuiteError, match="does not parse"):
        check_expression("apply and (")


def test_reasonable_expressions_pass() -> None:
    assert check_expression(" apply or (diagnose and not slow) ") == "apply or (diagnose and not slow)"
    assert check_expression(BRIDGE_SELECTOR) == BRIDGE_SELECTOR


@nested
def test_bridge_selector_selects_the_offload_tests_and_reports_failures(bridge: Path) -> None:
    result = run_tests(bridge_repo=bridge, timeout_s=60)
    assert result.command[:3] == [sys.executable, "-m", "pytest"]
    assert result.command[-2:] == ["-k", BRIDGE_SELECTOR]
    names = sorted(t.nodeid.split("::", 1)[1] for t in result.tests)
    assert names == [
        "TestSyncHybridDeviceOptimizerFp32MasterCopies::test_none_optimizer_is_a_no_op",
        "TestSyncHybridDeviceOptimizerFp32MasterCopies::test_walks_chained_optimizers",
        "test_fp32_state_loading_patch[cpu_offload]",
        "test_fp32_state_loading_patch[no_offload]",
    ]
    assert (result.passed, result.failed, result.ok) == (3, 1, False)
    (failure,) = result.failures
    assert failure.nodeid.endswith("test_walks_chained_optimizers")
    assert "chained walk broke" in failure.message


@nested
def test_the_upstream_skill_selector_is_reported_as_nothing_selected(tmp_path: Path) -> None:
    root = tmp_path / "bridge"
    (root / "tests/unit_tests/models").mkdir(parents=True)
    (root / "tests/unit_tests/models/test_gpt_full_te_layer_autocast_spec.py").write_text(SPEC_TESTS)
    result = run_tests(k="cpu_offload", bridge_repo=root, timeout_s=60)
    assert result.nothing_selected and not result.ok
    assert result.exit_code == 5 and result.passed == 0
    assert "not a pass" in result.notes[0]


@nested
def test_timeout_kills_the_run_and_says_so(tmp_path: Path) -> None:
    root = tmp_path / "bridge"
    (root / "tests/unit_tests/training").mkdir(parents=True)
    (root / "tests/unit_tests/training/test_optim.py").write_text(
        "import time\n\ndef test_cpu_offload_hangs():\n    time.sleep(60)\n"
    )
    result = run_tests(bridge_repo=root, timeout_s=3)
    assert result.timed_out and not result.ok
    assert result.duration_s < 20
    assert "timeout" in result.notes[0]


def test_not_a_bridge_checkout(tmp_path: Path) -> None:
    with pytest.raises(TestSuiteError, match="Megatron Bridge checkout"):
        run_tests(bridge_repo=tmp_path)


def test_paths_must_stay_inside_tests() -> None:
    with pytest.raises(TestSuiteError, match="outside"):
        run_tests(path="offload/actions/apply.py")
    with pytest.raises(TestSuiteError, match="does not exist"):
        run_tests(path="tests/test_nope.py")


def test_nested_runs_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEPTH_ENV, "1")
    with pytest.raises(TestSuiteError, match="inside a test run"):
        run_tests(k="apply")
