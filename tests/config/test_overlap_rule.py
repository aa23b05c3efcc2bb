"""One overlap rule: where ``overlap_cpu_optimizer_d2h_h2d`` should be on is decided by ``overlap_advised`` alone.

validate (OPT-OVERLAP), apply, recommend (the planner's proposals and its fallback), diagnose and the docs must all
give the same answer at fractions around the threshold.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from mbridge_offload.actions.apply.apply import apply_offload
from mbridge_offload.actions.diagnose.diagnose import diagnose
from mbridge_offload.config.rules.optimizer.offload import OVERLAP_FROM_FRACTION, overlap_advised
from mbridge_offload.config.sources import load
from mbridge_offload.config.validate import validate
from mbridge_offload.plan.inputs.resolve import resolve
from mbridge_offload.plan.search import planner

ROOT = Path(__file__).resolve().parents[2]
FRACTIONS = (0.25, 0.5, 0.74, 0.75, 1.0)
OVERLAP_ON = "optimizer.overlap_cpu_optimizer_d2h_h2d=true"
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB."


def _config(tmp_path: Path, fraction: float, overlap: bool = False, extra: str = ""):
    path = tmp_path / f"run_{fraction}.yaml"
    path.write_text(
        "model:\n  num_layers: 8\n"
        f"{extra}"
        "optimizer:\n  optimizer_cpu_offload: true\n"
        f"  optimizer_offload_fraction: {fraction}\n"
        f"  overlap_cpu_optimizer_d2h_h2d: {str(overlap).lower()}\n",
        encoding="utf-8",
    )
    return path


def _overlap_in(overrides: list[str]) -> bool:
    return OVERLAP_ON in overrides


def test_the_threshold_is_where_overlap_was_measured_to_pay() -> None:
    assert [overlap_advised(f) for f in FRACTIONS] == [f >= OVERLAP_FROM_FRACTION for f in FRACTIONS]
    assert not overlap_advised(0.5) and overlap_advised(1.0)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_validate_advises_overlap_exactly_where_the_rule_says(tmp_path: Path, fraction: float) -> None:
    loaded = load(str(_config(tmp_path, fraction)))
    rules = {f.rule for f in validate(loaded.config, loaded.raw).findings}
    assert ("OPT-OVERLAP" in rules) == overlap_advised(fraction)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_apply_switches_overlap_on_exactly_where_the_rule_says(tmp_path: Path, fraction: float) -> None:
    path = tmp_path / "plain.yaml"
    path.write_text("model:\n  num_layers: 8\noptimizer:\n  lr: 0.0003\n", encoding="utf-8")
    result = apply_offload(str(path), "optimizer", fraction=fraction)
    keys = {c.key: c.new for c in result.changes}
    assert keys.get("optimizer.overlap_cpu_optimizer_d2h_h2d", False) is overlap_advised(fraction)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_the_planner_sets_overlap_exactly_where_the_rule_says(fraction: float) -> None:
    r = resolve({"model": "qwen3-30b-a3b", "gpu": "h100-80gb"})
    assert planner._overlap(r, replace(r.setup, optimizer_offload_fraction=fraction)) is overlap_advised(fraction)


@pytest.mark.parametrize("gpu_memory_gb", [None, 64.0, 48.0, 44.0])  # fallback 0.5, 0.4; 0.7; 0.95
def test_recommend_and_its_fallback_write_overlap_as_the_rule_says(gpu_memory_gb: float | None) -> None:
    flags = {"model": "qwen3-30b-a3b", "gpu": "h100-80gb", "gpu_memory_gb": gpu_memory_gb}
    rec = planner.recommend(resolve({k: v for k, v in flags.items() if v is not None}))
    written = [rec.overrides] + ([rec.fallback.overrides] if rec.fallback else [])
    checked = 0
    for overrides in written:
        fraction = next((o.split("=")[1] for o in overrides if "optimizer_offload_fraction=" in o), None)
        if fraction is None:
            continue
        checked += 1
        overlap = next(o.split("=")[1] for o in overrides if "overlap_cpu_optimizer_d2h_h2d=" in o)
        assert (overlap.lower() == "true") is overlap_advised(float(fraction)), overrides
    assert checked >= 1, (rec.mode, written)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_diagnose_oom_fix_is_the_planners_option_with_overlap_as_the_rule_says(tmp_path: Path, fraction: float) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "model:\n  seq_length: 1024\noptimizer:\n  use_distributed_optimizer: true\n  optimizer_cpu_offload: true\n"
        f"  optimizer_offload_fraction: {fraction}\n",
        encoding="utf-8",
    )
    loaded = load(str(path))
    report = diagnose(error=OOM, config=loaded.config, raw=loaded.raw, planner={"model": "llama3-8b", "num_gpus": 2})
    top = report.matches[0]
    assert top.failure in ("oom_partial_optimizer_offload", "oom_full_optimizer_offload")
    assert top.fix in [o.overrides for o in report.options]  # the planner's, never a fraction of diagnose's own
    fractions = [
        (overrides, float(f.split("=")[1]))
        for overrides in (o.overrides for o in report.options)
        for f in overrides
        if "optimizer_offload_fraction=" in f
    ]
    assert fractions  # this setup's options raise the fraction: the check below has something to check
    for overrides, new in fractions:
        assert _overlap_in(overrides) is overlap_advised(new), overrides


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_diagnose_slowdown_fix_lowers_the_fraction_with_overlap_as_the_rule_says(
    tmp_path: Path, fraction: float
) -> None:
    cfg = load(str(_config(tmp_path, fraction))).config
    top = diagnose(symptom="slowdown", config=cfg).matches[0]
    new = float(next(f for f in top.fix if "optimizer_offload_fraction=" in f).split("=")[1])
    assert _overlap_in(top.fix) is overlap_advised(new)


def test_diagnose_pp_error_switch_to_optimizer_offload_follows_the_rule() -> None:
    top = diagnose(
        error="ValueError: Currently there is no support for Pipeline parallelism with CPU offloading"
    ).matches[0]
    new = float(next(f for f in top.fix if "optimizer_offload_fraction=" in f).split("=")[1])
    assert top.failure == "pp_constraint" and _overlap_in(top.fix) is overlap_advised(new)


@pytest.mark.parametrize("doc", ["docs/mcp.md", "SKILL.md", "card.yaml"])
def test_docs_quote_the_codes_threshold(doc: str) -> None:
    text = (ROOT / doc).read_text(encoding="utf-8")
    quoted = {float(x) for x in re.findall(r"(?:from|>=) ?_?fraction[ _](\d\.\d+)", text.replace("from_", "from "))}
    assert quoted == {OVERLAP_FROM_FRACTION}, f"{doc} quotes {quoted} as the overlap threshold"
