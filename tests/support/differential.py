"""Compare ``validate`` with real megatron-core on generated cases (shared by the differential test and benchmark).

The oracle (``tests/support/mcore_oracle.py``) runs once per megatron-core version in its own subprocess and judges a
whole batch of cases (one import of megatron-core, ~10 s). Our side loads each case through the source it names
(dict, YAML text or Hydra overrides) and runs ``validate`` for the same version.

- Verdict: megatron-core refuses when any of its three stages raised (``TransformerConfig``, ``OptimizerConfig``,
  the optimizer factory's asserts); we refuse when ``validate`` reports any error, or the config cannot be loaded
  (exit 2). Every refusal counts, not only offloading's, except Bridge's own (origin ``bridge``, e.g. ACT-FG-NVTE-V1):
  the oracle is megatron-core alone; Bridge's checks are compared with Bridge itself (tests/config/test_bridge062.py).
- Message: where both refuse, for each stage megatron-core raised in, our first error of that stage must carry the
  same exception type and text (sets in upstream messages are printed in hash-seed order: compared sorted).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mbridge_offload.config.rules.base import STAGE_OPTIMIZER_CONFIG, STAGE_OPTIMIZER_FACTORY, STAGE_TRANSFORMER_CONFIG
from mbridge_offload.config.sources import ConfigError, build_config, load
from mbridge_offload.config.validate import first_error, validate
from tests.support.config_gen import case_to_source

ROOT = Path(__file__).resolve().parents[2]
STAGES = (
    ("transformer", STAGE_TRANSFORMER_CONFIG),
    ("optimizer_config", STAGE_OPTIMIZER_CONFIG),
    ("factory", STAGE_OPTIMIZER_FACTORY),
)


def version_env(label: str) -> dict[str, str] | None:
    """The environment that imports megatron-core ``label`` (None when that version is not installed here)."""
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if label == "0.16.1":
        return base
    newer = ROOT / ".mcore" / label
    return {**base, "PYTHONPATH": str(newer)} if (newer / "megatron" / "core").is_dir() else None


def run_oracle(label: str, cases: list[dict], timeout: float = 600) -> dict:
    """Real megatron-core's outcome for every case (one subprocess for the whole batch)."""
    env = version_env(label)
    if env is None:
        raise RuntimeError(f"megatron-core {label} is not installed (make setup installs it under .mcore/)")
    payload = [{"id": c["id"], "model": c["model"], "optimizer": c["optimizer"]} for c in cases]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "mcore_oracle.py")],
        input=json.dumps({"cases": payload}),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout)


def normalize(message: str | None) -> str | None:
    """Sort the contents of ``{…}`` set displays (their order depends on the hash seed)."""
    if message is None:
        return None
    return re.sub(r"\{([^{}]*)\}", lambda mo: "{" + ", ".join(sorted(mo.group(1).split(", "))) + "}", message)


@dataclass
class Outcome:
    """One case judged by both sides."""

    case: dict
    real_reject: bool
    ours_reject: bool
    message_ok: bool | None = None  # None: not both refused
    detail: str = ""
    crash: str | None = None
    ours_rules: list[str] = field(default_factory=list)
    first_rules: list[str] = field(default_factory=list)  # our first error per stage, where it matched upstream's

    @property
    def verdict_ok(self) -> bool:
        return self.real_reject == self.ours_reject and self.crash is None


def our_report(case: dict, label: str):
    """``(report | None, load error | None, raw, config)`` for a case, loaded through the source it names: the
    catalogue's report (the upstream run is merged in by :func:`judge_all`, one batch for every case)."""
    how = case_to_source(case)
    try:
        if "raw" in how:
            raw = json.loads(json.dumps(how["raw"]))
            config = build_config(raw)
        else:
            loaded = load(how.get("source"), how.get("overrides"))
            config, raw = loaded.config, loaded.raw
    except ConfigError as exc:
        return None, str(exc), None, None
    return validate(config, raw, target=f"megatron-core=={label}"), None, raw, config


def with_upstream(cases: list[dict], label: str) -> list[tuple[Any, Any]]:
    """Each case's ``(report | None, load error | exception)`` as ``validate`` answers by default: the catalogue's
    report with megatron-core's own run merged in (``mbridge_offload_tools.exact``; one batch, one import)."""
    from mbridge_offload_tools.exact.run import merge, payload, run_children

    mine: list[tuple[Any, Any, Any, Any]] = []
    for case in cases:
        try:
            mine.append(our_report(case, label))
        except Exception as exc:  # a crash of ours is a finding of the benchmark, never hidden
            mine.append((None, exc, None, None))
    target = f"megatron-core=={label}"
    bodies = []
    for report, _, raw, config in mine:
        if report is None:
            continue
        body = payload(raw, config, target, None)
        body["model"] = {"hidden_size": 64, "num_attention_heads": 4, **body["model"]}  # the oracle's defaults
        body["te_version"] = report.env.get("te_version")
        bodies.append(body)
    answers = iter(run_children(bodies, target))
    return [(merge(r, next(answers)) if r is not None else None, err) for r, err, _, _ in mine]


def judge(case: dict, real: dict, mine: tuple[Any, Any]) -> Outcome:
    """Compare one case at one version (``mine``: :func:`with_upstream`'s answer for it)."""
    outcomes = {key: (None if real[key] == "not-run" else real[key]) for key, _ in STAGES}
    real_reject = any(v is not None for v in outcomes.values())
    report, load_error = mine
    if isinstance(load_error, Exception):
        return Outcome(case, real_reject, False, crash=f"{type(load_error).__name__}: {load_error}")
    if report is None:
        return Outcome(case, real_reject, True, message_ok=False if real_reject else None, detail=f"load: {load_error}")
    errors = [f for f in report.errors if f.origin != "bridge"]
    ours_reject = bool(errors)
    out = Outcome(case, real_reject, ours_reject, ours_rules=[f.rule for f in errors])
    if real_reject and ours_reject:
        problems = []
        for key, stage in STAGES:
            theirs = outcomes[key]
            if theirs is None:
                continue
            mine = first_error(report, stage)
            ours = None if mine is None else (mine.exception, normalize(mine.upstream_message))
            if ours != (theirs["type"], normalize(theirs["message"])):
                problems.append(f"{key}: ours={ours} real={theirs}")
            else:
                out.first_rules.append(mine.rule)
        out.message_ok = not problems
        out.detail = "; ".join(problems)
    elif out.real_reject != out.ours_reject:
        out.detail = f"real={ {k: v for k, v in outcomes.items() if v} } ours={out.ours_rules}"
    return out


def judge_all(cases: list[dict], label: str) -> tuple[dict, list[Outcome]]:
    """Run the oracle once for ``cases`` and judge each; returns ``(oracle answer, outcomes)``."""
    oracle = run_oracle(label, cases)
    mine = with_upstream(cases, label)
    return oracle, [judge(c, r, m) for c, r, m in zip(cases, oracle["results"], mine, strict=True)]


def disagreement_class(o: Outcome) -> str:
    """A short name for why a case disagreed (for the benchmark's table)."""
    if o.crash:
        return "crash"
    if not o.verdict_ok:
        side = "we accept, mcore refuses" if o.real_reject else "we refuse, mcore accepts"
        first = o.detail.split("'message': ")[-1][:70] if o.real_reject else ",".join(o.ours_rules[:2])
        return f"{side}: {first}"
    return "message: " + o.detail[:90]


def build_time_only(o: Outcome) -> bool:
    """A disagreement where we refuse only for reasons raised at model build or later, after every check
    megatron-core's config classes run (Transformer Engine's or Bridge's own, origin ``te`` / ``bridge``,
    megatron-core's own model build, ``MCORE-BUILD``, or its first optimizer step, ``STAGE_FIRST_STEP``), which real
    megatron-core's config accepts."""
    from mbridge_offload.config.rules.base import STAGE_FIRST_STEP
    from mbridge_offload.config.rules.catalogue import get_rule

    def after_config(rule_id: str) -> bool:
        if rule_id == "MCORE-BUILD":
            return True
        rule = get_rule(rule_id)
        return rule.origin in ("te", "bridge") or rule.stage == STAGE_FIRST_STEP

    return (
        not o.verdict_ok
        and o.crash is None
        and not o.real_reject
        and bool(o.ours_rules)
        and all(after_config(r) for r in o.ours_rules)
    )


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """Counts and rates for a list of outcomes."""
    both = [o for o in outcomes if o.message_ok is not None]
    classes = Counter(disagreement_class(o) for o in outcomes if not o.verdict_ok or o.message_ok is False)
    return {
        "cases": len(outcomes),
        "verdict_agree": sum(o.verdict_ok for o in outcomes),
        "real_refusals": sum(o.real_reject for o in outcomes),
        "both_refuse": len(both),
        "message_agree": sum(bool(o.message_ok) for o in both),
        "crashes": sum(o.crash is not None for o in outcomes),
        "build_time_only": sum(build_time_only(o) for o in outcomes),
        "classes": classes,
    }
