"""The pydantic config model: upstream defaults, extras kept, dtype spellings, did-you-mean helper."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mbridge_offload.config.schema import (
    OFFLOAD_KEYS,
    OffloadConfig,
    effective_values,
    field_default,
    normalize_dtype,
    suggest_key,
    unknown_offload_keys,
)


def test_defaults_are_the_upstream_dataclass_defaults():
    # MCore model_parallel_config.py / transformer_config.py / optimizer_config.py
    expected = {
        "model.cpu_offloading": False,
        "model.cpu_offloading_num_layers": 0,
        "model.cpu_offloading_activations": True,
        "model.cpu_offloading_weights": False,
        "model.cpu_offloading_double_buffering": False,
        "model.cpu_offloading_retain_pinned_cpu_buffers": False,
        "model.fine_grained_activation_offloading": False,
        "model.offload_modules": [],
        "model.min_offloaded_tensor_size": 1024 * 1024,
        "model.activation_offload_fraction": 1.0,
        "optimizer.optimizer_cpu_offload": False,
        "optimizer.optimizer_offload_fraction": 0.0,
        "optimizer.use_torch_optimizer_for_cpu_offload": False,
        "optimizer.overlap_cpu_optimizer_d2h_h2d": False,
        "optimizer.pin_cpu_grads": True,
        "optimizer.pin_cpu_params": True,
        "optimizer.decoupled_weight_decay": True,
        "optimizer.use_distributed_optimizer": False,
        "model.cuda_graph_impl": "none",
        "model.transformer_impl": "transformer_engine",
    }
    for key, value in expected.items():
        assert field_default(key) == value, key
    assert effective_values(OffloadConfig())["optimizer.optimizer_offload_fraction"] == 0.0


@pytest.mark.megatron
@pytest.mark.filterwarnings("ignore")
def test_defaults_match_real_megatron_core():
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    real = {f"model.{f.name}": f for f in dataclasses.fields(TransformerConfig)}
    real |= {f"optimizer.{f.name}": f for f in dataclasses.fields(OptimizerConfig)}
    for key in OFFLOAD_KEYS:
        if key not in real:  # 0.19-only fields are absent from the venv's 0.16.1
            continue
        f = real[key]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert field_default(key) == default, key


def test_unknown_keys_and_targets_are_kept_not_errors():
    cfg = OffloadConfig.model_validate(
        {"model": {"_target_": "x.Provider", "rotary_base": 10000}, "checkpoint": {"save": "/tmp"}}
    )
    assert cfg.model.extras()["rotary_base"] == 10000
    assert cfg.model_extra["checkpoint"] == {"save": "/tmp"}


def test_wrong_type_outside_megatron_core_sections_is_a_validation_error():
    with pytest.raises(ValidationError):
        OffloadConfig.model_validate({"train": {"micro_batch_size": "one"}})


@pytest.mark.parametrize(
    "section,key,value,default",
    [
        ("optimizer", "optimizer_offload_fraction", "half", 0.0),
        ("optimizer", "clip_grad", [1.0], 1.0),
        ("model", "tensor_model_parallel_size", None, 1),
        ("model", "context_parallel_size", 1.5, 1),
        ("model", "expert_model_parallel_size", 0, 1),  # below its ge=1 bound: megatron-core's to judge too
        ("ddp", "overlap_grad_reduce", "no", True),  # a flag: read by truthiness, as megatron-core reads it
    ],
)
def test_wrong_type_in_a_megatron_core_section_is_kept_as_written(section, key, value, default):
    # megatron-core's dataclasses convert nothing and check a type only where they compare the value: the typed
    # field keeps its default (a flag: the value's truthiness) and the raw config keeps the value for the rules.
    raw = {section: {key: value}}
    cfg = OffloadConfig.model_validate(raw)
    assert getattr(getattr(cfg, section), key) == default
    assert raw[section][key] == value


@pytest.mark.parametrize(
    "spelling,short",
    [
        ("bf16", "bf16"),
        ("torch.bfloat16", "bf16"),
        ("float32", "fp32"),
        ({"_target_": "torch.float16"}, "fp16"),
        (None, None),
    ],
)
def test_dtype_spellings_normalise(spelling, short):
    assert normalize_dtype(spelling) == short


def test_bad_dtype_names_the_value():
    with pytest.raises(ValueError, match="'int7'"):
        normalize_dtype("int7")


def test_null_spellings_of_recompute_are_strings_as_megatron_core_sees_them():
    # megatron-core raises for the strings "none"/"null" ('When using recompute_granuarlity: none must be ...');
    # only YAML's null switches recomputation off. No coercion, so validate's megatron-core run refuses them as is.
    for text in ("null", "None", "none"):
        cfg = OffloadConfig.model_validate({"model": {"num_layers": 4, "recompute_granularity": text}})
        assert cfg.model.recompute_granularity == text
    assert OffloadConfig.model_validate({"model": {"recompute_granularity": None}}).model.recompute_granularity is None


def test_string_flags_are_truthy_as_in_megatron_core():
    from mbridge_offload.config.validate import validate

    raw = {"model": {"num_layers": 4, "cpu_offloading": "false", "cpu_offloading_num_layers": 1}}
    cfg = OffloadConfig.model_validate(raw)
    assert cfg.model.cpu_offloading is True
    report = validate(cfg, raw)
    assert [f.rule for f in report.findings if f.rule == "CFG-STRING-FLAG"] == ["CFG-STRING-FLAG"]
    assert report.by_rule("CFG-STRING-FLAG")[0].fix == ["model.cpu_offloading=true"]


def test_did_you_mean_for_offload_typos_only():
    assert suggest_key("optimizer", "optimizer_offload_fracton") == "optimizer.optimizer_offload_fraction"
    assert suggest_key("model", "cpu_offload") == "model.cpu_offloading"
    assert suggest_key("model", "rotary_base") is None
    raw = {"model": {"cpu_ofloading": True, "rotary_base": 1}, "optimizer": {"lr": 1e-3}}
    assert unknown_offload_keys(raw) == [("model.cpu_ofloading", "model.cpu_offloading")]


def test_the_guide_states_the_model_defaults():
    import json
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "cpu-offloading.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `((?:model|optimizer)\.\w+)` \| `([^`]*)` \|", text, flags=re.M)
    assert len(rows) >= 12
    for key, shown in rows:
        assert json.loads(shown) == field_default(key), key
