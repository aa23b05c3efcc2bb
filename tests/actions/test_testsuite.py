"""mbridge_offload.actions.testing.suite: selection, nothing-selected detection, failures, timeouts, Bridge
checkouts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mbridge_offload
from mbridge_offload.actions.testing import select as testselect
from mbridge_offload.actions.testing.result import TestRunResult, TestSuiteError
from mbridge_offload.actions.testing.run import DEPTH_ENV
from mbridge_offload.actions.testing.select import (
    BRIDGE_SELECTOR,
    OFFLOAD_MARKER,
    check_expression,
    offload_suite_files,
)
from mbridge_offload.actions.testing.suite import missing_modules, run_tests

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
    (root / "src/megatron/bridge").mkdir(parents=True)
    (root / "src/megatron/bridge/package_info.py").write_text('MAJOR = 0\nMINOR = 6\nPATCH = 2\nPRE_RELEASE = ""\n')
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
    # Bridge's code ran, not ours: the answer says which checkout and version (read from its package_info.py).
    under = result.under_test
    assert under is not None and under.kind == "megatron-bridge" and under.path == str(bridge.resolve())
    assert under.version == "0.6.2" and under.commit is None
    assert "this project's code did not run" in under.summary and under.summary in result.coverage
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


@nested
def test_not_a_bridge_checkout(tmp_path: Path) -> None:
    with pytest.raises(TestSuiteError, match="Megatron Bridge checkout"):
        run_tests(bridge_repo=tmp_path)


@nested
def test_paths_must_stay_inside_tests() -> None:
    with pytest.raises(TestSuiteError, match="outside"):
        run_tests(path="offload/mbridge_offload/actions/apply/apply.py")
    with pytest.raises(TestSuiteError, match="does not exist"):
        run_tests(path="tests/test_nope.py")


def test_nested_runs_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEPTH_ENV, "1")
    with pytest.raises(TestSuiteError, match="inside a test run"):
        run_tests(k="apply")


# ------------------------------------------------------------------------------------------ the cpu_offload selector

THIS_FILE = "tests/actions/test_testsuite.py"
OFFLOAD_SUITE = [
    "tests/config/test_rules.py",
    "tests/runtime/test_activation.py",
    "tests/runtime/test_optimizer.py",
    "tests/runtime/test_optimizer_checkpoint.py",
    "tests/runtime/test_optimizer_resume.py",
]


def test_the_offload_suite_is_the_files_marked_cpu_offload() -> None:
    # HDO parity, resume, checkpoints, activation schedule, rules: found by reading the files, and each really
    # carries the marker pytest selects by (a text match that pytest would not honour would be a false count).
    import importlib

    assert offload_suite_files() == OFFLOAD_SUITE
    for path in OFFLOAD_SUITE:
        module = importlib.import_module(path[:-3].replace("/", "."))
        assert module.pytestmark.name == OFFLOAD_MARKER, path


def test_inside_a_run_bad_input_gets_its_own_answer_not_the_nested_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    # The recursion guard used to fire first, so input-checking tests failed only when run through the tool.
    monkeypatch.setenv(DEPTH_ENV, "1")
    with pytest.raises(TestSuiteError, match="'&'"):
        run_tests(k="a && b")
    with pytest.raises(TestSuiteError, match="outside"):
        run_tests(path="../etc/passwd")
    with pytest.raises(TestSuiteError, match="is not one of unit, full, parity"):
        run_tests(suite="everything")
    with pytest.raises(TestSuiteError, match="inside a test run"):
        run_tests()


def test_the_offload_coverage_paragraph_names_each_file_the_counts_and_the_way_to_everything() -> None:
    result = TestRunResult(suite="unit", command=[], selected=187, passed=186, failed=1)
    text = testselect.offload_coverage(result, OFFLOAD_SUITE)
    assert "187 tests (186 passed, 1 failed, 0 skipped, 0 errors) in 5 files" in text
    assert all(f"{f} (" in text for f in OFFLOAD_SUITE)
    assert "HybridDeviceOptimizer: parity with torch AdamW" in text
    others = len(testselect.test_files()) - len(OFFLOAD_SUITE)
    assert f"Not run: the {others} other test files (" in text and "--all" in text and "suite='full'" in text


@nested
def test_cpu_offload_selector_runs_the_marked_tests_and_says_so() -> None:
    # One marked file by path keeps the nested run short; without path the same selection covers all five.
    path = "tests/runtime/test_optimizer_checkpoint.py"
    result = run_tests(k="cpu_offload", path=path, timeout_s=300)
    assert result.command[-2:] == ["-m", OFFLOAD_MARKER] and "-k" not in result.command
    assert result.selected == result.passed == 8 and result.ok
    assert result.notes[0].startswith("-k 'cpu_offload' (the upstream skill's selector) runs the offload suite")
    assert result.coverage.startswith(f"Ran {path} selected by -m cpu_offload: 8 tests (8 passed, 0 failed, 0 "
        "skipped, 0 errors); the rest of the suite did not run (--all runs everything). Tested this project's code: "
        "mbridge-offload ")  # fmt: skip
    # Whose code passed: this project's package, where it was imported from, and the tests that ran.
    under = result.under_test
    assert under is not None and under.kind == "mbridge-offload" and under.package == "mbridge_offload"
    assert under.path == str(Path(mbridge_offload.__file__).resolve().parent)
    assert under.version == mbridge_offload.__version__ and under.tests == f"{path} selected by -m cpu_offload"
    assert under.summary in result.coverage and under.cluster_recipe is None
    # Only the part those tests cover is named: the planner's and the rules' tests did not run.
    assert "the parts whose tests ran: the HybridDeviceOptimizer)" in under.summary
    assert "planner" not in under.summary and "rules" not in under.summary


def test_suite_full_and_the_bridge_or_a_path_do_not_mix(tmp_path: Path) -> None:
    with pytest.raises(TestSuiteError, match="suite=full runs every test"):
        run_tests(suite="full", path=THIS_FILE)


@nested
def test_a_thin_selection_says_how_many_of_how_many() -> None:
    result = run_tests(k="test_reasonable_expressions_pass", path=THIS_FILE, timeout_s=300)
    assert (result.selected, result.passed) == (1, 1)
    total = result.selected + result.deselected
    assert total >= 15
    assert result.notes[0] == (
        f"-k 'test_reasonable_expressions_pass' selected 1 of the {total} tests it chose from; "
        "--all runs the whole suite"
    )
    assert result.coverage.startswith(f"Ran {THIS_FILE} selected by -k 'test_reasonable_expressions_pass': 1 tests")
    # A selection of most of the suite runs without a note.
    broad = run_tests(k="not test_reasonable_expressions_pass", path=THIS_FILE, timeout_s=300)
    assert broad.selected == total - 1 and not any("selected" in n for n in broad.notes)


# ------------------------------------------------------------------------------------------ without pytest or torch


def test_missing_modules_are_found_by_spec_in_any_python() -> None:
    assert missing_modules(sys.executable, ("pytest", "no_such_module_xyz")) == ["no_such_module_xyz"]
    from tests.support.skill_copy import base_python

    # The bare interpreter (no venv) has no pytest here; the probe runs it without importing anything.
    assert "no_such_module_xyz" in missing_modules(base_python(), ("no_such_module_xyz",))
    with pytest.raises(TestSuiteError, match="does not start"):
        missing_modules("/nonexistent/python", ("pytest",))


@pytest.fixture(scope="module")
def light_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.skill_copy import light_skill_copy

    return light_skill_copy(tmp_path_factory.mktemp("skill"))


@nested
def test_test_command_without_pytest_or_torch_exits_2_with_the_install_command(light_copy: Path) -> None:
    # A light set-up (config side only) has neither pytest nor torch: `test` must refuse, not report "0 passed".
    from tests.support.skill_copy import clean_env

    done = subprocess.run(
        [".venv/bin/mbridge-offload", "test", "--json"],
        cwd=light_copy,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    (error,) = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert error["ok"] is False
    assert "pytest and torch not installed" in error["error"]
    assert f"run {light_copy / 'scripts' / 'setup'}" in error["error"]
    assert "Traceback" not in done.stderr


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@nested
@pytest.mark.anyio
async def test_run_unit_tests_without_pytest_is_a_tool_error_naming_the_setup(light_copy: Path) -> None:
    # The copy's own launcher starts its server (as .mcp.json does); the tool answers is_error with the same text.
    from mcp import Client, StdioServerParameters

    from tests.support.skill_copy import clean_env

    params = StdioServerParameters(
        command=str(light_copy / "scripts" / "mcp-server"), cwd=str(light_copy), env=clean_env()
    )
    async with Client(params) as client:
        result = await client.call_tool("run_unit_tests", {"k": "apply"})
        assert result.is_error
        text = result.content[0].text
        assert "pytest and torch not installed" in text and "scripts/setup" in text
        # The server keeps answering.
        ok = await client.call_tool("validate_config", {"config": "examples/qwen3_30b_a3b_pretrain.yaml"})
        assert not ok.is_error
