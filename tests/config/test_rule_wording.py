"""Every rule of the catalogue, rendered as the CLI renders it, reads as a sentence: no ``None`` where a value
belongs, no empty list written out, no doubled or dangling punctuation, no unfilled ``{placeholder}``, and a fix
(when there is one) that is a list of real overrides.

The findings come from real configs: the differential generator's seeded corpus (the same generator that checks
us against megatron-core), plus one hand-written trigger for each rule the corpus does not reach. Two rules sit
behind an earlier upstream check (validate stops at the first stage that fails), so they are rendered from their
own check on a config that reaches them. A test asserts that every rule of the catalogue was rendered.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from mbridge_offload.config.rules.base import Context, parse_target
from mbridge_offload.config.rules.catalogue import all_rules
from mbridge_offload.config.sources import build_config, load
from mbridge_offload.config.validate import Finding, Report, _finding, validate
from mbridge_offload_tools.cli.validate import render_human
from tests.support import config_gen

TARGETS = ("megatron-core==0.19.2", "megatron-core==0.16.1", "main")
CORPUS_SIZE = 2000  # the generator spreads over many perturbations since the widened differential

# rule id -> (yaml | argv, the config or the command line, target): inputs that fire the rules the seeded corpus does
# not reach.
_PROVIDER = "megatron.bridge.models.gpt_provider.GPTModelProvider"
TRIGGERS: dict[str, tuple[str, Any, str]] = {
    "MC-PP-POSITIVE": (
        "yaml",
        {"model": {"num_layers": 4, "pipeline_model_parallel_size": 0}},
        "megatron-core==0.19.2",
    ),
    "ACT-FG-DELTA-BYTES": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "fine_grained_activation_offloading": True,
                "offload_modules": ["core_attn"],
                "transformer_impl": "transformer_engine",
                "delta_offload_bytes_across_pp_ranks": -1,
            }
        },
        "megatron-core==0.19.2",
    ),
    "ACT-FG-MIN-TENSOR-SIZE": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "fine_grained_activation_offloading": True,
                "offload_modules": ["core_attn"],
                "transformer_impl": "transformer_engine",
                "min_offloaded_tensor_size": -1,
            }
        },
        "megatron-core==0.19.2",
    ),
    "ACT-FG-TE-IMPL": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "fine_grained_activation_offloading": True,
                "offload_modules": ["core_attn"],
                "transformer_impl": "local",
            }
        },
        "megatron-core==0.19.2",
    ),
    "ACT-MLM-FG-NVTE-V1": (
        "argv",
        "--num-layers 4 --fine-grained-activation-offloading --offload-modules core_attn "
        "--transformer-impl transformer_engine",
        "megatron-core==0.19.2",
    ),
    "ACT-MLM-FG-TE-IMPL": (
        "argv",
        "--num-layers 4 --fine-grained-activation-offloading --offload-modules core_attn --transformer-impl local",
        "megatron-core==0.19.2",
    ),
    "CFG-BRIDGE-FINALIZE": (
        "yaml",
        {
            "_target_": "megatron.bridge.training.config.ConfigContainer",
            "model": {
                "_target_": "megatron.bridge.models.gpt_provider.GPTModelProvider",
                "num_layers": 8,
                "tensor_model_parallel_size": 1,
                "sequence_parallel": True,
            },
        },
        "megatron-core==0.19.2",
    ),
    "CFG-EMPTY": ("yaml", {}, "megatron-core==0.19.2"),
    "ACT-HYBRID-LAYER-OFFLOAD": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "hybrid_layer_pattern": "M*M-",
                "cpu_offloading": True,
                "cpu_offloading_num_layers": 1,
            }
        },
        "megatron-core==0.19.2",
    ),
    "ACT-HYBRID-FINE-GRAINED": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "hybrid_override_pattern": "M*M-",
                "fine_grained_activation_offloading": True,
                "offload_modules": ["core_attn"],
                "transformer_impl": "transformer_engine",
            }
        },
        "megatron-core==0.16.1",
    ),
    "ACT-HYBRID-FULL-RECOMPUTE": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "hybrid_override_pattern": "M*M-",
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 1,
            }
        },
        "megatron-core==0.16.1",
    ),
    "MC-MTP-RECOMPUTE-LAYERS": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "mtp_num_layers": 1,
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 2,
            }
        },
        "megatron-core==0.19.2",
    ),
    "ACT-MTP-RECOMPUTE-BLOCK": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "mtp_num_layers": 1,
                "recompute_granularity": "full",
                "recompute_method": "block",
                "recompute_num_layers": 2,
            }
        },
        "megatron-core==0.19.2",
    ),
    "CFG-UNKNOWN-ARGUMENT": ("argv", "--num-layers 4 --optimizer-cpu-ofload", "megatron-core==0.19.2"),
    "CFG-UNKNOWN-KEY": ("yaml", {"model": {"num_layers": 4, "cpu_ofloading": True}}, "megatron-core==0.19.2"),
    "CFG-MLM-EP-WITHOUT-EXPERTS": ("argv", "--num-layers 4 --expert-model-parallel-size 2", "megatron-core==0.19.2"),
    "CFG-MLM-EP-EXPERTS-DIVISIBLE": (
        "argv",
        "--num-layers 4 --num-experts 6 --expert-model-parallel-size 4 --disable-bias-linear",
        "megatron-core==0.19.2",
    ),
    "CFG-MLM-MOE-LATENT-SIZE": ("argv", "--num-layers 4 --moe-latent-size 16", "megatron-core==0.19.2"),
    "ACT-RECOMPUTE-MODULE-NO-EFFECT": (
        "yaml",
        {"model": {"num_layers": 4, "recompute_granularity": "selective", "recompute_modules": ["moe"]}},
        "megatron-core==0.19.2",
    ),
    **{
        rule: ("yaml", {"model": {"_target_": _PROVIDER, "num_layers": 4, **model}, **rest}, "megatron-core==0.19.2")
        for rule, model, rest in (
            (
                "CFG-BRIDGE-MXFP8-REUSE-GRAD-BUF",
                {},
                {"mixed_precision": {"bf16": True, "fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param_gather": True}},
            ),
            ("CFG-BRIDGE-DETERMINISTIC-CE-FUSION", {"deterministic_mode": True, "cross_entropy_loss_fusion": True}, {}),
            ("CFG-BRIDGE-DIST-OPT-SYNC", {}, {"ddp": {"use_distributed_optimizer": True}}),
            ("CFG-BRIDGE-OVERLAP-PARAM-GATHER-SYNC", {}, {"optimizer": {"overlap_param_gather": True}}),
            ("CFG-BRIDGE-MODEL-BF16-FP16", {"bf16": True, "fp16": True}, {}),
            ("CFG-BRIDGE-OPTIMIZER-BF16-FP16", {}, {"optimizer": {"bf16": True, "fp16": True}}),
            (
                "CFG-BRIDGE-PRECISION-AWARE-DTYPE",
                {"bf16": True},
                {
                    "optimizer": {"use_precision_aware_optimizer": True, "use_distributed_optimizer": True},
                    "ddp": {"use_distributed_optimizer": True},
                },
            ),
            ("CFG-BRIDGE-FULL-ITERATION-NAN-CHECK", {"cuda_graph_impl": "full_iteration"}, {}),
            ("CFG-BRIDGE-CP-SEQ-LENGTH", {"context_parallel_size": 2, "seq_length": 4098}, {}),
            ("CFG-BRIDGE-SEQ-LENGTH-MATCH", {"seq_length": 4096}, {"dataset": {"seq_length": 2048}}),
        )
    },
    "MC-FG-CUDA-GRAPH-IMPL": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "num_moe_experts": 8,
                "fine_grained_activation_offloading": True,
                "offload_modules": ["expert_fc1"],
                "transformer_impl": "transformer_engine",
                "cuda_graph_impl": "local",
                "cuda_graph_modules": ["moe"],
            }
        },
        "megatron-core==0.19.2",
    ),
    "MC-FG-CUDA-GRAPH-INFLIGHT": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "fine_grained_activation_offloading": True,
                "offload_modules": ["core_attn"],
                "transformer_impl": "transformer_engine",
                "cuda_graph_impl": "full_iteration",
                "cuda_graph_warmup_steps": 3,
            }
        },
        "megatron-core==0.19.2",
    ),
    "MC-FG-CUDA-GRAPH-LOCAL-WHOLE-LAYER": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "fine_grained_activation_offloading": True,
                "offload_modules": ["expert_fc1"],
                "transformer_impl": "transformer_engine",
                "num_moe_experts": 8,
                "cuda_graph_impl": "local",
            }
        },
        "megatron-core==0.19.2",
    ),
    "MC-FG-CUDA-GRAPH-WARMUP": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "fine_grained_activation_offloading": True,
                "offload_modules": ["core_attn"],
                "transformer_impl": "transformer_engine",
                "cuda_graph_impl": "transformer_engine",
                "cuda_graph_warmup_steps": 0,
            }
        },
        "megatron-core==0.19.2",
    ),
    "MC-FG-FUSED-GROUP-MLP-PARTIAL": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "num_moe_experts": 8,
                "moe_grouped_gemm": True,
                "use_transformer_engine_op_fuser": True,
                "fine_grained_activation_offloading": True,
                "offload_modules": ["fused_group_mlp", "expert_fc1"],
                "transformer_impl": "transformer_engine",
            }
        },
        "megatron-core==0.19.2",
    ),
    "MC-FG-MOE-RECOMPUTE": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "num_moe_experts": 8,
                "fine_grained_activation_offloading": True,
                "offload_modules": ["expert_fc1", "moe_act"],
                "recompute_granularity": "selective",
                "recompute_modules": ["moe"],
                "transformer_impl": "transformer_engine",
            }
        },
        "megatron-core==0.19.2",
    ),
    "MC-PAGED-STASH-MODULES": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "num_moe_experts": 8,
                "moe_paged_stash": True,
                "moe_expert_rank_capacity_factor": 1.5,
                "moe_flex_dispatcher_backend": "hybridep",
                "moe_token_dispatcher_type": "flex",
                "use_transformer_engine_op_fuser": True,
                "fine_grained_activation_offloading": True,
                "offload_modules": ["core_attn", "expert_fc1"],
                "transformer_impl": "transformer_engine",
            }
        },
        "megatron-core==0.19.2",
    ),
    "MC-RECOMPUTE-DISTRIBUTE-SP": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "tensor_model_parallel_size": 2,
                "sequence_parallel": True,
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 1,
                "distribute_saved_activations": True,
            }
        },
        "megatron-core==0.19.2",
    ),
    "OPT-BRIDGE-MFSDP-V2": (
        "yaml",
        {
            "optimizer": {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5},
            "ddp": {"use_megatron_fsdp": True, "megatron_fsdp_version": 2},
        },
        "main",
    ),
    "OPT-MFSDP-V2": (
        "yaml",
        {
            "optimizer": {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5},
            "ddp": {"use_megatron_fsdp": True, "megatron_fsdp_version": 2},
        },
        "main",
    ),
    "OPT-MLM-FP8-PARAM-GATHER": (
        "argv",
        "--num-layers 4 --optimizer-cpu-offload --use-precision-aware-optimizer "
        "--fp8-param-gather --fp8-format hybrid --fp8-recipe tensorwise",
        "megatron-core==0.19.2",
    ),
    "OPT-MLM-PRECISION-AWARE": (
        "argv",
        "--num-layers 4 --optimizer-cpu-offload --optimizer-offload-fraction 0.5",
        "megatron-core==0.19.2",
    ),
    "OPT-NON-ADAM": (
        "yaml",
        {
            "optimizer": {
                "optimizer": "muon",
                "optimizer_cpu_offload": True,
                "optimizer_offload_fraction": 0.5,
                "use_distributed_optimizer": True,
            }
        },
        "megatron-core==0.19.2",
    ),
    "OPT-TORCH-OPTIMIZER": (
        "yaml",
        {
            "optimizer": {
                "optimizer_cpu_offload": True,
                "optimizer_offload_fraction": 0.5,
                "use_torch_optimizer_for_cpu_offload": True,
            }
        },
        "megatron-core==0.19.2",
    ),
    "MC-RECOMPUTE-SHARED-EXPERTS-OVERLAP": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "num_moe_experts": 4,
                "add_bias_linear": False,
                "moe_shared_expert_intermediate_size": 64,
                "moe_shared_expert_overlap": True,
                "moe_token_dispatcher_type": "alltoall",
                "recompute_granularity": "selective",
                "recompute_modules": ["shared_experts"],
            }
        },
        "megatron-core==0.19.2",
    ),
    "MC-RECOMPUTE-FP8-DELAYED": (
        "yaml",
        {
            "model": {
                "num_layers": 4,
                "fp8": "hybrid",
                "recompute_granularity": "selective",
                "recompute_modules": ["layernorm"],
            }
        },
        "megatron-core==0.19.2",
    ),
}


# Rules that an earlier upstream check always hides from validate (it stops at the first failing stage): the
# config that reaches each one's own check.
HIDDEN: dict[str, str] = {
    "ACT-TE-ALL-LAYERS": "model:\n  num_layers: 4\n  cpu_offloading: true\n  cpu_offloading_num_layers: 4\n",
    "ACT-BRIDGE-CUDAGRAPH-ASSERT": (
        "model:\n  num_layers: 4\n  cpu_offloading: true\n  cpu_offloading_num_layers: 1\n  enable_cuda_graph: true\n"
    ),
}

_GARBLED = (
    (re.compile(r"\bNone\b"), "None where a value belongs"),
    (re.compile(r"\[\]|\bset\(\)|\{\}"), "an empty list or set written out"),
    (re.compile(r"\s[;,:.](?!\d)"), "punctuation after a space (' ;', ' ,')"),
    (re.compile(r"[;,:]\s*[;,.]|(?<!\.)\.\.(?!\.)"), "doubled punctuation ('..', ', ;')"),
    (re.compile(r"\{[A-Za-z_][A-Za-z_0-9]*(![rsa])?(:[^}]*)?\}"), "an unfilled {placeholder}"),
    (re.compile(r"\b(is|are|has|have|of|to|with|and|or)\s*[;,.:]"), "a sentence that stops after a linking word"),
)
# Upstream's own texts, verbatim (the validator quotes them): where they say None, that is megatron-core's wording.
_UPSTREAM_NONE = re.compile(r"must be None|is None|be None\.")


def _load(kind: str, given: Any, tmp: Path):
    if kind == "argv":
        return load(None, [], argv=shlex.split(given))
    path = tmp / "trigger.yaml"
    path.write_text(given if isinstance(given, str) else yaml.safe_dump(given), encoding="utf-8")
    return load(str(path))


def _corpus_findings() -> list[Finding]:
    out = []
    for case in config_gen.generate(20260601, CORPUS_SIZE):
        raw = config_gen.raw_config(case)
        try:
            cfg = build_config(raw)
        except (ValueError, TypeError):  # the generator's type variants that pydantic refuses (bad input)
            continue
        for target in TARGETS:
            out += validate(cfg, raw, target=parse_target(target)).findings
    return out


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[tuple[Finding, str]]]:
    """rule id -> [(finding, the CLI's human rendering of it)], over the corpus, the triggers and the hidden rules."""
    tmp = tmp_path_factory.mktemp("triggers")
    findings = _corpus_findings()
    for kind, text, target in TRIGGERS.values():
        loaded = _load(kind, text, tmp)
        findings += validate(loaded.config, loaded.raw, target=parse_target(target)).findings
    rules = {r.id: r for r in all_rules()}
    for rule_id, text in HIDDEN.items():
        loaded = _load("yaml", text, tmp)
        ctx = Context(config=loaded.config, raw=loaded.raw, target=parse_target("megatron-core==0.19.2"))
        findings += [_finding(rules[rule_id], match) for match in rules[rule_id].run(ctx)]
    out: dict[str, list[tuple[Finding, str]]] = {}
    for f in findings:
        report = Report(findings=[f], config={}, target="megatron-core==0.19.2", env={})
        out.setdefault(f.rule, []).append((f, render_human(report.to_dict())))
    return out


def test_every_rule_of_the_catalogue_is_rendered(rendered) -> None:
    missing = sorted({r.id for r in all_rules()} - set(rendered))
    assert not missing, f"no config renders {missing}: add a trigger"


def test_every_rendered_message_and_fix_reads_as_a_sentence(rendered) -> None:
    problems = []
    for rule_id, hits in rendered.items():
        for finding, text in {(f.message, t): (f, t) for f, t in hits}.values():
            body = "\n".join(line for line in text.splitlines()[1:] if not line.startswith(("OK", "FAILED")))
            if finding.upstream_message:  # upstream's text is quoted verbatim; check only our own parts
                body = body.replace(finding.upstream_message, "<upstream>")
            body = re.sub(r"`[^`]*`", "<code>", body)  # code spans quote code: `is not None`, `(..)*n`
            body = _UPSTREAM_NONE.sub("<upstream>", body)
            for pattern, what in _GARBLED:
                if hit := pattern.search(body):
                    problems.append(f"{rule_id}: {what}: ...{body[max(0, hit.start() - 40) : hit.end() + 40]!r}")
    assert not problems, "\n".join(problems[:20])


def test_every_fix_is_a_list_of_overrides_never_an_empty_or_null_text(rendered) -> None:
    for rule_id, hits in rendered.items():
        for finding, text in hits:
            if finding.fix is None:
                assert "fix:" not in text, rule_id  # no fix: no fix line (not "fix: None")
                continue
            assert finding.fix, f"{rule_id}: an empty fix list; give None or a fix"
            for override in finding.fix:
                if override.startswith("~"):  # Hydra's deletion of a key: ~section.key
                    assert re.fullmatch(r"~[\w.]+", override), f"{rule_id}: {override!r}"
                    continue
                key, sep, value = override.partition("=")
                assert sep and key.strip() and value.strip(), f"{rule_id}: {override!r}"
                assert value not in ("None", "[]", "{}", "set()"), f"{rule_id}: {override!r}"
            assert "fix:  " + " ".join(finding.fix) in text


@pytest.mark.parametrize("rule_id", ["MC-FG-MOE-RECOMPUTE", "MC-FG-FUSED-GROUP-MLP-PARTIAL", "MC-PAGED-STASH-MODULES"])
def test_the_remove_this_rules_give_a_fix_that_drops_the_conflicting_modules(rendered, rule_id: str) -> None:
    for finding, _text in rendered[rule_id]:
        # The validator withdraws a fix that does not clear its own rule, so a fix here is a checked one.
        assert finding.fix, f"{rule_id}: the message says what to remove; the fix must do it"
        conflicting = set(re.findall(r"'(\w+)'", finding.message.split("Remove:")[-1])) - {"moe"}
        for override in finding.fix:
            if override.startswith("model.offload_modules="):
                assert not conflicting & set(re.findall(r"\w+", override.split("=", 1)[1])), override


@pytest.mark.parametrize(
    "garbled",
    [
        "the config as given has ; it fits without",
        "keys: model.x fix: None",
        "offload_modules is [] here",
        "Cannot offload {inside} while recomputing",
        "set it to 2.. then rerun",
        "the layers , and the rest",
    ],
)
def test_the_wording_checks_catch_what_they_are_for(garbled: str) -> None:
    assert any(pattern.search(garbled) for pattern, _what in _GARBLED), garbled
