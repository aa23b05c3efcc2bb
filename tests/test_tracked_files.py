"""No test or benchmark writes into tracked files: the session-end check (tests/conftest.py) and what it compares."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import differential_lines
from tests.support import tracked


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.md").write_text("a\n")
    (tmp_path / "b.md").write_text("b\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return tmp_path


def test_a_rewritten_tracked_file_is_named(repo: Path) -> None:
    before = tracked.snapshot(repo)
    (repo / "b.md").write_text("rewritten by a benchmark\n")
    (repo / "new.txt").write_text("untracked files are not this check's business\n")
    assert tracked.changed_since(repo, before) == ["b.md"]


def test_a_file_already_dirty_before_the_run_is_caught_when_the_run_changes_it_again(repo: Path) -> None:
    (repo / "a.md").write_text("a developer's edit\n")
    before = tracked.snapshot(repo)
    assert tracked.changed_since(repo, before) == []  # the edit itself is not the run's doing
    (repo / "a.md").write_text("a test's rewrite\n")
    assert tracked.changed_since(repo, before) == ["a.md"]


def test_outside_a_git_checkout_there_is_nothing_to_compare(tmp_path: Path) -> None:
    assert tracked.snapshot(tmp_path) is None and tracked.changed_since(tmp_path, None) == []


def test_the_differential_summary_names_each_tolerated_disagreement_and_why() -> None:
    row = {"case": 17, "field": "verdict", "ours": "refuses (TE-X)", "upstream": "accepts", "why": "a te refusal"}
    lines = differential_lines([("megatron-core 0.19.2", 650, 300, [row]), ("megatron-core 0.16.1", 650, 290, [])])
    assert lines == [
        "megatron-core 0.19.2: 650 cases, 300 message comparisons (all agree), 1 tolerated disagreements:",
        "  case 17 verdict: ours refuses (TE-X); upstream accepts",
        "    tolerated: a te refusal",
        "megatron-core 0.16.1: 650 cases, 290 message comparisons (all agree), 0 tolerated disagreements",
    ]
