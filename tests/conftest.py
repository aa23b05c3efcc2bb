"""Shared fixtures, and the differential-test summary printed at the end of every run (also under ``-q``)."""

from __future__ import annotations

import os

import pytest

from tests.support import tree

# Subprocesses the tests start (the CLI, the MCP server, workers) import this tree's code too, never an installed copy.
os.environ["PYTHONPATH"] = tree.pythonpath(inherit=True)

_DIFFERENTIAL = pytest.StashKey[list]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_DIFFERENTIAL] = []


@pytest.fixture(scope="session")
def differential_log(pytestconfig: pytest.Config) -> list:
    """Append ``(label, cases, comparisons, disagreements)`` to have it shown in the terminal summary."""
    return pytestconfig.stash[_DIFFERENTIAL]


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    rows = config.stash.get(_DIFFERENTIAL, [])
    if not rows:
        return
    terminalreporter.section("differential test vs real megatron-core")
    for label, cases, comparisons, disagreements in rows:
        terminalreporter.write_line(
            f"{label}: {cases} cases, {comparisons} stage comparisons, {disagreements} disagreements"
        )
