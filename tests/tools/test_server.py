"""mbridge_offload_tools.server.app through the in-memory MCP client: schemas, annotations, structured content, errors,
progress."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from mcp import Client

from mbridge_offload.actions.testing.run import DEPTH_ENV
from mbridge_offload_tools.server.app import mcp

TOOLS = {
    "validate_config",
    "estimate_memory",
    "recommend_mode",
    "apply_offload",
    "run_unit_tests",
    "diagnose_failure",
    "plot_offload",
    "trace_memory",
}

CONFIG = """\
# Small dense model, one node.
model:
  num_layers: 16  # decoder layers
  hidden_size: 2048
  num_attention_heads: 16
  vocab_size: 32000
  seq_length: 4096
  pipeline_model_parallel_size: 2
optimizer:
  optimizer: adam
  lr: 0.0003
  use_distributed_optimizer: true
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def client():
    async with Client(mcp, raise_exceptions=True) as c:
        yield c


@pytest.fixture
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG, encoding="utf-8")
    return path


@pytest.mark.anyio
async def test_lists_the_tools_with_titles_schemas_and_annotations(client) -> None:
    tools = {t.name: t for t in (await client.list_tools()).tools}
    assert set(tools) == TOOLS
    for tool in tools.values():
        assert tool.title and tool.description
        assert tool.input_schema["type"] == "object"
        assert tool.output_schema and tool.output_schema["type"] == "object"
        assert tool.annotations.open_world_hint is (tool.name == "run_unit_tests")
    for name in ("validate_config", "recommend_mode", "diagnose_failure"):
        assert tools[name].annotations.read_only_hint is True
    apply = tools["apply_offload"].annotations
    assert (apply.read_only_hint, apply.destructive_hint, apply.idempotent_hint) == (False, True, False)
    plot = tools["plot_offload"].annotations  # writes a file only when asked, and may replace one: as apply
    assert (plot.read_only_hint, plot.destructive_hint, plot.idempotent_hint) == (False, True, False)
    assert tools["run_unit_tests"].annotations.read_only_hint is False  # it runs code
    assert "allowed_root" not in tools["apply_offload"].input_schema["properties"]
    assert tools["apply_offload"].input_schema["properties"]["mode"]["enum"] == [
        "optimizer",
        "activation",
        "both",
        "none",
        "recommended",
        "fine-grained",
    ]
    assert "findings" in tools["validate_config"].output_schema["properties"]


@pytest.mark.anyio
async def test_validate_config_returns_structured_findings(client, config_file: Path) -> None:
    result = await client.call_tool(
        "validate_config",
        {"config": str(config_file), "overrides": ["model.cpu_offloading=true", "model.cpu_offloading_num_layers=2"]},
    )
    assert not result.is_error
    data = result.structured_content
    assert data["ok"] is False
    pp = next(f for f in data["findings"] if f["rule"] == "ACT-PP")
    assert pp["message"] == "Currently there is no support for Pipeline parallelism with CPU offloading"
    assert data["config"]["model.pipeline_model_parallel_size"] == 2


@pytest.mark.anyio
async def test_validate_config_takes_a_megatron_lm_command_line_and_answers_in_flags(client) -> None:
    argv = "--num-layers 4 --cpu-offloading-num-layers 4 --recompute-activations"
    result = await client.call_tool("validate_config", {"megatron_args": argv})
    assert not result.is_error, result.content
    data = result.structured_content
    assert data["source"] == "<argv>" and data["fix_notation"] == "megatron-lm"
    by_rule = {f["rule"]: f for f in data["findings"]}
    assert by_rule["ACT-NUM-LAYERS"]["fix"] == ["--cpu-offloading-num-layers 2"]
    assert by_rule["ACT-RECOMPUTE"]["fix_remove"] == ["--recompute-granularity", "--recompute-activations"]
    both = await client.call_tool("validate_config", {"megatron_args": argv, "config": "model: {}"})
    assert both.is_error and "exactly one of config" in both.content[0].text
    quote = await client.call_tool("validate_config", {"megatron_args": "--num-layers '4"})
    assert quote.is_error and "megatron_args" in quote.content[0].text


@pytest.mark.anyio
async def test_inline_yaml_is_accepted(client) -> None:
    result = await client.call_tool("validate_config", {"config": "optimizer:\n  optimizer_cpu_offload: true\n"})
    assert not result.is_error
    assert result.structured_content["config"]["optimizer.optimizer_offload_fraction"] == 0.0


@pytest.mark.anyio
async def test_bad_inputs_are_tool_errors_and_the_server_keeps_answering(client, config_file: Path) -> None:
    bad = await client.call_tool("validate_config", {"config": "model:\n  num_layers: [16\n"})
    assert bad.is_error and "malformed YAML" in bad.content[0].text
    missing = await client.call_tool("validate_config", {"config": "no/such/file.yaml"})
    assert missing.is_error and "no such file" in missing.content[0].text
    override = await client.call_tool("validate_config", {"config": str(config_file), "overrides": ["model.="]})
    assert override.is_error and "override" in override.content[0].text
    pp = await client.call_tool("apply_offload", {"config": str(config_file), "mode": "activation"})
    assert pp.is_error and "pipeline_model_parallel_size=1, but it is 2" in pp.content[0].text
    schema = await client.call_tool("apply_offload", {"config": str(config_file), "mode": "optimizer", "fraction": 2})
    assert schema.is_error and "fraction" in schema.content[0].text
    gpu = await client.call_tool("apply_offload", {"config": str(config_file), "mode": "recommended", "gpu": "tpu-v9"})
    assert gpu.is_error and "tpu-v9" in gpu.content[0].text
    nothing = await client.call_tool("diagnose_failure", {})
    assert nothing.is_error and "nothing to diagnose" in nothing.content[0].text
    model = await client.call_tool("recommend_mode", {"model": "gpt-9"})
    assert model.is_error and "unknown model preset" in model.content[0].text
    unsafe = await client.call_tool("run_unit_tests", {"k": "apply; rm -rf ~"})
    assert unsafe.is_error and "';'" in unsafe.content[0].text
    outside = await client.call_tool("run_unit_tests", {"path": "../etc/passwd"})
    assert outside.is_error and "outside this project's tests/" in outside.content[0].text
    repo = await client.call_tool("run_unit_tests", {"bridge_repo": str(config_file.parent)})
    assert repo.is_error and "may not run that checkout's tests" in repo.content[0].text
    ok = await client.call_tool("validate_config", {"config": str(config_file)})
    assert not ok.is_error and ok.structured_content["ok"] is True


@pytest.mark.anyio
async def test_recommend_mode_for_a_preset(client) -> None:
    result = await client.call_tool(
        "recommend_mode", {"model": "qwen3-30b-a3b", "gpu": "h100-80gb", "num_gpus": 16, "tp": 2, "pp": 2, "ep": 4}
    )
    assert not result.is_error
    data = result.structured_content
    assert data["mode"] in ("none", "optimizer", "activation", "both", "fine-grained", "fine-grained+optimizer")
    assert data["memory_gb"]["before"]["total"] > 0 and data["rationale"]


@pytest.mark.anyio
async def test_apply_offload_dry_run_then_write(client, config_file: Path) -> None:
    dry = await client.call_tool("apply_offload", {"config": str(config_file), "mode": "optimizer", "fraction": 0.75})
    assert not dry.is_error
    data = dry.structured_content
    assert data["written"] is None and data["ok"] is True
    assert "optimizer.optimizer_offload_fraction=0.75" in data["overrides"]
    assert "+  optimizer_offload_fraction: 0.75" in data["diff"]
    assert {c["key"] for c in data["changes"]} >= {"optimizer.optimizer_cpu_offload"}
    out = config_file.parent / "run_offload.yaml"
    wrote = await client.call_tool(
        "apply_offload", {"config": str(config_file), "mode": "optimizer", "fraction": 0.75, "output": str(out)}
    )
    assert wrote.structured_content["written"] == str(out)
    assert "num_layers: 16  # decoder layers" in out.read_text()
    planned = await client.call_tool(
        "apply_offload", {"config": str(config_file), "mode": "recommended", "gpu_memory_gb": 4, "num_gpus": 2}
    )
    assert not planned.is_error
    # PP 2 refuses layer-level activation offload; fine-grained offloading (+ optimizer offload) is the plan.
    assert planned.structured_content["mode"] in ("optimizer", "both", "fine-grained", "fine-grained+optimizer")
    assert any("planner chose" in n for n in planned.structured_content["notes"])


@pytest.mark.anyio
async def test_diagnose_failure_matches_and_compares(client, tmp_path: Path) -> None:
    result = await client.call_tool(
        "diagnose_failure", {"error": "ValueError: CUDA graphs not supported with CPU offloading."}
    )
    assert not result.is_error
    match = result.structured_content["matches"][0]
    assert match["failure"] == "cuda_graph_constraint" and match["fix"] == ["model.cuda_graph_impl=none"]
    before = tmp_path / "before.yaml"
    after = tmp_path / "after.yaml"
    before.write_text(CONFIG + "  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 1.0\n")
    after.write_text(CONFIG + "  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 0.5\n")
    compared = await client.call_tool(
        "diagnose_failure", {"before": str(before), "after": str(after), "error": "CUDA out of memory"}
    )
    comparison = compared.structured_content["comparison"]
    assert comparison["changed"][0]["key"] == "optimizer.optimizer_offload_fraction"
    assert comparison["memory_gb"]["delta_total"] > 0  # less offloaded → more GPU memory


@pytest.mark.anyio
@pytest.mark.skipif(int(os.environ.get(DEPTH_ENV, "0") or 0) > 0, reason="nested inside run_unit_tests")
async def test_run_unit_tests_reports_progress_and_results(client) -> None:
    events: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        events.append((progress, total, message))

    arguments = {"path": "tests/actions/test_diagnose.py", "k": "layer_range_fix or unknown_text", "timeout_s": 120}
    result = await client.call_tool("run_unit_tests", arguments, progress_callback=on_progress)
    assert not result.is_error
    data = result.structured_content
    assert (data["passed"], data["failed"], data["ok"]) == (2, 0, True)
    assert {t["nodeid"].split("::")[-1] for t in data["tests"]} == {
        "test_layer_range_fix_uses_the_number_in_the_message",
        "test_unknown_text_matches_nothing_and_says_so",
    }
    assert data["command"][:3] == [sys.executable, "-m", "pytest"]
    assert data["coverage"].startswith("Ran tests/actions/test_diagnose.py selected by -k")
    assert events[0][:2] == (0.0, 2.0) and events[-1][:2] == (2.0, 2.0)
    assert any("passed" in (m or "") for _, _, m in events)


@pytest.mark.anyio
@pytest.mark.skipif(int(os.environ.get(DEPTH_ENV, "0") or 0) > 0, reason="nested inside run_unit_tests")
async def test_run_unit_tests_reports_an_empty_selection_as_not_ok(client) -> None:
    arguments = {"path": "tests/actions/test_diagnose.py", "k": "no_such_test_name", "timeout_s": 120}
    result = await client.call_tool("run_unit_tests", arguments)
    data = result.structured_content
    assert data["nothing_selected"] is True and data["ok"] is False and data["passed"] == 0
