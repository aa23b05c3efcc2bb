"""mbridge_offload_tools.server.guard: what the MCP server may touch is fixed at start; every call has a deadline; the
CLI
too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mcp import Client

from mbridge_offload.actions.testing.run import DEPTH_ENV
from mbridge_offload.config import reading
from mbridge_offload_tools.server import guard
from mbridge_offload_tools.server.app import mcp
from tests.support import tree

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def fresh_policy():
    yield
    guard._policy = guard.Policy()
    reading.set_read_roots(None)


def _fake_bridge(tmp_path: Path) -> tuple[Path, Path, Path]:
    repo = tmp_path / "bridge"
    tests = repo / "tests" / "unit_tests" / "training"
    tests.mkdir(parents=True)
    (tests / "test_optim.py").write_text("def test_cpu_offload_smoke():\n    assert True\n")
    conftest_marker, venv_marker = tmp_path / "conftest-ran", tmp_path / "venv-ran"
    (repo / "conftest.py").write_text(f"open({str(conftest_marker)!r}, 'w').close()\n")
    venv = repo / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(f'#!/bin/sh\ntouch {venv_marker}\nexec {sys.executable} "$@"\n')
    (venv / "python").chmod(0o755)
    return repo, conftest_marker, venv_marker


@pytest.mark.anyio
@pytest.mark.skipif(bool(os.environ.get(DEPTH_ENV)), reason="inside a run_unit_tests run")
async def test_a_bridge_checkout_runs_only_when_the_server_was_started_to_allow_it(tmp_path, fresh_policy) -> None:
    repo, conftest_ran, venv_ran = _fake_bridge(tmp_path)
    guard.configure([str(tmp_path)])
    async with Client(mcp) as client:
        refused = await client.call_tool("run_unit_tests", {"bridge_repo": str(repo)})
        assert refused.is_error and "--allow-bridge-repo" in refused.content[0].text
        assert not conftest_ran.exists() and not venv_ran.exists()  # nothing of the checkout ran

        guard.configure([str(tmp_path)], [str(repo)])
        allowed = await client.call_tool("run_unit_tests", {"bridge_repo": str(repo), "timeout_s": 120})
        assert not allowed.is_error and allowed.structured_content["passed"] == 1
        assert conftest_ran.exists() and not venv_ran.exists()  # its tests ran, with this server's Python

        guard.configure([str(tmp_path)], [str(repo)], bridge_venv=True)
        venv = await client.call_tool("run_unit_tests", {"bridge_repo": str(repo), "timeout_s": 120})
        assert not venv.is_error and venv_ran.exists()  # only now its own .venv/bin/python


@pytest.mark.anyio
async def test_reads_and_writes_stay_inside_the_roots_fixed_at_start(tmp_path, fresh_policy) -> None:
    inside, outside = tmp_path / "in", tmp_path / "out"
    inside.mkdir()
    outside.mkdir()
    (inside / "c.yaml").write_text("model:\n  num_layers: 4\n")
    (outside / "c.yaml").write_text("model:\n  num_layers: 4\n")
    guard.configure([str(inside)])
    async with Client(mcp) as client:
        ok = await client.call_tool("validate_config", {"config": str(inside / "c.yaml")})
        assert not ok.is_error
        read = await client.call_tool("validate_config", {"config": str(outside / "c.yaml")})
        assert read.is_error and "outside the directories this server may read" in read.content[0].text
        write = await client.call_tool(
            "apply_offload", {"config": str(inside / "c.yaml"), "mode": "optimizer", "output": str(outside / "n.yaml")}
        )
        assert write.is_error and "outside the directories writes may go to" in write.content[0].text
        assert not (outside / "n.yaml").exists()
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert "allowed_root" not in tools["apply_offload"].input_schema["properties"]


@pytest.mark.anyio
async def test_a_slow_call_hits_its_deadline_while_other_calls_are_answered(monkeypatch) -> None:
    import anyio

    from mbridge_offload.config import sources

    real_load = sources.load

    def slow_load(source, *args, **kwargs):
        if source == "model: {slow: 1}":
            time.sleep(4)
        return real_load(source, *args, **kwargs)

    monkeypatch.setattr(sources, "load", slow_load)
    monkeypatch.setenv(reading.DEADLINE_ENV, "1")
    answered: dict[str, float] = {}
    async with Client(mcp) as client:
        start = time.perf_counter()

        async def slow() -> None:
            result = await client.call_tool("validate_config", {"config": "model: {slow: 1}"})
            assert result.is_error and "no answer within 1 s" in result.content[0].text
            answered["slow"] = time.perf_counter() - start

        async def fast() -> None:
            await anyio.sleep(0.1)
            result = await client.call_tool("diagnose_failure", {"error": "CUDA graphs not supported"})
            assert not result.is_error
            answered["fast"] = time.perf_counter() - start

        async with anyio.create_task_group() as group:
            group.start_soon(slow)
            group.start_soon(fast)
    assert answered["fast"] < answered["slow"] < 3.5


def test_the_cli_has_a_deadline_too(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=tree.pythonpath(), **{reading.DEADLINE_ENV: "2"})
    read_end, write_end = os.pipe()  # a stdin that never ends: the write end stays open
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mbridge_offload_tools", "validate", "-", "--json"],
            stdin=read_end,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=tmp_path,
        )
        try:
            out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
    finally:
        os.close(read_end)
        os.close(write_end)
    assert proc.returncode == 2, err
    payload = json.loads(out)
    assert payload["ok"] is False and payload["kind"] == "deadline" and "no answer within 2 s" in payload["error"]
    assert b"Traceback" not in err


def test_serve_refuses_a_root_that_is_not_a_directory(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=tree.pythonpath())
    for command in (["-m", "mbridge_offload_tools", "serve"], ["-m", "mbridge_offload_tools.server.app"]):
        proc = subprocess.run(
            [sys.executable, *command, "--root", str(tmp_path / "missing")],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert proc.returncode == 2 and "is not a directory" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.anyio
async def test_apply_offload_replaces_an_existing_file_only_with_overwrite_and_keeps_a_backup(
    tmp_path, fresh_policy
) -> None:
    config, out = tmp_path / "c.yaml", tmp_path / "existing.yaml"
    config.write_text("model:\n  num_layers: 4\n")
    out.write_text("# someone's file\n")
    guard.configure([str(tmp_path)])
    args = {"config": str(config), "mode": "optimizer", "output": str(out)}
    async with Client(mcp) as client:
        refused = await client.call_tool("apply_offload", args)
        assert refused.is_error and "overwrite=true" in refused.content[0].text
        assert out.read_text() == "# someone's file\n"
        done = await client.call_tool("apply_offload", {**args, "overwrite": True})
    assert not done.is_error
    backup = Path(done.structured_content["backup"])
    assert backup.read_text() == "# someone's file\n" and "optimizer_cpu_offload: true" in out.read_text()
    assert done.structured_content["why"]  # the library's ApplyResult, as the tool's structured output
