"""``validate --exact`` / MCP ``exact=true``: ask the installed megatron-core itself, in a subprocess with a deadline.

The fast path (the rule catalogue) stays torch-free; exact mode builds the real ``TransformerConfig``,
``OptimizerConfig`` and ``DistributedDataParallelConfig`` from the config's sections, as the user wrote them, in a
child process (``mbridge_offload_tools.exact_child``: importing megatron-core takes ~10 s and torch), and reports
every error it
raises as a finding with origin ``mcore`` and the message verbatim. Those findings replace the catalogue's findings of
the same stages (megatron-core's own answer wins); the other findings (Transformer Engine, Bridge, advisory) stay.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from mbridge_offload.config.rules.base import STAGE_OPTIMIZER_CONFIG, STAGE_TRANSFORMER_CONFIG
from mbridge_offload.config.validate import Finding, Report

CHILD = Path(__file__).with_name("exact_child.py")
DEFAULT_DEADLINE_S = 120.0
_STAGES = {"TransformerConfig": STAGE_TRANSFORMER_CONFIG, "OptimizerConfig": STAGE_OPTIMIZER_CONFIG}


class ExactUnavailable(RuntimeError):
    """Exact mode cannot run here (megatron-core not installed, or the child failed or ran out of time)."""


def megatron_core_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


def run_child(raw: dict[str, Any], deadline_s: float = DEFAULT_DEADLINE_S) -> dict[str, Any]:
    """The child's answer for the config sections of ``raw``.

    Raises:
        ExactUnavailable: megatron-core is not importable, or the child failed or passed the deadline.
    """
    if not megatron_core_installed():
        raise ExactUnavailable(
            "--exact needs megatron-core installed in this Python environment (pip install megatron-core); "
            "without it, validate without --exact uses the built-in rule catalogue"
        )
    payload = {k: raw.get(k) or {} for k in ("model", "optimizer", "ddp")}
    try:
        proc = subprocess.run(
            [sys.executable, str(CHILD)],
            input=json.dumps(payload, default=str),
            capture_output=True,
            text=True,
            timeout=deadline_s,
        )
    except subprocess.TimeoutExpired:
        raise ExactUnavailable(f"--exact: megatron-core did not answer within {deadline_s:g} s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ExactUnavailable(f"--exact: building the megatron-core configs failed ({last})")
    return json.loads(proc.stdout)


def exact_report(report: Report, raw: dict[str, Any], deadline_s: float = DEFAULT_DEADLINE_S) -> Report:
    """``report`` with its megatron-core config findings replaced by what the installed megatron-core raises."""
    answer = run_child(raw, deadline_s)
    version = answer["version"]
    stages = set(_STAGES.values()) | {"DistributedDataParallelConfig"}
    kept = [f for f in report.findings if f.stage not in stages]
    exact = [
        Finding(
            rule="MCORE-EXACT",
            severity="error",
            origin="mcore",
            keys=[],
            message=e["message"] or f"{e['type']} (no message)",
            fix=None,
            why=f"raised by megatron-core {version} installed here, building {e['stage']} (exact mode)",
            stage=_STAGES.get(e["stage"], e["stage"]),
            upstream_message=e["message"],
            exception=e["type"],
        )
        for e in answer["errors"]
    ]
    notes = [
        Finding(
            rule="MCORE-EXACT-SKIPPED",
            severity="info",
            origin="mcore",
            keys=[],
            message=text,
            fix=None,
            why=f"exact mode with megatron-core {version}",
        )
        for text in answer["skipped"]
    ]
    if not report.target.endswith("==" + version):
        notes.append(
            Finding(
                rule="MCORE-EXACT-VERSION",
                severity="info",
                origin="mcore",
                keys=[],
                message=f"exact mode ran megatron-core {version} (installed here), not {report.target}",
                fix=None,
                why="exact mode can only ask the release that is installed; the other findings follow the target",
            )
        )
    return report.model_copy(update={"findings": exact + kept + notes})
