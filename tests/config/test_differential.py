"""Differential test: our verdicts and messages vs constructing the real megatron-core configs, per version.

For several hundred seeded generated configs, ``tests/support/mcore_oracle.py`` (one subprocess per installed
megatron-core, importing it once) evaluates three upstream stages for real: ``TransformerConfig``,
``OptimizerConfig`` and the optimizer factory's offload asserts. Upstream stops at its first failing check,
so for each stage we compare the first error our catalogue reports for that stage (catalogue order = upstream
code order) with what upstream raised: same verdict, same exception type, same message. Any disagreement fails.

Generation choices (documented in docs/rules.md's preamble and docs/cpu-offloading.md):
- ``pipeline_dtype`` is always set when PP > 1. Real MCore first raises "When using pipeline parallelism,
  pipeline_dtype must be specified" otherwise; Bridge's mixed-precision setup fills the field in before the
  model config is finalised, so Bridge users never see that message and the catalogue has no rule for it.
- Only the keys the catalogue reasons about vary; everything else stays at upstream defaults. Combinations
  whose first upstream error comes from checks outside this project's scope are not generated: fine-grained
  offloading together with CUDA graphs (0.19 has a dozen graph/offload-module checks), ``moe_paged_stash``
  without ``cpu_offloading`` (needs ``moe_expert_rank_capacity_factor`` and a flex dispatcher), recompute
  other than well-formed full/selective, recompute together with CUDA graphs without ``cpu_offloading``
  (MCore's own graph/recompute checks), precision-aware optimizer without optimizer offload (without TE,
  0.19 raises "requires FusedAdam from TransformerEngine").
- Sets in upstream messages print in hash-seed order; both sides are compared with set contents sorted.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mbridge_offload.config.rules.base import (
    STAGE_OPTIMIZER_CONFIG,
    STAGE_OPTIMIZER_FACTORY,
    STAGE_TRANSFORMER_CONFIG,
    TARGETS,
)
from mbridge_offload.config.rules.catalogue import all_rules
from mbridge_offload.config.sources import build_config
from mbridge_offload.config.validate import first_error, validate

ROOT = Path(__file__).resolve().parents[2]
SEED = 20261202
N_CASES = 400

pytestmark = pytest.mark.megatron


def _versions() -> list:
    """Every megatron-core the project tests against: the venv's 0.16.1 and 0.19.2 under .mcore/ (make setup)."""
    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    newer = ROOT / ".mcore" / "0.19.2"
    missing = not (newer / "megatron" / "core").is_dir()
    return [
        pytest.param("0.16.1", base_env, id="0.16.1"),
        pytest.param(
            "0.19.2",
            {**base_env, "PYTHONPATH": str(newer)},
            id="0.19.2",
            marks=pytest.mark.skipif(
                missing, reason=f"megatron-core 0.19.2 not installed at {newer} (make setup installs it)"
            ),
        ),
    ]


_ORACLE: dict[str, dict] = {}


def run_oracle(label: str, env: dict[str, str], cases: list[dict]) -> dict:
    """The oracle's answer for ``cases`` under one megatron-core version (one subprocess per version, cached)."""
    if label not in _ORACLE:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "support" / "mcore_oracle.py")],
            input=json.dumps({"cases": cases}),
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        _ORACLE[label] = json.loads(proc.stdout)
    return _ORACLE[label]


def generate_case(rng: random.Random, case_id: int) -> dict:
    """One random config: TransformerConfig kwargs (``model``) and OptimizerConfig kwargs (``optimizer``)."""
    num_layers = rng.choice([2, 4, 8, 12])
    m: dict = {"num_layers": num_layers}
    offload = rng.random() < 0.7
    if offload:
        m["cpu_offloading"] = True
    if offload or rng.random() < 0.3:
        m["cpu_offloading_num_layers"] = rng.choice(
            [-1, 0, 1, num_layers - 2, num_layers - 1, num_layers, num_layers + 3]
        )
    if rng.random() < 0.25:
        m["pipeline_model_parallel_size"] = 2
        m["pipeline_dtype"] = rng.choice(["fp32", "bf16"])
    recompute = rng.choice([None, None, None, "full", "selective"])
    if recompute == "full":
        m.update(
            recompute_granularity="full", recompute_method=rng.choice(["uniform", "block"]), recompute_num_layers=1
        )
    elif recompute == "selective":
        m["recompute_granularity"] = "selective"
    fine_grained = rng.random() < 0.3
    if fine_grained:
        m["fine_grained_activation_offloading"] = True
        m["offload_modules"] = rng.choice(
            [
                [],
                ["core_attn"],
                ["attn_proj"],
                ["core_attn", "attn_proj"],
                ["foo"],
                ["fused_group_mlp"],
                ["qkv_linear", "mlp_norm"],
                ["expert_fc1", "bar"],
                ["attn_norm", "moe_act"],
            ]
        )
        if rng.random() < 0.2:
            m["min_offloaded_tensor_size"] = -1
        if rng.random() < 0.5:
            m["activation_offload_fraction"] = rng.choice([1.5, -0.1, 0.5, 0.0])
        if rng.random() < 0.1:
            m["delta_offload_bytes_across_pp_ranks"] = -1
    if offload and rng.random() < 0.15:
        m["moe_paged_stash"] = True
    if offload or not (fine_grained or recompute):
        graphs = rng.choice(
            ["none", "none", "none", "local", "transformer_engine", "full_iteration", "magic", "enable", "enable+impl"]
        )
        if graphs == "enable":
            m["enable_cuda_graph"] = True
        elif graphs == "enable+impl":
            m["enable_cuda_graph"] = True
            m["cuda_graph_impl"] = rng.choice(["local", "full_iteration"])
        elif graphs != "none":
            m["cuda_graph_impl"] = graphs
    for key in ("cpu_offloading_activations", "cpu_offloading_weights", "cpu_offloading_double_buffering"):
        if rng.random() < 0.2:
            m[key] = key != "cpu_offloading_activations"

    o: dict = {}
    if rng.random() < 0.6:
        o["optimizer_cpu_offload"] = True
        if rng.random() < 0.3:
            o["use_precision_aware_optimizer"] = True
    o["optimizer_offload_fraction"] = rng.choice([0.0, 0.25, 0.5, 1.0, 1.5, -0.2])
    if rng.random() < 0.25:
        o["decoupled_weight_decay"] = False
    o["optimizer"] = rng.choice(["adam", "adam", "adam", "sgd"])
    if rng.random() < 0.5:
        o["use_distributed_optimizer"] = True
    if rng.random() < 0.15:
        o["skip_megatron_wrapping"] = True
    for key in ("use_torch_optimizer_for_cpu_offload", "overlap_cpu_optimizer_d2h_h2d"):
        if rng.random() < 0.2:
            o[key] = True
    return {"id": case_id, "model": m, "optimizer": o}


def _normalize(message: str | None) -> str | None:
    if message is None:
        return None
    return re.sub(r"\{([^{}]*)\}", lambda mo: "{" + ", ".join(sorted(mo.group(1).split(", "))) + "}", message)


def _ours(finding) -> dict | None:
    if finding is None:
        return None
    return {"type": finding.exception, "message": _normalize(finding.upstream_message)}


def _theirs(outcome) -> dict | None:
    if outcome is None:
        return None
    return {"type": outcome["type"], "message": _normalize(outcome["message"])}


def compare(case: dict, real: dict, label: str, covered: set[str] | None = None) -> tuple[int, list[str]]:
    """Compare one case at one version: returns (stage comparisons made, disagreement descriptions).

    ``covered`` collects the ids of rules whose error matched a real upstream error.
    """
    config = build_config({"model": case["model"], "optimizer": case["optimizer"]})
    report = validate(config, target=f"megatron-core=={label}")
    problems, comparisons = [], 0
    stages = [("transformer", STAGE_TRANSFORMER_CONFIG), ("optimizer_config", STAGE_OPTIMIZER_CONFIG)]
    if real["optimizer_config"] is None:  # the factory runs only on an accepted OptimizerConfig
        stages.append(("factory", STAGE_OPTIMIZER_FACTORY))
    for key, stage in stages:
        outcome = real[key]
        mine = first_error(report, stage)
        ours = _ours(mine)
        # "not-run": not callable on CPU for this config; our factory-stage rules must then have nothing to say.
        theirs = None if outcome == "not-run" else _theirs(outcome)
        comparisons += 1
        if ours != theirs:
            problems.append(f"case {case['id']} {key}: ours={ours} real={theirs} config={case}")
        elif mine is not None and covered is not None:
            covered.add(mine.rule)
    return comparisons, problems


# A few directed cases, one per rule that random draws reach only rarely as the *first* upstream error.
DIRECTED: list[dict] = [
    {
        "num_layers": 4,
        "fine_grained_activation_offloading": True,
        "offload_modules": ["core_attn"],
        "delta_offload_bytes_across_pp_ranks": -1,
    },
    {
        "num_layers": 4,
        "fine_grained_activation_offloading": True,
        "offload_modules": ["core_attn"],
        "activation_offload_fraction": 2.0,
    },
    {
        "num_layers": 4,
        "fine_grained_activation_offloading": True,
        "offload_modules": ["core_attn"],
        "min_offloaded_tensor_size": -5,
    },
    {"num_layers": 4, "cpu_offloading": True, "cpu_offloading_num_layers": 1, "moe_paged_stash": True},
    {"num_layers": 4, "cpu_offloading": True, "cpu_offloading_num_layers": 1, "cuda_graph_impl": "full_iteration"},
]


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    rng = random.Random(SEED)
    generated = [generate_case(rng, i) for i in range(N_CASES)]
    directed = [{"id": N_CASES + i, "model": m, "optimizer": {}} for i, m in enumerate(DIRECTED)]
    return generated + directed


@pytest.mark.parametrize("label,env", _versions())
def test_catalogue_agrees_with_real_megatron_core(label, env, cases, differential_log):
    oracle = run_oracle(label, env, cases)
    assert oracle["version"].startswith(label), oracle["version"]
    total, problems, covered = 0, [], set()
    for case, real in zip(cases, oracle["results"], strict=True):
        n, bad = compare(case, real, label, covered)
        total += n
        problems += bad
    differential_log.append((f"megatron-core {label}", len(cases), total, len(problems)))
    print(f"differential megatron-core {label}: {len(cases)} cases, {total} comparisons, {len(problems)} disagreements")
    # The generated cases must actually exercise the rules, not just pass.
    failing = sum(1 for r in oracle["results"] if r["transformer"] is not None)
    assert failing > len(cases) // 4, f"only {failing} cases fail TransformerConfig: the generator is too tame"
    assert not problems, "\n".join(problems[:20])
    # Every error rule of the three stages that applies to this version was confirmed by real code at least once.
    target = TARGETS[label]
    stages = {STAGE_TRANSFORMER_CONFIG, STAGE_OPTIMIZER_CONFIG, STAGE_OPTIMIZER_FACTORY}
    expected = {r.id for r in all_rules() if r.stage in stages and r.severity == "error" and r.applies(target)}
    assert expected - covered == set(), f"rules never confirmed against megatron-core {label}"


@pytest.mark.parametrize("label,env", _versions())
def test_version_gated_fields_match_the_real_dataclasses(label, env, cases):
    """Fields our rules treat as 0.19+ are absent from the 0.16.1 TransformerConfig and present in 0.19.2."""
    fields = set(run_oracle(label, env, cases)["transformer_fields"])
    newer = {
        "moe_paged_stash",
        "activation_offload_fraction",
        "delta_offload_bytes_across_pp_ranks",
        "cpu_offloading_retain_pinned_cpu_buffers",
    }
    assert TARGETS[label]
    if label == "0.16.1":
        assert not newer & fields
    else:
        assert newer <= fields
    assert {
        "cpu_offloading",
        "cpu_offloading_num_layers",
        "fine_grained_activation_offloading",
        "min_offloaded_tensor_size",
        "offload_modules",
    } <= fields
