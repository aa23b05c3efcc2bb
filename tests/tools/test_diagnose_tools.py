"""diagnose on the CLI and over MCP: the planner inputs are the same flags and parameters (generated from PlanInputs),
the same file gives the same sized answer on both, bad planner input is one error, and the human output shows the
ranked options and the GPUs they are sized on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mcp import Client

from mbridge_offload.actions.diagnose.sizing import input_names
from mbridge_offload.plan.inputs.fields import flag_name
from mbridge_offload_tools.cli.main import build_parser
from mbridge_offload_tools.server.app import mcp
from tests.support import tree
from tests.support.configs import LLAMA3_8B, bridge_yaml

OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB."
CONFIG = bridge_yaml(
    ("model", {**LLAMA3_8B, "seq_length": 16384, "bf16": True}),
    ("train", {"micro_batch_size": 1, "global_batch_size": 32}),
    ("optimizer", {"use_distributed_optimizer": True}),
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # the MCP server reads inside its launch directory
    path = tmp_path / "sft.yaml"
    path.write_text(CONFIG, encoding="utf-8")
    return path


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=tree.pythonpath(inherit=True))
    return subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools", "diagnose", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _diagnose_parser():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["diagnose"]


def test_every_planner_input_of_diagnose_is_a_cli_flag_of_its_name() -> None:
    flags = {o: a.dest for a in _diagnose_parser()._actions for o in a.option_strings}
    for name in input_names():
        assert flags.get(flag_name(name)) == name, name


@pytest.mark.anyio
async def test_every_planner_input_of_diagnose_is_an_mcp_parameter_with_its_bounds() -> None:
    async with Client(mcp, raise_exceptions=True) as client:
        tools = {t.name: t.input_schema for t in (await client.list_tools()).tools}
    props = tools["diagnose_failure"]["properties"]
    assert set(input_names()) | {"error", "symptom", "log", "config", "before", "after"} == set(props)
    for name in input_names():  # the same schema as estimate_memory's parameter of that name
        assert props[name] == tools["estimate_memory"]["properties"][name], name


@pytest.mark.anyio
async def test_the_cli_and_mcp_give_the_same_sized_answer(config_file: Path) -> None:
    args = {"config": str(config_file), "error": OOM, "gpu": "h200-141gb", "num_gpus": 16}
    out = _cli(
        "--config",
        str(config_file),
        "--error",
        OOM,
        "--gpu",
        "h200-141gb",
        "--num-gpus",
        "16",
        "--json",
        cwd=config_file.parent,
    )
    assert out.returncode == 0, out.stderr
    cli = json.loads(out.stdout)
    async with Client(mcp, raise_exceptions=True) as client:
        result = await client.call_tool("diagnose_failure", args)
    served = result.structured_content
    for key in ("matches", "options", "assumptions", "calibration"):
        assert cli[key] == served[key], key
    said = {a["name"]: a for a in cli["assumptions"]}
    assert (said["num_gpus"]["value"], said["num_gpus"]["source"]) == (16, "flag")
    assert cli["matches"][0]["fix"] == cli["options"][0]["overrides"]


def test_the_human_output_shows_the_ranked_options_and_the_gpus(config_file: Path) -> None:
    out = _cli("--config", str(config_file), "--error", OOM, "--num-gpus", "16", cwd=config_file.parent)
    assert out.returncode == 0, out.stderr
    assert "options (the planner's, ranked by step time" in out.stdout
    assert "  0. x" in out.stdout
    assert "sized on 16 x h100-80gb (GPU count: flag, GPU: default)" in out.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--num-gpus", "0"], "--num-gpus"),
        (["--gpu", "h100"], "unknown GPU preset"),
        (["--levers", "warp"], "unknown lever"),
        (["--measured-log", "missing.log"], "no such file"),
    ],
)
def test_bad_planner_input_exits_2_with_one_json_error(tmp_path: Path, args: list[str], says: str) -> None:
    out = _cli("--error", OOM, *args, "--json", cwd=tmp_path)
    assert out.returncode == 2
    (line,) = out.stdout.strip().splitlines()
    assert says in json.loads(line)["error"]


@pytest.mark.anyio
async def test_bad_planner_input_over_mcp_is_a_tool_error() -> None:
    async with Client(mcp) as client:
        result = await client.call_tool("diagnose_failure", {"error": OOM, "gpu": "h100"})
    assert result.is_error and "unknown GPU preset" in result.content[0].text
