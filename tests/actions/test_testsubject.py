"""mbridge_offload.actions.testing.subject: a test run names the code it tested (checkout, version, commit,
optimizer)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import mbridge_offload
from mbridge_offload.actions.testing import subject as testsubject
from mbridge_offload.actions.testing.run import PROJECT_ROOT


def _git(cwd: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    done = subprocess.run(
        ["git", "-c", "init.defaultBranch=main", *args], cwd=cwd, env={**env, "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    root.mkdir()
    _git(root, "init", "-q")
    (root / "a.txt").write_text("a\n")
    _git(root, "add", "a.txt")
    _git(root, "commit", "-q", "-m", "one")
    return root


def test_the_commit_is_read_from_loose_and_packed_refs_and_a_detached_head(repo: Path) -> None:
    head = _git(repo, "rev-parse", "HEAD")
    assert testsubject.git_commit(repo) == head
    _git(repo, "pack-refs", "--all")  # the branch now lives in packed-refs only
    assert not (repo / ".git/refs/heads/main").exists() and testsubject.git_commit(repo) == head
    _git(repo, "checkout", "-q", "--detach")
    assert testsubject.git_commit(repo) == head


def test_the_commit_of_a_worktree_is_its_own(repo: Path, tmp_path: Path) -> None:
    (repo / "b.txt").write_text("b\n")
    _git(repo, "add", "b.txt")
    _git(repo, "commit", "-q", "-m", "two")
    _git(repo, "worktree", "add", "-q", "-b", "side", str(tmp_path / "wt"), "HEAD~1")
    assert (tmp_path / "wt/.git").is_file()  # "gitdir: ..." pointing into the main repository
    assert testsubject.git_commit(tmp_path / "wt") == _git(tmp_path / "wt", "rev-parse", "HEAD")
    assert testsubject.git_commit(tmp_path / "wt") != testsubject.git_commit(repo)


def test_no_checkout_has_no_commit(tmp_path: Path) -> None:
    assert testsubject.git_commit(tmp_path) is None
    (tmp_path / ".git").write_text("not a gitdir line")
    assert testsubject.git_commit(tmp_path) is None


def test_a_bridge_version_is_read_from_its_package_info_without_importing_it(tmp_path: Path) -> None:
    info = tmp_path / "src/megatron/bridge/package_info.py"
    assert testsubject.bridge_version(tmp_path) is None
    info.parent.mkdir(parents=True)
    info.write_text('raise SystemExit("never imported")\nMAJOR = 0\nMINOR = 4\nPATCH = 0\nPRE_RELEASE = "rc1"\n')
    assert testsubject.bridge_version(tmp_path) == "0.4.0rc1"
    info.write_text("MAJOR = 0\n")
    assert testsubject.bridge_version(tmp_path) is None


def test_our_tests_name_this_projects_package_version_and_commit() -> None:
    under = testsubject.ours(PROJECT_ROOT, "the offload suite")
    assert under.path == str(Path(mbridge_offload.__file__).resolve().parent)
    assert under.version == mbridge_offload.__version__ and f"mbridge-offload {under.version}" in under.summary
    assert under.commit == testsubject.git_commit(PROJECT_ROOT)
    if under.commit:  # a source checkout: the commit agrees with git's own reading
        assert under.commit == _git(PROJECT_ROOT, "rev-parse", "HEAD") and under.commit[:12] in under.summary


def test_the_summary_names_only_the_parts_whose_tests_ran() -> None:
    runtime = ["tests/runtime/test_optimizer_checkpoint.py::test_resume", "tests/runtime/test_ordering.py::test_x"]
    summary = testsubject.ours(PROJECT_ROOT, "two files", runtime).summary
    assert "the parts whose tests ran: the HybridDeviceOptimizer, the runtime's devices and stream ordering" in summary
    assert "planner" not in summary and "rules" not in summary and "activation" not in summary


def test_the_planner_is_named_when_a_planner_test_ran() -> None:
    summary = testsubject.ours(PROJECT_ROOT, "a file", ["tests/plan/test_planner.py::test_y"]).summary
    assert "(the parts whose tests ran: the planner)" in summary


def test_a_run_where_no_test_ran_claims_no_part() -> None:
    summary = testsubject.ours(PROJECT_ROOT, "a file", []).summary
    assert "no test of it ran" in summary and "HybridDeviceOptimizer" not in summary


def test_a_bridge_checkouts_tests_name_its_version_and_commit(repo: Path) -> None:
    info = repo / "src/megatron/bridge/package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text('MAJOR = 0\nMINOR = 6\nPATCH = 2\nPRE_RELEASE = ""\n')
    under = testsubject.bridge(repo, "its tests/unit_tests/training/test_optim.py")
    assert (under.kind, under.version, under.commit) == ("megatron-bridge", "0.6.2", _git(repo, "rev-parse", "HEAD"))
    assert "version 0.6.2" in under.summary and under.commit[:12] in under.summary


def test_the_parity_answer_names_the_optimizer_and_the_cluster_recipe_for_megatron_cores_own() -> None:
    details = {
        "optimizer": {"class": "HybridDeviceOptimizer", "module": "mbridge_offload_runtime.optimizer.hybrid"},
        "model": "megatron-core GPTModel (tiny)",
        "device": "cpu",
        "megatron_core": "0.16.1",
    }
    under = testsubject.parity(details)
    assert under.optimizer == {
        "class": "HybridDeviceOptimizer",
        "module": "mbridge_offload_runtime.optimizer.hybrid",
        "origin": f"this project (mbridge-offload {mbridge_offload.__version__})",
    }
    assert "megatron-core GPTModel (tiny) on cpu (megatron-core 0.16.1)" in under.summary
    recipe = under.cluster_recipe
    assert recipe is not None and "megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py" in recipe["what"]
    assert "tests/unit_tests/test_optimizer_cpu_offloading.py" in recipe["unit_tests"]
    baseline, _again, offload = recipe["runs"]
    assert "optimizer.optimizer_cpu_offload=false" in baseline and "run_recipe.py --recipe" in baseline
    assert "optimizer.optimizer_cpu_offload=true optimizer.optimizer_offload_fraction=0.5" in offload
    assert [c.split(":")[0] for c in recipe["compare"]] == [
        "lm loss per iteration",
        "max allocated (MB) of the memory report",
        "elapsed time per iteration (ms)",
    ]
    # Another optimizer class (a mutant, megatron-core's) is named as what it is, never as ours.
    theirs = testsubject.parity({"optimizer": {"class": "HybridDeviceOptimizer", "module": "megatron.core.optimizer"}})
    assert theirs.optimizer is not None and theirs.optimizer["origin"] == "megatron"
