"""Run the offload tests — ours, a Megatron Bridge checkout's, or the parity check — and report each result.

``run_tests`` starts pytest in a subprocess (arguments as a list, never a shell string), with a timeout, and
streams one progress event per finished test through a callback. Results come from a tiny pytest plugin
written next to the run (``@@mbridge-offload@@ {json}`` lines on stdout), so node ids, outcomes, durations and
the short failure text are pytest's own, not scraped from the terminal.

Two traps this module exists to avoid:
- the upstream skill's ``pytest ... -k "cpu_offload"`` selects zero tests in Megatron Bridge (pytest exits 5,
  "no tests ran"), and a second ``-k`` silently replaces the first. Here exit code 5 is reported as
  ``nothing_selected`` and ``ok=False``, never as success, and the Bridge selector is one expression over the
  files that really hold offload tests;
- recursion: a test of this module runs pytest, which could run that test again. Nested runs are refused
  (``MBRIDGE_OFFLOAD_TEST_DEPTH``), and tests of this module skip themselves inside a nested run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, computed_field, field_serializer

from mbridge_offload.config.errors import InputError

ProgressFn = Callable[[int, int | None, str], None]

MARK = "@@mbridge-offload@@ "
DEPTH_ENV = "MBRIDGE_OFFLOAD_TEST_DEPTH"
PROJECT_ROOT = Path(__file__).resolve().parents[3]

# Megatron Bridge test files that hold offload-related tests (found by reading its tests/unit_tests tree). The
# skill's pair (test_gpt_full_te_layer_autocast_spec.py, peft/test_utils.py) has none; test_optim.py and
# test_config.py do.
BRIDGE_TEST_FILES = (
    "tests/unit_tests/training/test_optim.py",
    "tests/unit_tests/training/test_config.py",
    "tests/unit_tests/models/test_gpt_full_te_layer_autocast_spec.py",
    "tests/unit_tests/peft/test_utils.py",
)
BRIDGE_SELECTOR = "cpu_offload or offload or HybridDevice"

# The upstream skill's selector. Every test of this project is an offload test, but only a handful are *named*
# cpu_offload, so for our own suite the name means "the whole offload suite" (run without -k, and said so).
WHOLE_SUITE_ALIASES = ("cpu_offload",)
# A -k selection that leaves out more than this share of the suite gets a note with both counts.
FEW_SELECTED_SHARE = 0.5
# What the unit suite needs in the Python that runs it; the message names the command that installs them.
UNIT_NEEDS = ("pytest", "torch")
BRIDGE_NEEDS = ("pytest", "torch")

_K_ALLOWED = re.compile(r"^[A-Za-z0-9_ .\-\[\]()/:]+$")

_PLUGIN = """
import json, sys
MARK = %r

def _emit(event):
    # a leading newline: -q progress dots share the line otherwise
    sys.stdout.write("\\n" + MARK + json.dumps(event) + "\\n")
    sys.stdout.flush()

def pytest_deselected(items):
    _emit({"event": "deselected", "count": len(items)})

def pytest_collection_finish(session):
    _emit({"event": "collected", "count": len(session.items)})

def pytest_runtest_logreport(report):
    failed_phase = report.when != "call" and report.outcome != "passed"
    if report.when != "call" and not failed_phase:
        return
    outcome = report.outcome
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    elif report.when != "call" and report.failed:
        outcome = "error"
    message = None
    if report.failed:
        text = getattr(report, "longreprtext", "") or ""
        lines = [l for l in text.splitlines() if l.strip()]
        errs = [l for l in lines if l.startswith("E ")]
        message = "\\n".join((errs or lines)[-6:])[:1500]
    elif report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])[:300]
    _emit({"event": "test", "nodeid": report.nodeid, "outcome": outcome,
           "duration_s": round(report.duration, 4), "message": message})
"""


class TestSuiteError(InputError):
    """Bad input for a test run (an unsafe -k expression, a path that is not a Bridge checkout, ...)."""

    __test__ = False  # not a pytest test class


class TestOutcome(BaseModel):
    """One test's result; ``message`` (the failure text) is reported under ``failures``, not per test."""

    __test__ = False  # not a pytest test class
    nodeid: str
    outcome: str
    duration_s: float = 0.0
    message: str | None = Field(None, exclude=True)


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
    deselected: int = Field(0, exclude=True)
    duration_s: float = 0.0
    exit_code: int | None = None
    timed_out: bool = False
    nothing_selected: bool = False
    tests: list[TestOutcome] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    output_tail: str = Field("", exclude=True)
    details: dict[str, Any] | None = Field(None, description="parity suite: loss delta, split, bytes, step ratio")

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


# ---------------------------------------------------------------------------------------------- inputs


def check_expression(expr: str) -> str:
    """Validate a pytest ``-k`` expression and return it stripped.

    Raises:
        TestSuiteError: shell metacharacters, a leading ``-``, or text pytest's own parser rejects.
    """
    expr = expr.strip()
    if not expr:
        raise TestSuiteError("the -k expression is empty; pass names such as 'apply or diagnose', or omit it")
    if len(expr) > 300:
        raise TestSuiteError("the -k expression is longer than 300 characters; select by a few names")
    if expr.startswith("-"):
        raise TestSuiteError(f"-k expression {expr!r} starts with '-', which pytest would read as an option")
    if not _K_ALLOWED.match(expr):
        bad = sorted({c for c in expr if not re.match(r"[A-Za-z0-9_ .\-\[\]()/:]", c)})
        raise TestSuiteError(
            f"-k expression {expr!r} contains {', '.join(repr(c) for c in bad)}: only names, spaces, "
            "'and'/'or'/'not', parentheses, '[]', '.', '-', '/' and ':' are allowed"
        )
    try:
        from _pytest.mark.expression import Expression

        Expression.compile(expr)
    except ImportError:  # pragma: no cover - pytest is a test dependency
        pass
    except Exception as exc:  # ParseError
        raise TestSuiteError(f"-k expression {expr!r} does not parse: {exc}") from None
    return expr


def bridge_files(repo: str | os.PathLike[str]) -> list[str]:
    """The offload-related test files that exist in a Megatron Bridge checkout.

    Raises:
        TestSuiteError: the path is missing or holds none of them.
    """
    root = Path(repo).expanduser()
    if not root.is_dir():
        raise TestSuiteError(
            f"bridge_repo {str(repo)!r} is not a directory; pass the root of a Megatron Bridge "
            "checkout (the folder with src/megatron/bridge and tests/unit_tests)"
        )
    found = [f for f in BRIDGE_TEST_FILES if (root / f).is_file()]
    if not found:
        raise TestSuiteError(
            f"bridge_repo {str(repo)!r} has none of {', '.join(BRIDGE_TEST_FILES)}; is it a Megatron Bridge checkout?"
        )
    return found


def _python_for(repo: Path | None) -> str:
    if repo is not None:
        for candidate in (repo / ".venv" / "bin" / "python", repo / ".venv" / "Scripts" / "python.exe"):
            if candidate.is_file():
                return str(candidate)
    return sys.executable


# ---------------------------------------------------------------------------------------------- prerequisites


def setup_command() -> str:
    """The one command that installs what the tests need (pytest, the CPU torch wheel) into this folder's venv."""
    return f"{PROJECT_ROOT / 'scripts' / 'setup'}"


def missing_modules(python: str, modules: tuple[str, ...]) -> list[str]:
    """The ``modules`` that ``python`` cannot import (found by spec, nothing is imported).

    Raises:
        TestSuiteError: ``python`` does not start (or hangs past 60 s).
    """
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
    """Refuse a run whose Python lacks pytest or torch, naming the install command (never a 0-passed "run").

    Raises:
        TestSuiteError: with the missing modules and the command that installs them.
    """
    missing = missing_modules(python, modules)
    if not missing:
        return
    if where == "unit":
        fix = f"run {setup_command()} (the full setup: a venv in this folder with pytest and the CPU torch wheel)"
        fix += f", then use {PROJECT_ROOT / '.venv' / 'bin' / 'mbridge-offload'} test"
    else:
        fix = f"install them in that checkout's environment ({python} -m pip install pytest torch)"
    raise TestSuiteError(f"cannot run the {where} tests: {' and '.join(missing)} not installed for {python}; {fix}")


def _few_selected_note(result: TestRunResult, expr: str) -> str | None:
    """A note when a -k selection runs only a small part of the suite (say how many, and what the whole is)."""
    if result.selected is None:
        return None
    total = result.selected + result.deselected
    if total == 0 or result.selected > FEW_SELECTED_SHARE * total:
        return None
    return (
        f"-k {expr!r} selected {result.selected} of the {total} tests of the offload suite; "
        "the whole suite runs without -k"
    )


# ---------------------------------------------------------------------------------------------- running


def _stream(
    command: list[str], cwd: Path, env: dict[str, str], timeout_s: float, on_line: Callable[[str], None]
) -> tuple[int | None, bool, list[str]]:
    """Run ``command``, feed each stdout line to ``on_line``; kill the process group at the deadline."""
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    timed_out = threading.Event()

    def _kill() -> None:
        timed_out.set()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout_s, _kill)
    timer.daemon = True
    timer.start()
    tail: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            on_line(line.rstrip("\n"))
            if MARK not in line and line.strip():
                tail.append(line.rstrip("\n"))
                del tail[:-40]
        proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            _kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    return (None if timed_out.is_set() else proc.returncode), timed_out.is_set(), tail


# pytest outcome → the counter it adds to.
_BUCKET = {
    "passed": "passed",
    "xfailed": "skipped",
    "skipped": "skipped",
    "xpassed": "passed",
    "failed": "failed",
    "error": "errors",
}


def _event_reader(
    result: TestRunResult, counts: dict[str, int], on_progress: ProgressFn | None
) -> Callable[[str], None]:
    """A line handler that reads our pytest plugin's events into ``result`` (other output is ignored)."""

    def on_line(line: str) -> None:
        at = line.find(MARK)
        if at == -1:
            return
        try:
            event = json.loads(line[at + len(MARK) :])
        except json.JSONDecodeError:
            return
        if event.get("event") == "deselected":
            result.deselected += int(event["count"])
            return
        if event.get("event") == "collected":
            result.selected = int(event["count"])
            if on_progress:
                on_progress(0, result.selected, f"collected {result.selected} tests")
            return
        outcome = TestOutcome(
            nodeid=event["nodeid"],
            outcome=event["outcome"],
            duration_s=event.get("duration_s", 0.0),
            message=event.get("message"),
        )
        result.tests.append(outcome)
        counts[_BUCKET.get(outcome.outcome, "errors")] += 1
        if on_progress:
            on_progress(len(result.tests), result.selected, f"{outcome.outcome}: {outcome.nodeid}")

    return on_line


def _explain_exit(
    result: TestRunResult, code: int | None, timed_out: bool, timeout_s: float, expr: str | None, files: list[str]
) -> None:
    """Say in ``notes`` why a run that did not simply pass or fail ended as it did."""
    if timed_out:
        result.notes.append(f"stopped after the {timeout_s:g} s timeout; {len(result.tests)} tests had finished")
    elif code == 5 or (code == 0 and not result.tests):
        result.nothing_selected = True
        result.notes.append(
            f"no tests ran: the selection {expr!r} matched nothing in {', '.join(files)} "
            "(pytest exit code 5); this is not a pass"
        )
    elif code not in (0, 1):
        result.notes.append(
            f"pytest exited with code {code} (2 = interrupted/collection error, 3 = internal "
            "error, 4 = usage error); see output_tail"
        )


def _pytest_run(
    suite: str,
    cwd: Path,
    files: list[str],
    expr: str | None,
    python: str,
    timeout_s: float,
    on_progress: ProgressFn | None,
    extra_pythonpath: list[str],
) -> TestRunResult:
    with tempfile.TemporaryDirectory(prefix="mbo-tests-") as tmp:
        (Path(tmp) / "mbridge_offload_progress.py").write_text(_PLUGIN % MARK, encoding="utf-8")
        command = [
            python,
            "-m",
            "pytest",
            *files,
            "-p",
            "mbridge_offload_progress",
            "-p",
            "no:cacheprovider",
            "-q",
            "--color=no",
        ]
        if expr:
            command += ["-k", expr]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([tmp, *extra_pythonpath, *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONUNBUFFERED"] = "1"
        env[DEPTH_ENV] = str(int(os.environ.get(DEPTH_ENV, "0") or 0) + 1)
        result = TestRunResult(suite=suite, command=command)
        counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
        on_line = _event_reader(result, counts, on_progress)
        start = time.monotonic()
        code, timed_out, tail = _stream(command, cwd, env, timeout_s, on_line)
        result.duration_s = time.monotonic() - start
    result.exit_code, result.timed_out, result.output_tail = code, timed_out, "\n".join(tail[-20:])
    result.passed, result.failed, result.skipped, result.errors = (
        counts["passed"],
        counts["failed"],
        counts["skipped"],
        counts["errors"],
    )
    _explain_exit(result, code, timed_out, timeout_s, expr, files)
    return result


def check_test_path(path: str) -> str:
    """A test file or folder of this project, relative to its root (``tests/actions/test_apply.py``, ``tests``).

    Raises:
        TestSuiteError: a path outside ``tests/`` or one that does not exist.
    """
    tests_dir = (PROJECT_ROOT / "tests").resolve()
    node, sep, rest = path.partition("::")
    target = (PROJECT_ROOT / node).resolve()
    if not (target == tests_dir or target.is_relative_to(tests_dir)):
        raise TestSuiteError(
            f"path {path!r} is outside this project's tests/ folder; pass e.g. tests/actions/test_apply.py"
        )
    if not target.exists():
        raise TestSuiteError(f"path {path!r} does not exist; test files are tests/test_*.py")
    if sep and not re.match(r"^[\w\[\]\-.:]+$", rest):
        raise TestSuiteError(f"path {path!r}: the node id part {rest!r} may hold only names, '::', '[]', '-' and '.'")
    return str(target.relative_to(PROJECT_ROOT)) + (sep + rest if sep else "")


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
    """Run a test suite and report every result.

    Args:
        k: a pytest ``-k`` expression (validated); None = all tests of the suite. With ``bridge_repo`` it
            replaces the default offload selector.
        bridge_repo: a Megatron Bridge checkout; runs its offload-related tests with its ``.venv`` python when
            there is one.
        suite: ``unit`` (pytest) or ``parity`` (tiny-model training with vs without offload,
        mbridge_offload.actions.parity).
        timeout_s: wall-clock limit; the whole process group is killed at the deadline.
        on_progress: ``fn(done, total_or_None, message)`` after each finished test.
        config: for ``parity``: the config whose offload settings are trained (path or text).
        steps: for ``parity``: training steps per run.
        path: for ``unit``: one test file, folder or node id under ``tests/`` instead of the whole folder.
        repo_python: with ``bridge_repo``, run the checkout's own ``.venv`` Python when it has one (the CLI);
            False runs this interpreter (an MCP server not started with ``--allow-bridge-venv``).

    Raises:
        TestSuiteError: bad input (unsafe expression, missing repo, unknown suite, nested run).
    """
    depth = int(os.environ.get(DEPTH_ENV, "0") or 0)
    if depth >= 1:
        raise TestSuiteError(
            "refusing to start a test run from inside a test run (run_unit_tests was called by a "
            "test that run_unit_tests started); select fewer tests"
        )
    if suite not in ("unit", "parity"):
        raise TestSuiteError(f"suite {suite!r} is not one of unit, parity")
    if timeout_s <= 0:
        raise TestSuiteError(f"timeout_s is {timeout_s}; pass a positive number of seconds")
    expr = check_expression(k) if k is not None else None
    if suite == "parity":
        if bridge_repo is not None or expr is not None or path is not None:
            raise TestSuiteError("suite=parity takes a config (and steps), not k, path or bridge_repo")
        return _parity_run(config, steps, timeout_s, on_progress)
    if bridge_repo is not None:
        if path is not None:
            raise TestSuiteError("path selects one of this project's test files; with bridge_repo use k instead")
        root = Path(bridge_repo).expanduser().resolve()
        files = bridge_files(root)
        python = _python_for(root) if repo_python else sys.executable  # never the checkout's .venv unless allowed
        require_modules(python, BRIDGE_NEEDS, "Megatron Bridge")
        return _pytest_run(
            "bridge",
            root,
            files,
            expr or BRIDGE_SELECTOR,
            python,
            timeout_s,
            on_progress,
            [],
        )
    return _unit_run(expr, path, timeout_s, on_progress)


def _unit_run(expr: str | None, path: str | None, timeout_s: float, on_progress: ProgressFn | None) -> TestRunResult:
    """This project's suite; ``cpu_offload`` (the upstream skill's selector) means all of it."""
    tests_dir = PROJECT_ROOT / "tests"
    if not tests_dir.is_dir():
        raise TestSuiteError(f"this installation has no tests folder ({tests_dir}); run from a source checkout")
    files = [check_test_path(path)] if path else ["tests"]
    require_modules(sys.executable, UNIT_NEEDS, "unit")
    alias = expr if expr in WHOLE_SUITE_ALIASES else None
    result = _pytest_run(
        "unit",
        PROJECT_ROOT,
        files,
        None if alias else expr,
        sys.executable,
        timeout_s,
        on_progress,
        [str(PROJECT_ROOT)],
    )
    if alias:
        result.notes.insert(
            0,
            f"-k {alias!r} (the upstream skill's selector) runs the whole offload suite here: "
            f"{result.selected if result.selected is not None else '?'} tests; only a few are named {alias}",
        )
    elif expr and (note := _few_selected_note(result, expr)):
        result.notes.insert(0, note)
    return result


def _parity_run(
    config: str | None, steps: int | None, timeout_s: float, on_progress: ProgressFn | None
) -> TestRunResult:
    command = [sys.executable, "-m", "mbridge_offload.actions.parity", "--json", "--progress"]
    if config is not None:
        command += ["--config", config]
    if steps is not None:
        command += ["--steps", str(int(steps))]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    result = TestRunResult(suite="parity", command=command)
    final: dict[str, Any] = {}
    payload: list[str] = []

    def on_line(line: str) -> None:
        if line.startswith(MARK):
            try:
                event = json.loads(line[len(MARK) :])
            except json.JSONDecodeError:
                return
            if on_progress and event.get("event") == "progress":
                on_progress(int(event["done"]), int(event["total"]), str(event.get("message", "")))
        else:
            payload.append(line)

    start = time.monotonic()
    code, timed_out, tail = _stream(command, PROJECT_ROOT, env, timeout_s, on_line)
    result.duration_s = time.monotonic() - start
    result.exit_code, result.timed_out, result.output_tail = code, timed_out, "\n".join(tail[-20:])
    text = "\n".join(payload)
    start_json = text.find("{")
    if start_json != -1:
        try:
            final = json.loads(text[start_json:])
        except json.JSONDecodeError:
            final = {}
    if not final:
        result.notes.append(
            "the parity run produced no result" + (" (timeout)" if timed_out else "") + "; see output_tail"
        )
        result.errors = 1
        return result
    result.details = final
    for check in final.get("checks", []):
        outcome = "passed" if check["ok"] else "failed"
        result.tests.append(
            TestOutcome(
                nodeid=f"parity::{check['name']}",
                outcome=outcome,
                message=None if check["ok"] else check.get("detail"),
            )
        )
    result.passed = sum(t.outcome == "passed" for t in result.tests)
    result.failed = sum(t.outcome == "failed" for t in result.tests)
    result.selected = len(result.tests)
    if final.get("error"):
        result.errors = 1
        result.notes.append(str(final["error"]))
    return result
