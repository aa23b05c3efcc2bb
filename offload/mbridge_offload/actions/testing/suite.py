"""Run the offload tests (ours, a Megatron Bridge checkout's, or the parity check) and report each result.

Three traps this module avoids: the upstream skill's ``-k "cpu_offload"`` selects zero tests in Bridge (pytest
exit 5 is reported as ``nothing_selected``, ``ok=False``, never as success); a slow answer to that selector (here
it runs the offload suite and ``coverage`` says what did not run); and recursion (a run started from inside a
run, ``MBRIDGE_OFFLOAD_TEST_DEPTH``, is refused, but only after its inputs are checked, so bad input gets the
same answer inside a run as outside).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from mbridge_offload.actions.testing import select as testselect
from mbridge_offload.actions.testing import subject as testsubject
from mbridge_offload.actions.testing.result import TestRunResult, TestSuiteError
from mbridge_offload.actions.testing.run import DEPTH_ENV, PROJECT_ROOT, ProgressFn, parity_run, pytest_run
from mbridge_offload.actions.testing.select import (
    BRIDGE_SELECTOR,
    OFFLOAD_MARKER,
    OFFLOAD_SUITE_ALIASES,
    bridge_files,
    check_expression,
    check_test_path,
    offload_suite_files,
)

__all__ = ["SUITES", "missing_modules", "require_modules", "run_tests", "setup_command"]

SUITES = ("unit", "full", "parity")
# What a run needs in the Python that runs it; the message names the command that installs them.
NEEDS = ("pytest", "torch")


# ---------------------------------------------------------------------------------------------- prerequisites


def setup_command() -> str:
    """The one command that installs what the tests need (pytest, the CPU torch wheel) into this folder's venv."""
    return f"{PROJECT_ROOT / 'scripts' / 'setup'}"


def missing_modules(python: str, modules: tuple[str, ...]) -> list[str]:
    """The ``modules`` that ``python`` cannot import (found by spec, nothing imported); TestSuiteError if it fails."""
    if python == sys.executable:
        return [m for m in modules if importlib.util.find_spec(m) is None]
    probe = "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))"
    try:
        done = subprocess.run([python, "-c", probe, *modules], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestSuiteError(f"the Python that would run the tests ({python}) does not start: {exc}") from None
    if done.returncode != 0:
        raise TestSuiteError(f"the Python that would run the tests ({python}) fails: {done.stderr.strip()[-300:]}")
    return done.stdout.split()


def require_modules(python: str, modules: tuple[str, ...], where: str) -> None:
    """Refuse a run whose Python lacks pytest or torch, naming the install command (never a 0-passed "run")."""
    missing = missing_modules(python, modules)
    if not missing:
        return
    if where == "unit":
        fix = f"run {setup_command()} (the full setup: a venv in this folder with pytest and the CPU torch wheel)"
        fix += f", then use {PROJECT_ROOT / '.venv' / 'bin' / 'mbridge-offload'} test"
    else:
        fix = f"install them in that checkout's environment ({python} -m pip install pytest torch)"
    raise TestSuiteError(f"cannot run the {where} tests: {' and '.join(missing)} not installed for {python}; {fix}")


def _refuse_nested() -> None:
    """Refuse to start a run from inside a run (called after every input check, just before starting one)."""
    if int(os.environ.get(DEPTH_ENV, "0") or 0) >= 1:
        raise TestSuiteError(
            "refusing to start a test run from inside a test run (run_unit_tests was called by a "
            "test that run_unit_tests started); select fewer tests"
        )


def _python_for(repo: Path | None) -> str:
    if repo is not None:
        for candidate in (repo / ".venv" / "bin" / "python", repo / ".venv" / "Scripts" / "python.exe"):
            if candidate.is_file():
                return str(candidate)
    return sys.executable


# ---------------------------------------------------------------------------------------------- running


def run_tests(
    k: str | None = None,
    bridge_repo: str | os.PathLike[str] | None = None,
    suite: str = "unit",
    timeout_s: float = 600.0,
    on_progress: ProgressFn | None = None,
    config: str | None = None,
    steps: int | None = None,
    path: str | None = None,
    repo_python: bool = True,
) -> TestRunResult:
    """Run a test suite and report every result, with a ``coverage`` paragraph saying what ran.

    ``suite``: ``unit`` (the tests marked ``cpu_offload``, unless ``k`` or ``path`` select otherwise), ``full``
    (every test) or ``parity`` (``config`` and ``steps`` apply). ``k`` is a validated pytest expression; with
    ``bridge_repo`` it replaces the Bridge offload selector, and ``repo_python`` picks the checkout's ``.venv``.
    At ``timeout_s`` the whole process group is killed.

    Raises:
        TestSuiteError: bad input, or a run started from inside a run (after the inputs are checked).
    """
    if suite not in SUITES:
        raise TestSuiteError(f"suite {suite!r} is not one of {', '.join(SUITES)}")
    if timeout_s <= 0:
        raise TestSuiteError(f"timeout_s is {timeout_s}; pass a positive number of seconds")
    expr = check_expression(k) if k is not None else None
    if suite == "parity":
        if bridge_repo is not None or expr is not None or path is not None:
            raise TestSuiteError("suite=parity takes a config (and steps), not k, path or bridge_repo")
        _refuse_nested()
        result = parity_run(config, steps, timeout_s, on_progress)
        result.under_test = testsubject.parity(result.details)
        result.coverage = (
            "Ran the parity check: a tiny GPT trained with the config's offload settings and without. "
            + result.under_test.summary
        )
        return result
    if bridge_repo is not None:
        return _bridge_run(bridge_repo, expr, path, suite, timeout_s, on_progress, repo_python)
    if suite == "full" and path is not None:
        raise TestSuiteError("suite=full runs every test of tests/; pass path with suite=unit instead")
    return _unit_run(expr, path, suite == "full", timeout_s, on_progress)


def _bridge_run(
    bridge_repo: str | os.PathLike[str],
    expr: str | None,
    path: str | None,
    suite: str,
    timeout_s: float,
    on_progress: ProgressFn | None,
    repo_python: bool,
) -> TestRunResult:
    """A Megatron Bridge checkout's offload-related test files, with the Bridge selector unless ``expr``."""
    if path is not None:
        raise TestSuiteError("path selects one of this project's test files; with bridge_repo use k instead")
    if suite == "full":
        raise TestSuiteError("suite=full runs this project's whole suite; with bridge_repo use suite=unit")
    root = Path(bridge_repo).expanduser().resolve()
    files = bridge_files(root)
    python = _python_for(root) if repo_python else sys.executable  # never the checkout's .venv unless allowed
    require_modules(python, NEEDS, "Megatron Bridge")
    _refuse_nested()
    selector = expr or BRIDGE_SELECTOR
    result = pytest_run("bridge", root, files, selector, python, timeout_s, on_progress, [])
    result.coverage = (
        f"Ran Megatron Bridge's offload-related tests in {root}: {', '.join(files)} with -k {selector!r}: "
        f"{result.selected if result.selected is not None else len(result.tests)} tests selected, "
        f"{result.deselected} deselected."
    )
    result.under_test = testsubject.bridge(root, f"its {', '.join(files)} selected by -k {selector!r}")
    result.coverage += " " + result.under_test.summary
    return result


def _unit_run(
    expr: str | None, path: str | None, full: bool, timeout_s: float, on_progress: ProgressFn | None
) -> TestRunResult:
    """This project's tests: the offload suite (default, or ``-k cpu_offload``), a path, a ``-k`` selection, all."""
    tests_dir = PROJECT_ROOT / "tests"
    if not tests_dir.is_dir():
        raise TestSuiteError(f"this installation has no tests folder ({tests_dir}); run from a source checkout")
    offload_suite = not full and path is None and (expr is None or expr in OFFLOAD_SUITE_ALIASES)
    files = offload_suite_files() if offload_suite else [check_test_path(path)] if path else ["tests"]
    alias = expr if expr in OFFLOAD_SUITE_ALIASES else None
    if path is not None and alias:
        expr = None  # the alias on one file: the marked tests of that file
    require_modules(sys.executable, NEEDS, "unit")
    _refuse_nested()
    marker = OFFLOAD_MARKER if offload_suite or (path is not None and alias) else None
    result = pytest_run(
        "unit", PROJECT_ROOT, files, expr if not marker else None, sys.executable, timeout_s, on_progress,
        [str(PROJECT_ROOT)], marker=marker,
    )  # fmt: skip
    if alias:
        result.notes.insert(
            0,
            f"-k {alias!r} (the upstream skill's selector) runs the offload suite here (the tests marked "
            f"{OFFLOAD_MARKER}{f' in {path}' if path else ''}): "
            f"{result.selected if result.selected is not None else '?'} tests; --all runs the whole suite",
        )
    if offload_suite:
        tests = f"the offload suite (the tests marked {OFFLOAD_MARKER} in {len(files)} files)"
    else:
        tests = "the whole suite (tests/)" if files == ["tests"] else ", ".join(files)
        tests += f" selected by -m {marker}" if marker else f" selected by -k {expr!r}" if expr else ""
    ran = [t.nodeid for t in result.tests if t.outcome in testsubject.RAN]  # a skipped test covers nothing
    result.under_test = testsubject.ours(PROJECT_ROOT, tests, ran)
    if offload_suite:
        result.coverage = testselect.offload_coverage(result, files)
    else:
        selection = f"-m {marker}" if marker else f"-k {expr!r}" if expr else None
        result.coverage = testselect.plain_coverage(result, files, selection)
        if expr and not marker and (note := _few_selected_note(result, expr)):
            result.notes.insert(0, note)
    result.coverage += " " + result.under_test.summary
    return result


def _few_selected_note(result: TestRunResult, expr: str) -> str | None:
    """A note when a -k selection runs only a small part of what it selected from (say how many of how many)."""
    if result.selected is None:
        return None
    total = result.selected + result.deselected
    if total == 0 or result.selected > testselect.FEW_SELECTED_SHARE * total:
        return None
    return f"-k {expr!r} selected {result.selected} of the {total} tests it chose from; --all runs the whole suite"
