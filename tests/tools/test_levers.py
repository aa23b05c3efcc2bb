"""``recommend --levers`` / ``recommend_mode(levers=...)`` and ``apply --option N`` / ``apply_offload(option=N)``:
the real CLI in a subprocess (exit codes, one JSON object) and the real MCP server through its in-memory client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mcp import Client

from mbridge_offload.config import sources
from mbridge_offload.plan.inputs.fields import LEVERS
from mbridge_offload_tools.server.app import mcp
from tests.support.configs import LLAMA3_8B, bridge_yaml

ROOT = Path(__file__).resolve().parents[2]
SFT = ["--model", "llama3-8b", "--gpu", "h100-80gb", "--num-gpus", "8"]
SFT_YAML = bridge_yaml(
    (
        "model",
        {
            **LLAMA3_8B,
            "normalization": "RMSNorm",
            "gated_linear_unit": True,
            "share_embeddings_and_output_weights": False,
            "seq_length": 16384,
            "tensor_model_parallel_size": 1,
        },
    ),
    ("train", {"micro_batch_size": 1, "global_batch_size": 64}),
    ("optimizer", {"use_distributed_optimizer": True}),
    comment="Llama 3.1 8B SFT at 16k tokens on one 8 x H100 node.",
)


def cli(args: list[str], cwd: Path) -> tuple[int, dict]:
    """The console entry point as a user runs it; exactly one JSON object on stdout."""
    env = {**os.environ, "HOME": str(cwd)}
    done = subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools", *args, "--json"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, json.loads(done.stdout)


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "sft.yaml"
    path.write_text(SFT_YAML, encoding="utf-8")
    return path


def test_unknown_lever_is_exit_2_with_one_error_listing_the_levers(tmp_path):
    code, data = cli(["recommend", *SFT, "--seq-length", "16384", "--levers", "recompute,pipeline"], tmp_path)
    assert code == 2
    message = json.dumps(data)
    assert "'pipeline'" in message and all(lever in message for lever in LEVERS)


def test_a_lever_the_run_cannot_use_is_exit_2_naming_why_and_what_it_can_use(tmp_path):
    # MBS is already 1: no smaller micro-batch exists.
    code, data = cli(["recommend", *SFT, "--global-batch-size", "64", "--levers", "mbs,recompute"], tmp_path)
    assert code == 2
    message = json.dumps(data)
    assert "micro_batch_size is already 1" in message and "levers this run can use: recompute" in message
    # CP needs seq_length divisible by 2·CP: an odd length allows none.
    code, data = cli(["recommend", *SFT, "--seq-length", "4097", "--levers", "cp"], tmp_path)
    assert code == 2 and "no CP above 1" in json.dumps(data)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_recommend_lists_ranked_options_and_the_levers_it_was_allowed(tmp_path):
    code, data = cli(
        ["recommend", *SFT, "--seq-length", "16384", "--global-batch-size", "64", "--levers", "recompute", "optimizer"],
        tmp_path,
    )
    assert code == 0 and data["levers"] == ["recompute", "optimizer"]
    allowed = [o for o in data["options"] if not o["alternative"]]
    assert allowed and all(set(o["levers"]) <= {"recompute", "optimizer"} for o in allowed)
    assert data["options"][0]["overrides"] == data["overrides"]
    for key in ("changes", "memory_gib", "stages_gib", "host_gb", "host_gb_per_node", "step_time_s", "margin_gib"):
        assert key in data["options"][0]


def test_apply_option_n_writes_exactly_option_n(tmp_path, config_file):
    plan = ["--gpu", "h100-80gb", "--num-gpus", "8"]
    code, rec = cli(["recommend", str(config_file), *plan], tmp_path)
    assert code == 0 and len(rec["options"]) >= 2, rec
    n = next(o["rank"] for o in rec["options"] if o["rank"] > 0 and not o["alternative"])
    out = tmp_path / "option.yaml"
    code, applied = cli(["apply", str(config_file), "--option", str(n), *plan, "--output", str(out)], tmp_path)
    assert code == 0 and applied["written"] == str(out), applied
    written = sources.load(str(out)).config  # a key already at the option's value needs no edit
    for override in rec["options"][n]["overrides"]:
        key, _, value = override.partition("=")
        section, leaf = key.split(".")
        assert getattr(getattr(written, section), leaf) == yaml.safe_load(value), override
    assert "# Llama 3.1 8B SFT" in out.read_text()  # the untouched bytes stay
    # Option 0 differs: what is written is option N's, not the recommendation's.
    assert rec["options"][n]["overrides"] != rec["options"][0]["overrides"]
    code, dry = cli(["apply", str(config_file), "--option", str(n), *plan], tmp_path)
    assert code == 0 and dry["written"] is None


def test_apply_option_out_of_range_or_with_another_mode_is_exit_2_and_no_mode_is_recommended(tmp_path, config_file):
    plan = ["--gpu", "h100-80gb", "--num-gpus", "8"]
    code, data = cli(["apply", str(config_file), "--option", "99", *plan], tmp_path)
    assert code == 2 and "option 99: recommend lists" in json.dumps(data)
    code, data = cli(["apply", str(config_file), "--option", "1", "--mode", "optimizer"], tmp_path)
    assert code == 2 and "mode=recommended only" in json.dumps(data)
    # Without --mode or --option the planner picks, as apply_offload's default mode=recommended: a dry run.
    code, data = cli(["apply", str(config_file)], tmp_path)
    assert code in (0, 1) and data["written"] is None and data["mode"] != "recommended"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft.yaml"]  # nothing written


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_mcp_recommend_mode_takes_levers_and_refuses_an_unknown_one() -> None:
    async with Client(mcp, raise_exceptions=True) as client:
        # 12k: recompute alone fits with the margin (at 16k the logits' loss peak leaves no allowed lever that does).
        flags = {"model": "llama3-8b", "gpu": "h100-80gb", "num_gpus": 8, "seq_length": 12288}
        good = await client.call_tool("recommend_mode", {**flags, "levers": ["recompute", "activation"]})
        assert not good.is_error
        data = good.structured_content
        assert data["levers"] == ["recompute", "activation"] and data["options"]
        assert data["options"][0]["overrides"] == data["overrides"]
        bad = await client.call_tool("recommend_mode", {**flags, "levers": ["swap"]})
        assert bad.is_error and "allowed: " + ", ".join(LEVERS) in bad.content[0].text
