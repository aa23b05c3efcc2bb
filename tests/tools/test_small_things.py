"""The small things: ``serve`` says on stderr what it waits for, the test tool shows each test once in a
terminal, and MCP ``validate_config`` takes the Transformer Engine version with the CLI's meaning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mcp import Client

from mbridge_offload_tools.server.app import mcp

FINE_GRAINED = """\
model:
  num_layers: 4
  fine_grained_activation_offloading: true
  offload_modules: [core_attn]
  transformer_impl: transformer_engine
"""


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


# ---------------------------------------------------------------------------------------------- serve


def test_serve_on_stdio_says_on_stderr_that_it_waits_for_a_client_and_keeps_stdout_for_the_protocol(
    tmp_path: Path,
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "mbridge_offload_tools", "serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # blocks until the server speaks (or exits)
        assert "waiting for an MCP client on stdio" in line
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # end of the protocol stream: the server exits
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if proc.poll() is None:
            proc.kill()
        out = proc.stdout.read() if proc.stdout else ""
    assert out == ""  # nothing but protocol messages may go to stdout, and no client sent any


# ---------------------------------------------------------------------------------------------- test tool


def test_the_test_tool_shows_each_test_once_in_a_terminal() -> None:
    proc = _cli("test", "--path", "tests/config/test_overlap_rule.py", "-k", "threshold or docs_quote")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shown = proc.stderr + proc.stdout  # what a terminal shows: progress (stderr) and the summary (stdout)
    nodeids = [line.split(": ", 1)[1] for line in proc.stderr.splitlines() if line.startswith("[") and ": " in line]
    tests = [n for n in nodeids if "::" in n]
    assert len(tests) == 4
    for nodeid in tests:
        assert shown.count(nodeid) == 1, nodeid
    assert "4 passed, 0 failed" in proc.stdout


def test_the_test_tool_json_still_lists_every_test() -> None:
    proc = _cli("test", "--path", "tests/config/test_overlap_rule.py", "-k", "measured_to_pay", "--json")
    data = json.loads(proc.stdout)
    assert proc.returncode == 0 and data["passed"] == 1 and len(data["tests"]) == 1


# ---------------------------------------------------------------------------------------------- MCP te_version


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _rules(findings: list[dict]) -> set[str]:
    return {f["rule"] for f in findings}


@pytest.mark.anyio
@pytest.mark.parametrize("te_version", ["2.9", "2.10.0", "2.18"])
async def test_mcp_validate_config_reads_the_te_version_as_the_cli_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, te_version: str
) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "fg.yaml"
    path.write_text(FINE_GRAINED, encoding="utf-8")
    cli = _cli("validate", str(path), "--env", f"te_version={te_version}", "--json", cwd=tmp_path)
    async with Client(mcp, raise_exceptions=True) as client:
        result = await client.call_tool("validate_config", {"config": str(path), "te_version": te_version})
    assert not result.is_error, result.content
    data = result.structured_content
    assert data["env"]["te_version"] == te_version and "te_version_source" not in data["env"]
    assert _rules(data["findings"]) == _rules(json.loads(cli.stdout)["findings"])
    # TE >= 2.10 runs the v2 offload: fine-grained offloading then needs NVTE_CPU_OFFLOAD_V1=1 (Bridge's check).
    assert ("ACT-FG-NVTE-V1" in _rules(data["findings"])) == (te_version != "2.9")


@pytest.mark.anyio
async def test_mcp_validate_config_without_te_version_says_it_assumed_one(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    async with Client(mcp, raise_exceptions=True) as client:
        result = await client.call_tool("validate_config", {"config": FINE_GRAINED})
    assert "assumed" in result.structured_content["env"]["te_version_source"]


@pytest.mark.anyio
async def test_a_bad_te_version_is_bad_input_on_both_surfaces(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    async with Client(mcp, raise_exceptions=True) as client:
        bad = await client.call_tool("validate_config", {"config": FINE_GRAINED, "te_version": "latest"})
        assert bad.is_error and "X.Y" in bad.content[0].text
        good = await client.call_tool("validate_config", {"config": FINE_GRAINED, "te_version": "2.9"})
        assert not good.is_error  # the server keeps answering
    path = tmp_path / "fg.yaml"
    path.write_text(FINE_GRAINED, encoding="utf-8")
    cli = _cli("validate", str(path), "--env", "te_version=latest", "--json", cwd=tmp_path)
    assert cli.returncode == 2 and "X.Y" in json.loads(cli.stdout)["error"]


@pytest.mark.anyio
async def test_apply_takes_the_te_version_on_both_surfaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "dense.yaml"
    path.write_text("model:\n  num_layers: 4\n  transformer_impl: transformer_engine\n", encoding="utf-8")
    cli = _cli("apply", str(path), "--mode", "fine-grained", "--te-version", "2.9", "--json", cwd=tmp_path)
    async with Client(mcp, raise_exceptions=True) as client:
        result = await client.call_tool(
            "apply_offload", {"config": str(path), "mode": "fine-grained", "te_version": "2.9"}
        )
        bad = await client.call_tool("apply_offload", {"config": str(path), "mode": "none", "te_version": "latest"})
    data = result.structured_content
    assert cli.returncode == 0 and json.loads(cli.stdout)["env"] == data["env"] == {"te_version": "2.9"}
    assert "env_vars.NVTE_CPU_OFFLOAD_V1" not in {c["key"] for c in data["changes"]}
    assert bad.is_error and "X.Y" in bad.content[0].text


# ---------------------------------------------------------------------------------------------- wording


def test_recommend_names_a_fine_grained_offload_it_advises_to_remove() -> None:
    from mbridge_offload.config import sources
    from mbridge_offload.plan import service

    loaded = sources.load(
        "examples/qwen3_30b_a3b_pretrain.yaml",
        [
            "optimizer.optimizer_cpu_offload=false",
            "model.fine_grained_activation_offloading=true",
            "model.offload_modules=[expert_fc1]",
            "model.transformer_impl=transformer_engine",
        ],
    )
    rec = service.recommend_for_inputs(loaded.config, loaded.raw, num_gpus=16)
    assert rec.given_mode == "fine-grained" and rec.advice
    assert "has fine-grained activation offload of expert_fc1" in rec.advice
    assert not any(" ;" in line or "has ;" in line for line in rec.rationale)
