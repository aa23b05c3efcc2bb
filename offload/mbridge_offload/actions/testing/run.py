"""Start pytest (or the parity check) in a subprocess and read each result from a tiny plugin's event lines.

Arguments are a list, never a shell string; the whole process group is killed at the deadline. Results come from
the plugin written next to the run (``@@mbridge-offload@@ {json}`` lines on stdout), so node ids, outcomes,
durations and the short failure text are pytest's own, not scraped from the terminal.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mbridge_offload.actions.testing.result import TestOutcome, TestRunResult

ProgressFn = Callable[[int, int | None, str], None]

MARK = "@@mbridge-offload@@ "
# Set in every run's environment (one more than the caller's): a test that would start a run from inside a run
# is refused, after its inputs are checked (testsuite.run_tests).
DEPTH_ENV = "MBRIDGE_OFFLOAD_TEST_DEPTH"
PROJECT_ROOT = Path(__file__).resolve().parents[4]

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


def _event_reader(result: TestRunResult, on_progress: ProgressFn | None) -> Callable[[str], None]:
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
        if on_progress:
            on_progress(len(result.tests), result.selected, f"{outcome.outcome}: {outcome.nodeid}")

    return on_line


def _count(result: TestRunResult) -> None:
    for bucket in ("passed", "failed", "skipped", "errors"):
        setattr(result, bucket, sum(_BUCKET.get(t.outcome, "errors") == bucket for t in result.tests))


def _env(pythonpath: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env


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
    elif code == 1 and result.failed == 0 and result.errors == 0:
        result.notes.append(
            "pytest exited with code 1 although no test failed: a session-end check failed (e.g. the test run "
            "changed tracked files, named in output_tail)"
        )
    elif code not in (0, 1):
        result.notes.append(
            f"pytest exited with code {code} (2 = interrupted/collection error, 3 = internal "
            "error, 4 = usage error); see output_tail"
        )


def pytest_run(
    suite: str,
    cwd: Path,
    files: list[str],
    expr: str | None,
    python: str,
    timeout_s: float,
    on_progress: ProgressFn | None,
    extra_pythonpath: list[str],
    marker: str | None = None,
) -> TestRunResult:
    """Run pytest on ``files`` (``-k expr``, ``-m marker``) in ``cwd`` and read every result into a TestRunResult."""
    with tempfile.TemporaryDirectory(prefix="mbo-tests-") as tmp:
        (Path(tmp) / "mbridge_offload_progress.py").write_text(_PLUGIN % MARK, encoding="utf-8")
        plugins = ["-p", "mbridge_offload_progress", "-p", "no:cacheprovider"]
        command = [python, "-m", "pytest", *files, *plugins, "-q", "--color=no"]
        if marker:
            command += ["-m", marker]
        if expr:
            command += ["-k", expr]
        env = _env([tmp, *extra_pythonpath])
        env[DEPTH_ENV] = str(int(os.environ.get(DEPTH_ENV, "0") or 0) + 1)
        # One torch thread unless the caller chose: the tests' tensors are tiny, and on a busy machine OpenMP's
        # spinning worker threads made the offload suite 3-4x slower (82 s vs 24 s for test_optimizer.py, load 15).
        env.setdefault("OMP_NUM_THREADS", "1")
        result = TestRunResult(suite=suite, command=command)
        start = time.monotonic()
        code, timed_out, tail = _stream(command, cwd, env, timeout_s, _event_reader(result, on_progress))
        result.duration_s = time.monotonic() - start
    result.exit_code, result.timed_out, result.output_tail = code, timed_out, "\n".join(tail[-20:])
    _count(result)
    _explain_exit(result, code, timed_out, timeout_s, expr or (f"-m {marker}" if marker else None), files)
    return result


def parity_run(
    config: str | None, steps: int | None, timeout_s: float, on_progress: ProgressFn | None
) -> TestRunResult:
    """Run ``mbridge_offload.actions.testing.parity`` in a subprocess; each of its checks becomes one test outcome."""
    with tempfile.TemporaryDirectory(prefix="mbridge-offload-parity-") as scratch:
        command = [sys.executable, "-m", "mbridge_offload.actions.testing.parity", "--json", "--progress"]
        if config is not None:
            command += ["--config", _config_here(config, Path(scratch))]
        if steps is not None:
            command += ["--steps", str(int(steps))]
        return _parity_subprocess(command, timeout_s, on_progress)


def _config_here(config: str, scratch: Path) -> str:
    """A config file is read here, through the bounded reader and the server's roots (the child runs in the
    project root, with no roots), and handed to the child as a copy in ``scratch`` (ConfigError: unreadable)."""
    from mbridge_offload.config.sources import read_source

    text, where = read_source(config)
    if where == "<text>":
        return config
    copy = scratch / f"config{Path(where).suffix or '.yaml'}"
    copy.write_text(text, encoding="utf-8")
    return str(copy)


def _parity_subprocess(command: list[str], timeout_s: float, on_progress: ProgressFn | None) -> TestRunResult:
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
    code, timed_out, tail = _stream(command, PROJECT_ROOT, _env([str(PROJECT_ROOT)]), timeout_s, on_line)
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
        message = None if check["ok"] else check.get("detail")
        outcome = "passed" if check["ok"] else "failed"
        result.tests.append(TestOutcome(nodeid=f"parity::{check['name']}", outcome=outcome, message=message))
    _count(result)
    result.selected = len(result.tests)
    if final.get("error"):
        result.errors = 1
        result.notes.append(str(final["error"]))
    return result
