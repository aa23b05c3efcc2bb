"""validate's upstream run: the target's megatron-core itself, in a warm child process with a deadline.

The child (``child.py``: torch and megatron-core imported once) builds the config's ``TransformerConfig``,
``OptimizerConfig``, ``DistributedDataParallelConfig`` and the model's layout; every error it raises becomes a finding
with origin ``mcore``, verbatim, in place of the catalogue's findings of the stages it ran.

The release: the target's (``--target``), from this environment or ``.mcore/<version>`` (``scripts/setup``;
``MBRIDGE_OFFLOAD_MCORE_DIR`` names another folder), else the installed one, and the answer says which ran. The
sections are the ones the effective config holds (``config.effective``: Bridge's ``mixed_precision`` and
``finalize()``, what a frontend fills in); without Transformer Engine its checks are answered for the assumed release
or skipped, each named in ``MCORE-EXACT-SKIPPED``, never a false error.
"""

from __future__ import annotations

import atexit
import collections
import copy
import importlib.util
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mbridge_offload.config import bridge, effective
from mbridge_offload.config import validate as validate_mod
from mbridge_offload.config.rules.base import STAGE_OPTIMIZER_CONFIG, STAGE_TRANSFORMER_CONFIG, parse_target
from mbridge_offload.config.schema import OffloadConfig
from mbridge_offload.config.sources import ConfigError, build_config
from mbridge_offload.config.validate import Finding, Report

CHILD = Path(__file__).with_name("child.py")
ROOT = Path(__file__).resolve().parents[3]
DEFAULT_DEADLINE_S = 120.0
_STAGES = {"TransformerConfig": STAGE_TRANSFORMER_CONFIG, "OptimizerConfig": STAGE_OPTIMIZER_CONFIG}
BUILD_STAGE = "GPTModel build (meta device, fake process group)"  # child.py's name for it
_SETUP_HINT = {
    "0.19.2": "scripts/setup (full mode) installs megatron-core 0.19.2 into .mcore/0.19.2",
    "0.16.1": "pip install megatron-core==0.16.1 into this Python environment (scripts/setup's venv has it)",
    "main": "megatron-core main (Megatron-LM HEAD) is no release; no installed tree is it",
}


class ExactUnavailable(RuntimeError):
    """Exact mode cannot run here (megatron-core not installed, or the child failed or ran out of time)."""


@dataclass(frozen=True)
class Install:
    """One megatron-core release that exact mode can run: its version and the path entry that imports it."""

    version: str
    pythonpath: str | None  # the folder that holds its `megatron` package, put first on the child's path
    where: str


def mcore_dir() -> Path:
    """The folder of side-by-side megatron-core trees (``<dir>/<version>/megatron/core``)."""
    return Path(os.environ.get("MBRIDGE_OFFLOAD_MCORE_DIR") or ROOT / ".mcore")


def _package_version(core: Path) -> str | None:
    try:
        text = (core / "package_info.py").read_text()
    except OSError:
        return None
    parts = [re.search(rf"^{name}\s*=\s*(\d+)", text, re.M) for name in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(p.group(1) for p in parts if p) if all(parts) else None


def installs() -> list[Install]:
    """The megatron-core releases found here: this environment's first, then those under :func:`mcore_dir`."""
    found: list[Install] = []
    try:  # the top-level name only: finding megatron.core would import megatron (this process stays torch-free)
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        spec = None
    places = (spec.submodule_search_locations or []) if spec is not None else []
    cores = [Path(p) / "core" for p in places]
    cores = [c for c in cores if (c / "__init__.py").is_file()]
    if cores:
        core = cores[0]
        version = _package_version(core) or "unknown"
        # Its folder goes on the child's path: this process may have found it on a path added at run time (a
        # Bridge install given by MBRIDGE_OFFLOAD_BRIDGE_PATH), which a fresh interpreter would not search.
        found.append(Install(version, str(core.parent.parent), f"this Python environment ({core.parent.parent})"))
    base = mcore_dir()
    if base.is_dir():
        for tree in sorted(base.iterdir(), reverse=True):
            tree_version = _package_version(tree / "megatron" / "core")
            if tree_version is not None:
                found.append(Install(tree_version, str(tree), str(tree)))
    return found


def choose(target_label: str) -> Install:
    """The target's release when installed here, else the first one found (the answer then says so)."""
    found = installs()
    for install in found:
        if install.version == target_label:
            return install
    if not found:
        raise ExactUnavailable(
            f"--exact needs megatron-core installed (the target is {target_label}); none could run: this Python "
            f"environment has no megatron.core and {mcore_dir()} holds no release. "
            f"{_SETUP_HINT.get(target_label, f'pip install megatron-core=={target_label}')}; without it, validate "
            "without --exact uses the built-in rule catalogue"
        )
    return found[0]


def payload(raw: dict[str, Any], config: OffloadConfig | None, target: str, source: str | None) -> dict[str, Any]:
    """The sections the child builds, as the effective config (what the catalogue judges) holds them: Bridge's
    normalisations and what a frontend fills in before megatron-core's checks set; otherwise as written."""
    sections = ("model", "optimizer", "ddp")
    if config is None:
        try:
            config = build_config(copy.deepcopy(raw))
        except ConfigError:  # a value that does not type-check: megatron-core judges the sections as written
            mixed = bridge.mixed_precision(raw) if bridge.is_container(raw, source) else raw
            return {k: copy.deepcopy(mixed.get(k) or {}) for k in sections}
    eff = effective.resolve(config, raw, parse_target(target), source)
    data: dict[str, Any] = {k: copy.deepcopy(eff.raw.get(k) or {}) for k in sections}
    for dotted, _old, new in (*eff.normalized, *eff.filled):  # set whether or not the file wrote the key
        section, key = dotted.split(".", 1)
        data[section][key] = new
    return data


class Worker:
    """One warm megatron-core: ``child.py --serve``, asked one config a line (the MCP server starts one at launch)."""

    def __init__(self, install: Install) -> None:
        env = dict(os.environ)
        if install.pythonpath is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (install.pythonpath, env.get("PYTHONPATH")) if p)
        self.install = install
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: collections.deque[str] = collections.deque(maxlen=20)
        self.lock = threading.Lock()
        self.ready = False
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        self.errs = threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append), daemon=True)
        self.errs.start()

    @staticmethod
    def _pump(stream: Any, put: Any) -> None:
        for line in stream:
            put(line)
        put(None)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _line(self, deadline: float) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            self.close()
            raise ExactUnavailable(f"megatron-core {self.install.version} did not answer within the deadline") from None
        if line is None:
            self.errs.join(timeout=5)  # the child's last words
            last = ([s.strip() for s in self.stderr if s and s.strip()] or ["no output"])[-1]
            # megatron-core 0.19 imports triton when it loads (GPU kernels no check calls); scripts/setup pins it.
            hint = "; run scripts/setup, which installs the triton it imports" if "'triton'" in last else ""
            raise ExactUnavailable(
                f"building the megatron-core {self.install.version} configs failed ({last}); none could run{hint}"
            )
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, body: dict[str, Any], deadline_s: float) -> dict[str, Any]:
        """The child's answer for ``body`` (ExactUnavailable when it died or passed ``deadline_s``: then stopped)."""
        deadline = time.monotonic() + deadline_s
        with self.lock:
            if not self.ready:
                self._line(deadline)  # {"ready": true}: megatron-core is imported
                self.ready = True
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps(body, default=str) + "\n")
                self.proc.stdin.flush()
            except OSError:
                pass  # the child is gone: _line reports why
            return self._line(deadline)

    def close(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()


_WORKERS: dict[Install, Worker] = {}
_WORKERS_LOCK = threading.Lock()


def worker(install: Install) -> Worker:
    """The warm worker of ``install``, started when none is alive."""
    with _WORKERS_LOCK:
        current = _WORKERS.get(install)
        if current is None or not current.alive():
            current = _WORKERS[install] = Worker(install)
        return current


def start(target: str = "megatron-core==0.19.2") -> Install | None:
    """Start the target's warm worker now (the MCP server at launch), without waiting for it; None when no
    megatron-core is installed here."""
    try:
        install = choose(parse_target(target).label)
        worker(install)
    except (ExactUnavailable, OSError):  # validate then says why in coverage; the server starts regardless
        return None
    return install


@atexit.register
def _stop_workers() -> None:
    for w in list(_WORKERS.values()):
        w.close()


def _ask(target: str, body: dict[str, Any], deadline_s: float) -> tuple[Install, dict[str, Any]]:
    install = choose(parse_target(target).label)
    try:
        return install, worker(install).ask(body, deadline_s)
    except ExactUnavailable as exc:
        raise ExactUnavailable(f"--exact: {exc}") from None


def run_child(
    raw: dict[str, Any],
    deadline_s: float = DEFAULT_DEADLINE_S,
    *,
    config: OffloadConfig | None = None,
    target: str = "megatron-core==0.19.2",
    source: str | None = None,
    te_version: str | None = None,
) -> dict[str, Any]:
    """The child's answer for the config sections of ``raw``, from the target's megatron-core where installed
    (ExactUnavailable: none is, or the child failed or passed the deadline)."""
    install, answer = _ask(target, {**payload(raw, config, target, source), "te_version": te_version}, deadline_s)
    answer["where"] = install.where
    return answer


def run_children(bodies: list[dict[str, Any]], target: str, deadline_s: float = 600) -> list[dict[str, Any]]:
    """The child's answer for each of ``bodies`` (:func:`payload`'s sections) from one megatron-core import (the
    generated-case tests)."""
    install, answer = _ask(target, {"batch": bodies}, deadline_s)
    answers: list[dict[str, Any]] = answer["batch"]
    for answer in answers:
        answer["where"] = install.where
    return answers


def exact_report(
    report: Report,
    raw: dict[str, Any],
    deadline_s: float = DEFAULT_DEADLINE_S,
    config: OffloadConfig | None = None,
    notes: bool = True,
) -> Report:
    """``report`` with its megatron-core findings replaced by what the target's megatron-core raises (:func:`merge`)."""
    answer = run_child(
        raw,
        deadline_s,
        config=config,
        target=report.target,
        source=report.source,
        te_version=report.env.get("te_version"),
    )
    return merge(report, answer, notes)


def merge(report: Report, answer: dict[str, Any], notes: bool = True) -> Report:
    """``report`` (the catalogue's) with megatron-core's errors verbatim in place of its findings of the stages the
    child ran, and ``coverage``; ``notes``: also the release that ran and what it skipped as info findings (what
    ``exact`` answers; by default ``coverage`` says the same)."""
    target = parse_target(report.target)
    version = answer["version"]
    ran = f"megatron-core {version} ({answer['where']})"
    kept = _kept(report.findings, answer)

    def mcore(rule: str, severity: Any, message: str, why: str, **more: Any) -> Finding:
        return Finding(
            rule=rule, severity=severity, origin="mcore", keys=[], message=message, fix=None, why=why, **more
        )

    exact = [
        mcore(
            "MCORE-BUILD" if e["stage"] == BUILD_STAGE else "MCORE-EXACT",
            "error",
            e["message"] or f"{e['type']} (no message)",
            f"raised by {ran}, building {e['stage']}" + (f" ({e['where']})" if e.get("where") else ""),
            stage=_STAGES.get(e["stage"], e["stage"]),
            upstream_message=e["message"],
            exception=e["type"],
        )
        for e in answer["errors"]
    ]
    infos = [mcore("MCORE-EXACT-SKIPPED", "info", text, f"the upstream run with {ran}") for text in answer["skipped"]]
    if version == target.label:
        message = f"the upstream run ran megatron-core {version}, the target, from {answer['where']}"
        why = "megatron-core's own checks of the target release"
    else:
        hint = _SETUP_HINT.get(target.label, f"install megatron-core=={target.label}")
        message = (
            f"the upstream run ran megatron-core {version} from {answer['where']}, not the target {target}: "
            f"{target.label} is not installed here ({hint})"
        )
        why = "the upstream run can only ask a release that is installed; the other findings follow the target"
    infos.append(mcore("MCORE-EXACT-VERSION", "info", message, why))
    env = {**report.env, "exact_megatron_core": version, "exact_megatron_core_from": answer["where"]}
    env["exact_transformer_engine"] = answer.get("te") or "not installed (TE checks skipped, see MCORE-EXACT-SKIPPED)"
    coverage = {**_coverage(answer, ran), "upstream": message}
    findings = exact + kept + (infos if notes else [])
    return report.model_copy(update={"findings": findings, "env": env, "coverage": coverage})


def _coverage(answer: dict[str, Any], ran: str) -> dict[str, Any]:
    """``coverage`` of an answer with the upstream run: the checks it ran, those it did not and why."""
    names = ("TransformerConfig", "OptimizerConfig", "DistributedDataParallelConfig", BUILD_STAGE)
    done = {*answer.get("ran", names[:3]), *([BUILD_STAGE] if answer.get("built") else [])}
    checks = dict(zip(names, validate_mod.UPSTREAM_CHECKS, strict=True))
    coverage = {
        "upstream": f"ran: {ran}",
        "upstream_checks": [text for name, text in checks.items() if name in done],
        "not_run": [*(text for name, text in checks.items() if name not in done), *answer["skipped"]],
    }
    return coverage


def _kept(findings: list[Finding], answer: dict[str, Any]) -> list[Finding]:
    """The catalogue's findings that stay beside megatron-core's answer (whose ``errors`` lose those they match).

    megatron-core stops at the first failing check of a stage. A stage it ran: where its error is the one a
    catalogue finding says, that finding stays in its place (its keys and fix), and so do the stage's findings
    after it (checks upstream never reached, in upstream's order: all of a config's offload problems at once);
    the findings before it, or all of the stage's when it raised nothing or something no rule says, go.
    """
    ran_stages = {_STAGES.get(s, s) for s in answer.get("ran", ["TransformerConfig", "OptimizerConfig"])}

    def said(e: dict[str, Any]) -> tuple[str, str]:
        return _STAGES.get(e["stage"], e["stage"]), _sets_sorted(e["message"])

    def says(f: Finding) -> tuple[str | None, str]:
        return f.stage, _sets_sorted(f.message if f.upstream_message is None else f.upstream_message)

    raised = {said(e) for e in answer["errors"]}
    confirmed = [f for f in findings if says(f) in raised]
    answer["errors"] = [e for e in answer["errors"] if all(says(f) != said(e) for f in confirmed)]
    why = f"megatron-core {answer['version']} raised this very message in the upstream run"
    reached: set[str | None] = set()  # stages whose confirmed finding has been passed
    kept = []
    for f in findings:
        if f in confirmed and f.stage not in reached:
            reached.add(f.stage)
            kept.append(f.model_copy(update={"why": f"{f.why} ({why}.)" if f.why else why}))
        elif f.stage not in ran_stages or f.stage in reached:
            kept.append(f)
    return kept


def _sets_sorted(message: str) -> str:
    """``message`` with the contents of each ``{...}`` sorted: megatron-core prints sets in hash-seed order."""
    return re.sub(r"\{([^{}]*)\}", lambda mo: "{" + ", ".join(sorted(mo.group(1).split(", "))) + "}", message)
