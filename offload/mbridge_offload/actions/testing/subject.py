"""What a test run tested: the code under test, named in every ``test`` / ``run_unit_tests`` answer.

A passing run says little unless it says whose code passed. Versions and commits are read from files, never by
running a checkout's code. The parity check trains this project's HybridDeviceOptimizer, not megatron-core's:
:data:`CLUSTER_RECIPE` says how to check that one on a GPU cluster.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

import mbridge_offload


class CodeUnderTest(BaseModel):
    """The code a test run exercised (``under_test`` of a test run's answer)."""

    summary: str = Field(description="one sentence: whose code, which tests")
    kind: str = Field(description="mbridge-offload (this project), megatron-bridge (a checkout) or parity")
    package: str | None = Field(default=None, description="the import name of the code under test")
    path: str | None = Field(default=None, description="the folder its code was imported from")
    version: str | None = None
    commit: str | None = Field(default=None, description="the checkout's git commit, read from .git (None: none)")
    tests: str = Field(default="", description="which tests ran")
    optimizer: dict[str, str] | None = Field(
        default=None, description="parity: the optimizer class trained (class, module, origin)"
    )
    model: str | None = Field(default=None, description="parity: the model trained and where")
    megatron_core: str | None = Field(default=None, description="parity: megatron-core's version, when its GPT ran")
    not_tested: str | None = Field(default=None, description="what this run could not check, and why")
    cluster_recipe: dict[str, Any] | None = Field(
        default=None, description="parity: how to check megatron-core's own optimizer on a GPU cluster"
    )


# ---------------------------------------------------------------------------------------------- reading a checkout


def git_commit(root: Path) -> str | None:
    """The commit ``root``'s checkout has checked out, read from ``.git`` (a worktree's ``gitdir:`` file, loose
    refs, ``packed-refs``), or None. Runs no git: a checkout's config can name programs to run."""
    dot = root / ".git"
    try:
        gitdir = dot
        if dot.is_file():  # a worktree or submodule: "gitdir: <path>"
            gitdir = (root / dot.read_text(encoding="utf-8").split(":", 1)[1].strip()).resolve()
        head = (gitdir / "HEAD").read_text(encoding="utf-8").strip()
        if not head.startswith("ref:"):
            return head if re.fullmatch(r"[0-9a-f]{40,64}", head) else None
        ref = head.split(":", 1)[1].strip()
        common = gitdir
        if (gitdir / "commondir").is_file():  # a worktree's refs live in the main repository
            common = (gitdir / (gitdir / "commondir").read_text(encoding="utf-8").strip()).resolve()
        for base in (gitdir, common):
            if (base / ref).is_file():
                return (base / ref).read_text(encoding="utf-8").strip()
        packed = (common / "packed-refs").read_text(encoding="utf-8") if (common / "packed-refs").is_file() else ""
        match = re.search(rf"^([0-9a-f]{{40,64}}) {re.escape(ref)}$", packed, re.M)
        return match.group(1) if match else None
    except (OSError, IndexError, UnicodeDecodeError):
        return None


def bridge_version(root: Path) -> str | None:
    """A Megatron Bridge checkout's version, from ``src/megatron/bridge/package_info.py`` (read, not imported)."""
    try:
        text = (root / "src" / "megatron" / "bridge" / "package_info.py").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    parts = {k: re.search(rf"^{k}\s*=\s*['\"]?([\w.]*)['\"]?\s*$", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")}
    if not all(parts.values()):
        return None
    pre = re.search(r"^PRE_RELEASE\s*=\s*['\"]([\w.]*)['\"]", text, re.M)
    return ".".join(m.group(1) for m in parts.values() if m) + (pre.group(1) if pre else "")


# ---------------------------------------------------------------------------------------------- the three kinds


# The parts of this project a test file covers, by where it sits under tests/ (the suite mirrors the packages) and,
# in the runtime, by which mechanism its name says: first match wins.
PARTS: tuple[tuple[str, str], ...] = (
    ("tests/runtime/test_optimizer", "the HybridDeviceOptimizer"),
    ("tests/runtime/test_megatron_activation", "activation offload"),
    ("tests/runtime/test_activation", "activation offload"),
    ("tests/runtime/", "the runtime's devices and stream ordering"),
    ("tests/config/", "the config reading and rules"),
    ("tests/plan/", "the planner"),
    ("tests/actions/", "apply, diagnose and the test tool"),
    ("tests/tools/", "the CLI, the MCP server and the generated docs"),
    ("tests/", "the house rules and upstream tables"),
)
# The outcomes of a test that ran (a skipped test ran none of the code it names).
RAN = ("passed", "failed", "error", "xfailed", "xpassed")


def parts_tested(nodeids: list[str]) -> list[str]:
    """The parts of this project that the tests ``nodeids`` exercise, each once, in :data:`PARTS` order."""
    found = set()
    for nodeid in nodeids:
        path = nodeid.split("::", 1)[0].replace("\\", "/")
        found.add(next((part for prefix, part in PARTS if path.startswith(prefix)), None))
    return [part for part in dict.fromkeys(part for _p, part in PARTS) if part in found]


def ours(root: Path, tests: str, ran: list[str] | None = None) -> CodeUnderTest:
    """This project's code, as the unit suite imports it; ``ran``: the node ids that ran (None: not known, so the
    summary names no part).
    """
    package = Path(mbridge_offload.__file__).resolve().parent
    commit = git_commit(root)
    parts = parts_tested(ran or [])
    covered = f"the parts whose tests ran: {', '.join(parts)}" if parts else "no test of it ran"
    if ran is None:  # the caller did not say which ran: name no part rather than claim one
        covered = "which parts ran: see the tests"
    return CodeUnderTest(
        summary=f"Tested this project's code: mbridge-offload {mbridge_offload.__version__} ({covered}) from "
        f"{package}{f' at commit {commit[:12]}' if commit else ''}, with {tests}.",
        kind="mbridge-offload",
        package="mbridge_offload",
        path=str(package),
        version=mbridge_offload.__version__,
        commit=commit,
        tests=tests,
    )


def bridge(root: Path, tests: str) -> CodeUnderTest:
    """A Megatron Bridge checkout's own tests (its code, not this project's)."""
    version, commit = bridge_version(root), git_commit(root)
    named = " ".join(x for x in (version and f"version {version}", commit and f"commit {commit[:12]}") if x)
    return CodeUnderTest(
        summary=f"Tested Megatron Bridge's own code and tests in {root}{f' ({named})' if named else ''}, with "
        f"{tests}; this project's code did not run.",
        kind="megatron-bridge",
        package="megatron.bridge",
        path=str(root),
        version=version,
        commit=commit,
        tests=tests,
    )


# How to check megatron-core's own HybridDeviceOptimizer (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py,
# what Megatron Bridge builds for optimizer.optimizer_cpu_offload=true): it needs CUDA, so on a GPU cluster.
CLUSTER_RECIPE: dict[str, Any] = {
    "what": "megatron-core's own HybridDeviceOptimizer (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py), "
    "which megatron-core's get_megatron_optimizer builds when optimizer.optimizer_cpu_offload is true; it needs "
    "CUDA GPUs",
    "unit_tests": "in a Megatron-LM checkout at the megatron-core release you train with, on one GPU: python -m "
    "pytest tests/unit_tests/test_optimizer_cpu_offloading.py -q (the optimizer against a GPU optimizer at "
    "fractions 0, 0.5 and 1, with and without overlap: weights within atol 1e-3)",
    "runs": [
        "baseline: torchrun --nproc_per_node=8 scripts/training/run_recipe.py --recipe llama32_1b_pretrain_config "
        "train.train_iters=50 train.global_batch_size=32 train.micro_batch_size=1 rng.seed=1234 "
        "logger.log_interval=1 optimizer.optimizer_cpu_offload=false",
        "again: the same command a second time (the run-to-run spread of the baseline on these kernels)",
        "offload: the same command with optimizer.optimizer_cpu_offload=true optimizer.optimizer_offload_fraction=0.5 "
        "optimizer.overlap_cpu_optimizer_d2h_h2d=true",
    ],
    "where": "in a Megatron Bridge checkout (scripts/training/run_recipe.py), on one node of 8 GPUs; any recipe "
    "works, a small one is quick",
    "compare": [
        "lm loss per iteration: offload against baseline, max |delta| < 1e-3 (the upstream skill's bar) or no more "
        "than the two baselines differ from each other",
        "max allocated (MB) of the memory report: lower than the baseline by about what `mbridge-offload estimate "
        "--model-config <the run's config> --optimizer-offload-fraction 0.5` predicts",
        "elapsed time per iteration (ms): offload over baseline is the measured step-time factor (`estimate` "
        "predicts it as step_time_factor)",
    ],
}


def parity(details: dict[str, Any] | None) -> CodeUnderTest:
    """The parity check: which optimizer trained which model where, and the recipe for megatron-core's own."""
    details = details or {}
    found = details.get("optimizer") or {}
    name, module = found.get("class", "HybridDeviceOptimizer"), found.get("module", "?")
    model, device = details.get("model", "a tiny GPT"), details.get("device", "cpu")
    core = details.get("megatron_core")
    owner = (
        f"this project (mbridge-offload {mbridge_offload.__version__})"
        if module.startswith(("mbridge_offload.", "mbridge_offload_runtime."))
        else module.split(".")[0]
    )
    return CodeUnderTest(
        summary=f"Tested {name} from {owner} ({module}) against plain AdamW on {model} on {device}"
        f"{f' (megatron-core {core})' if core else ''}; megatron-core's own HybridDeviceOptimizer did not run (it "
        "needs CUDA): cluster_recipe says how to check it on a GPU cluster.",
        kind="parity",
        package="mbridge_offload",
        path=str(Path(mbridge_offload.__file__).resolve().parent),
        version=mbridge_offload.__version__,
        tests="the parity check: loss with vs without offload on a learnable task",
        optimizer={"class": name, "module": module, "origin": owner},
        model=f"{model} on {device}",
        megatron_core=core,
        not_tested="megatron-core's own HybridDeviceOptimizer (megatron.core.optimizer.cpu_offloading."
        "hybrid_optimizer): it runs only on CUDA",
        cluster_recipe=CLUSTER_RECIPE,
    )
