"""A parallel size of 0 or below is an error in every tool: validate, estimate, recommend, apply and
diagnose, on the CLI and over MCP, name the key and the value; validate keeps the catalogue's finding exactly where
megatron-core's own dataclass refuses the value (checked against real megatron-core on generated cases)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from mcp import Client

from mbridge_offload.config import sources
from mbridge_offload.config.effective import resolve
from mbridge_offload.config.parallel_sizes import PARALLEL_SIZE_KEYS, ParallelSizeError, check, not_positive
from mbridge_offload.config.validate import validate
from mbridge_offload_tools.cli.main import main
from mbridge_offload_tools.server.app import mcp
from tests.support.differential import run_oracle, version_env

# The oracle builds TransformerConfig(num_layers=…, hidden_size=64, num_attention_heads=4, **model): the same sizes
# here, so our catalogue judges the same numbers.
BASE = {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 4}
PLANNABLE = (
    "model:\n  num_layers: 8\n  hidden_size: 1024\n  num_attention_heads: 8\n  vocab_size: 32000\n  seq_length: 2048\n"
)


def _cases(seed: int = 28) -> list[dict]:
    """Each key at 0, -1 and a random negative, alone and next to PP 2; then random pairs of sizes (``pair``)."""
    rng = random.Random(seed)
    out: list[tuple[str, dict]] = []
    names = [k.split(".", 1)[1] for k in PARALLEL_SIZE_KEYS]
    for name in names:
        for value in (0, -1, -rng.randint(2, 9)):
            out.append(("single", {name: value}))
            if name != "pipeline_model_parallel_size":
                out.append(("single", {name: value, "pipeline_model_parallel_size": 2}))
    for _ in range(20):
        a, b = rng.sample(names, 2)
        out.append(("pair", {a: rng.choice([0, -1, -2, -4]), b: rng.choice([1, 2, 0, -3])}))
    return [
        {"id": f"p{i}", "kind": kind, "model": {**BASE, "pipeline_dtype": "fp32", **m}, "optimizer": {}}
        for i, (kind, m) in enumerate(out)
    ]


def _ours(model: dict) -> tuple[str, set[str]]:
    """``("finding", keys)`` when validate answers with error findings, ``("input", keys named)`` when it refuses."""
    raw = {"model": dict(model)}
    try:
        report = validate(sources.build_config(raw), raw)
    except ParallelSizeError as exc:
        return "input", {k for k in PARALLEL_SIZE_KEYS if k in str(exc)}
    return "finding", {k for f in report.errors for k in f.keys}


@pytest.mark.megatron
@pytest.mark.parametrize("label", ["0.16.1", "0.19.2"])
def test_validate_keeps_the_finding_exactly_where_megatron_core_refuses_and_refuses_the_input_elsewhere(label):
    if version_env(label) is None:
        pytest.skip(f"megatron-core {label} not installed")
    cases = _cases()
    oracle = run_oracle(label, cases)
    for case, real in zip(cases, oracle["results"], strict=True):
        kind, named = _ours(case["model"])
        written = {k for k, _ in not_positive({"model": case["model"]})}
        refused = real["transformer"] is not None
        if case["kind"] == "pair":  # never accepted; an input error names only sizes that are written <= 0
            assert named and (kind == "finding" or named <= written), (case, kind, named)
        elif refused:  # the dataclass refuses this one size: validate answers with the catalogue's finding
            assert kind == "finding" and written <= named, (case, real)
        else:  # the dataclass accepts it; Bridge / initialize_model_parallel would fail later: bad input, named
            assert kind == "input" and named == written, (case, named)


def test_a_bool_is_a_wrong_type_for_the_catalogue_not_a_size() -> None:
    assert not_positive({"model": {"context_parallel_size": False, "tensor_model_parallel_size": True}}) == []
    check({"model": {"virtual_pipeline_model_parallel_size": None, "expert_tensor_parallel_size": None}})


def test_the_effective_config_shows_the_value_as_written_not_the_default() -> None:
    raw = {"model": {**BASE, "tensor_model_parallel_size": 0, "context_parallel_size": -2}}
    eff = resolve(sources.build_config(raw), raw)
    assert eff.values["model.tensor_model_parallel_size"].model_dump() == {"value": 0, "source": "config"}
    assert eff.values["model.context_parallel_size"].value == -2


# ---------------------------------------------------------------------------------------------- every tool, CLI


def _cli(capsys, *argv: str) -> tuple[int, dict]:
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--json"])
    return int(stop.value.code or 0), json.loads(capsys.readouterr().out)


@pytest.fixture
def bad(tmp_path: Path):
    def write(key: str, value: int) -> Path:
        path = tmp_path / f"{key}_{value}.yaml".replace("-", "m")
        path.write_text(PLANNABLE + f"  {key}: {value}\n")
        return path

    return write


SIZES = [
    ("tensor_model_parallel_size", 0),
    ("tensor_model_parallel_size", -2),
    ("pipeline_model_parallel_size", 0),
    ("context_parallel_size", 0),
    ("expert_model_parallel_size", -1),
    ("expert_tensor_parallel_size", 0),
    ("virtual_pipeline_model_parallel_size", 0),
]


@pytest.mark.parametrize("key,value", SIZES)
def test_every_planning_and_writing_tool_exits_2_naming_the_key_and_value(capsys, bad, key, value):
    path = str(bad(key, value))
    for where, argv in (
        ("config", ("estimate", path)),
        ("config", ("recommend", path)),
        ("config", ("apply", path, "--mode", "optimizer", "--fraction", "0.5")),
        ("config", ("apply", path, "--mode", "recommended")),
        ("config", ("diagnose", "--config", path, "--error", "CUDA out of memory")),
        ("before", ("diagnose", "--before", path, "--after", path)),
    ):
        code, answer = _cli(capsys, *argv)
        named = f"model.{key} = {value} ({where})"
        assert code == 2 and answer["ok"] is False and named in answer["error"], (argv, answer)
        assert "at least 1" in answer["error"] or ">= 1" in answer["error"]


@pytest.mark.parametrize("key,value", SIZES)
def test_validate_exits_2_unless_megatron_cores_dataclass_refuses_it_itself(capsys, bad, key, value):
    code, answer = _cli(capsys, "validate", str(bad(key, value)))
    # TP 0 divides by zero in num_attention_heads % TP (MC-HEADS-TP), PP <= 0 trips MC-PP-POSITIVE: the finding.
    if (key, value) in (("tensor_model_parallel_size", 0), ("pipeline_model_parallel_size", 0)):
        assert code == 1 and any(f"model.{key}" in f["keys"] for f in answer["findings"])
        assert answer["effective"][f"model.{key}"]["value"] == value
    else:
        assert code == 2 and f"model.{key} = {value} (config)" in answer["error"]


def test_a_megatron_lm_command_line_names_the_flag(capsys) -> None:
    argv = "--num-layers 8 --hidden-size 1024 --num-attention-heads 8 --seq-length 2048 --max-position-embeddings 2048"
    for command in ("validate", "estimate"):
        extra = ["--vocab-size", "32000"] if command == "estimate" else []
        line = " ".join([argv, *extra, "--context-parallel-size", "0"])
        code, answer = _cli(capsys, command, "--megatron-args", line)
        assert code == 2 and "--context-parallel-size 0 (argv)" in answer["error"]


def test_a_flag_of_0_is_refused_by_the_flags_own_bound(capsys) -> None:
    code, answer = _cli(capsys, "estimate", "--model", "llama3-8b", "--cp", "0")
    assert code == 2 and "--cp = 0 (flag)" in answer["error"]


# ---------------------------------------------------------------------------------------------- every tool, MCP


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_every_mcp_tool_raises_a_tool_error_naming_the_key_and_value(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "run.yaml"
    path.write_text(PLANNABLE + "  context_parallel_size: 0\n")
    calls = {
        "validate_config": {"config": str(path)},
        "estimate_memory": {"config": str(path)},
        "recommend_mode": {"config": str(path)},
        "apply_offload": {"config": str(path), "mode": "optimizer", "fraction": 0.5},
        "diagnose_failure": {"config": str(path), "error": "CUDA out of memory"},
    }
    async with Client(mcp, raise_exceptions=True) as client:
        for tool, args in calls.items():
            result = await client.call_tool(tool, args)
            assert result.is_error, tool
            assert "model.context_parallel_size = 0 (config)" in result.content[0].text, tool
        inline = await client.call_tool("estimate_memory", {"config": PLANNABLE + "  tensor_model_parallel_size: -4\n"})
        assert inline.is_error and "model.tensor_model_parallel_size = -4" in inline.content[0].text
        ok = await client.call_tool("estimate_memory", {"config": PLANNABLE})
        assert not ok.is_error
