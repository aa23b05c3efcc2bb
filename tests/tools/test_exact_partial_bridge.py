"""``validate --exact`` on generated partial Bridge YAMLs judges what the run builds, as plain validate does.

A partial Bridge YAML (model/optimizer sections with no ``_target_``, merged onto a recipe) reaches megatron-core
through Bridge's ``finalize()``, which sets ``pipeline_dtype = params_dtype`` under pipeline parallelism; a Megatron-LM
command line through ``core_transformer_config_from_args``, which does the same. So neither ever meets megatron-core's
"When using pipeline parallelism, pipeline_dtype must be specified", and the catalogue has no rule for it. Here the
real megatron-core of each release judges exact mode's payload (:func:`mbridge_offload_tools.exact.run.payload`, the
sections the child builds) for seeded partial YAMLs (PP 1/2/4 with and without ``pipeline_dtype``, TP, sequence
parallelism, MoE with and without ETP, a ``_target_`` or a ``mixed_precision`` block on some, overrides on others,
and an injected real error on about a quarter), one megatron-core import per release; each must give, per stage, the
first error the rule catalogue reports where it reports one (the catalogue keeps only what megatron-core cannot check
here; validate runs megatron-core itself by default), never the pipeline_dtype error, and the injected errors must
still be reported.
"""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from mbridge_offload.config.rules.base import STAGE_OPTIMIZER_CONFIG, STAGE_TRANSFORMER_CONFIG
from mbridge_offload.config.sources import load
from mbridge_offload.config.validate import Report, first_error, validate
from mbridge_offload_tools.exact.run import payload, run_children

ROOT = Path(__file__).resolve().parents[2]
MCORE_NEW = ROOT / ".mcore" / "0.19.2" / "megatron" / "core"
needs_019 = pytest.mark.skipif(not MCORE_NEW.is_dir(), reason="scripts/setup installs megatron-core 0.19.2 in .mcore/")
pytestmark = [pytest.mark.megatron, pytest.mark.long]

PIPELINE_DTYPE_ERROR = "When using pipeline parallelism, pipeline_dtype must be specified"
HEADS_ERROR = "num_attention_heads (6) must be a multiple of tensor_model_parallel_size (4)."
BRIDGE_PROVIDER = "megatron.bridge.models.gpt_provider.GPTModelProvider"
STAGES = {"TransformerConfig": STAGE_TRANSFORMER_CONFIG, "OptimizerConfig": STAGE_OPTIMIZER_CONFIG}
N_CASES = 48


def _case(rng: random.Random) -> dict:
    """One partial Bridge YAML (as text) and optional overrides; ``injected`` names a real error put in."""
    pp = rng.choice([1, 2, 4])
    tp = rng.choice([1, 2])
    m: dict = {"num_layers": pp * rng.choice([1, 2, 3]), "hidden_size": 64, "num_attention_heads": 4}
    m["pipeline_model_parallel_size"] = pp
    m["tensor_model_parallel_size"] = tp
    if rng.random() < 0.5:
        m["bf16"] = True
    dtype = rng.choice([None, None, None, "bf16", "fp32"])
    if dtype is not None:
        m["pipeline_dtype"] = dtype
    sp = rng.choice([None, True, False])
    if sp is not None:
        m["sequence_parallel"] = sp
    if rng.random() < 0.4:
        m.update(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64)
        m["expert_model_parallel_size"] = rng.choice([1, 2])
        etp = rng.choice([None, 1, tp])
        if etp is not None:
            m["expert_tensor_parallel_size"] = etp
    injected = None
    if rng.random() < 0.25:
        m.update(num_attention_heads=6, tensor_model_parallel_size=4)
        injected = HEADS_ERROR
    doc: dict = {"model": m, "optimizer": {"optimizer": "adam", "bf16": bool(m.get("bf16"))}}
    kind = rng.choice(["partial", "partial", "partial", "provider", "mixed_precision"])
    if kind == "provider":
        m["_target_"] = BRIDGE_PROVIDER
    elif kind == "mixed_precision":
        doc["mixed_precision"] = rng.choice(["bf16_mixed", "fp16_mixed"])
    overrides = []
    if rng.random() < 0.3:  # the pipeline size set on the command line instead of in the file
        overrides = [f"model.pipeline_model_parallel_size={m.pop('pipeline_model_parallel_size')}"]
    out = io.StringIO()
    YAML(typ="safe", pure=True).dump(doc, out)
    return {"text": out.getvalue(), "overrides": overrides, "injected": injected, "pp": pp, "dtype": dtype}


CASES = [_case(random.Random(f"partial-bridge-{i}")) for i in range(N_CASES)]


def _ours(case: dict, target: str) -> tuple[Report, dict]:
    loaded = load(case["text"], case["overrides"])
    report = validate(loaded.config, loaded.raw, target=target)
    body = payload(loaded.raw, loaded.config, target, loaded.source)
    body["te_version"] = report.env.get("te_version")
    return report, body


def _judge(target: str, ran: str) -> list[tuple[dict, Report, dict]]:
    """Every case: (case, plain validate's report for ``target``, megatron-core ``ran``'s answer to exact's payload)."""
    pairs = [_ours(case, target) for case in CASES]
    answers = run_children([body for _, body in pairs], f"megatron-core=={ran}")
    assert {a["version"] for a in answers} == {ran}
    return [(case, report, answer) for case, (report, _), answer in zip(CASES, pairs, answers, strict=True)]


def _check(judged: list[tuple[dict, Report, dict]]) -> None:
    assert any(c["pp"] > 1 and c["dtype"] is None for c, _, _ in judged)  # the generator reaches the issue's case
    for case, report, answer in judged:
        messages = [e["message"] for e in answer["errors"]]
        assert PIPELINE_DTYPE_ERROR not in messages, case
        for name, stage in STAGES.items():
            theirs = next(((e["type"], e["message"]) for e in answer["errors"] if e["stage"] == name), None)
            mine = first_error(report, stage)
            # The catalogue keeps only the checks megatron-core cannot run here (validate runs megatron-core itself by
            # default, so a check it makes is not ported): where the catalogue errs, megatron-core errs the same way
            # first; where it is silent, megatron-core's own answer is validate's (coverage says which ran).
            if mine is not None:
                assert theirs == (mine.exception, mine.upstream_message), (case, name)
        if case["injected"]:  # a real error is still megatron-core's answer
            assert case["injected"] in messages, case
    assert sum(bool(c["injected"]) for c, _, _ in judged) >= 5


def test_the_installed_release_judges_generated_partial_bridge_yamls_as_validate_does():
    _check(_judge("megatron-core==0.16.1", "0.16.1"))


@needs_019
def test_the_target_release_judges_generated_partial_bridge_yamls_as_validate_does():
    _check(_judge("megatron-core==0.19.2", "0.19.2"))


def test_on_the_fallback_release_no_generated_partial_yaml_gets_the_pipeline_dtype_error():
    # The target 0.19.2's payload (its Bridge's finalize()) judged by the release that runs when 0.19.2 is absent.
    for case, report, answer in _judge("megatron-core==0.19.2", "0.16.1"):
        messages = [e["message"] for e in answer["errors"]]
        assert PIPELINE_DTYPE_ERROR not in messages, case
        assert bool(messages) or report.ok, (case, messages, [f.rule for f in report.errors])


def test_without_the_frontends_fill_megatron_core_would_refuse_the_issues_yaml():
    # The check above can fail: the same sections with pipeline_dtype removed are refused by megatron-core itself.
    issues = [_ours(c, "megatron-core==0.16.1") for c in CASES if c["pp"] > 1 and c["dtype"] is None]
    bodies = [body for report, body in issues if report.ok]
    # One megatron-core itself accepts as filled (the catalogue no longer restates its other checks).
    answers = run_children(bodies, "megatron-core==0.16.1")
    body = next(body for body, answer in zip(bodies, answers, strict=True) if not answer["errors"])
    assert body["model"]["pipeline_dtype"] is not None
    body["model"].pop("pipeline_dtype")
    (answer,) = run_children([body], "megatron-core==0.16.1")
    assert PIPELINE_DTYPE_ERROR in [e["message"] for e in answer["errors"]]


@pytest.mark.parametrize("target", [pytest.param("0.19.2", marks=needs_019), "0.16.1"])
def test_validate_exact_cli_on_the_issues_partial_yaml_and_command_line(tmp_path, target):
    path = tmp_path / "my_run.yaml"
    path.write_text("model:\n  num_layers: 4\n  hidden_size: 64\n  num_attention_heads: 4\n"
                    "  pipeline_model_parallel_size: 2\n")  # fmt: skip
    argv = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --pipeline-model-parallel-size 2 --bf16"
    flags = ["--exact", "--json", "--target", f"megatron-core=={target}"]
    for how in ([str(path)], ["--megatron-args", argv]):
        proc = subprocess.run(
            [sys.executable, "-m", "mbridge_offload_tools.cli.main", "validate", *how, *flags],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        answer = json.loads(proc.stdout)
        assert proc.returncode == 0 and answer["ok"], answer["findings"]
        assert answer["env"]["exact_megatron_core"] == target
