"""Shared fixtures, and the differential-test summary printed at the end of every run (also under ``-q``)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.support import tracked, tree

# Subprocesses the tests start (the CLI, the MCP server, workers) import this tree's code too, never an installed copy.
os.environ["PYTHONPATH"] = tree.pythonpath(inherit=True)


def _isolate_home() -> Path:
    """Point HOME and the XDG folders at an empty directory for this process and every subprocess it starts.

    No answer may depend on a file in the user's home (a stale calibration there once changed every step-time
    factor); a test that needs such a file writes it into this home. Package caches keep their real place: they
    change what is installed, never an answer, and a fresh one per run would download again.
    """
    real = Path(os.environ.get("HOME") or Path.home())
    os.environ.setdefault("PIP_CACHE_DIR", str(real / ".cache" / "pip"))
    os.environ.setdefault("UV_CACHE_DIR", str(real / ".cache" / "uv"))
    home = Path(tempfile.mkdtemp(prefix="mbridge-offload-test-home-"))
    os.environ["HOME"] = str(home)
    for var, sub in (
        ("XDG_CONFIG_HOME", ".config"),
        ("XDG_CACHE_HOME", ".cache"),
        ("XDG_DATA_HOME", ".local/share"),
        ("XDG_STATE_HOME", ".local/state"),
    ):
        os.environ[var] = str(home / sub)
    for var in ("MBRIDGE_OFFLOAD_CALIBRATION", "MBRIDGE_OFFLOAD_ROOTS", "CLAUDE_PROJECT_DIR"):
        os.environ.pop(var, None)  # set by a user's shell or host, never by the suite
    return home


TEST_HOME = _isolate_home()


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(TEST_HOME, ignore_errors=True)


_DIFFERENTIAL = pytest.StashKey[list]()
_TRACKED = pytest.StashKey[dict]()
_CHANGED = pytest.StashKey[list]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_DIFFERENTIAL] = []
    if not hasattr(config, "workerinput"):  # the controller only, under xdist
        config.stash[_TRACKED] = tracked.snapshot(tree.ROOT)


@pytest.hookimpl(tryfirst=True)  # before -k, -m and --deselect drop any: the counts are of the whole collection
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The collected tests and their markers, for the test counts the docs quote (docgen.docs.benchmarks.collected):
    written to the file ``MBRIDGE_OFFLOAD_COLLECTED_OUT`` names, and handed to the doc generators when this session
    collected the whole suite (so checking the counts costs nothing then)."""
    from mbridge_offload_tools.docgen.docs import benchmarks

    marks = {item.nodeid: sorted({m.name for m in item.iter_markers()}) for item in items}
    out = os.environ.get(benchmarks.COUNT_ENV)
    if out:
        Path(out).write_text(json.dumps(marks))
    whole = [Path(a).resolve() for a in config.args] in ([tree.ROOT / "tests"], [tree.ROOT])
    if whole and not config.getoption("lf", False) and not config.getoption("ff", False):
        benchmarks.COLLECTED = marks


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run, naming the files, when it changed a tracked file (no test or benchmark may write into one)."""
    before = session.config.stash.get(_TRACKED, None)
    if before is None:
        return
    changed = tracked.changed_since(tree.ROOT, before)
    session.config.stash[_CHANGED] = changed
    if changed and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def differential_log(pytestconfig: pytest.Config) -> list:
    """Append ``(label, cases, message_comparisons, tolerated)`` to have it shown in the terminal summary;
    ``tolerated`` lists each tolerated disagreement as ``{"case", "field", "ours", "upstream", "why"}``."""
    return pytestconfig.stash[_DIFFERENTIAL]


def differential_lines(rows: list) -> list[str]:
    """The summary's lines: per version the counts, then every tolerated disagreement with its reason."""
    lines = []
    for label, cases, comparisons, tolerated in rows:
        lines.append(
            f"{label}: {cases} cases, {comparisons} message comparisons (all agree), "
            f"{len(tolerated)} tolerated disagreements{':' if tolerated else ''}"
        )
        for t in tolerated:
            lines.append(f"  case {t['case']} {t['field']}: ours {t['ours']}; upstream {t['upstream']}")
            lines.append(f"    tolerated: {t['why']}")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    rows = config.stash.get(_DIFFERENTIAL, [])
    if rows:
        terminalreporter.section("differential test vs real megatron-core")
        for line in differential_lines(rows):
            terminalreporter.write_line(line)
    changed = config.stash.get(_CHANGED, None)
    if changed:
        terminalreporter.section("TRACKED FILES CHANGED BY THE TEST RUN", red=True, bold=True)
        terminalreporter.write_line(
            "these tracked files changed during the test run (a test or benchmark must write to tmp_path; or "
            "they were edited while it ran): " + ", ".join(changed)
        )
