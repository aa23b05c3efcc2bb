"""The MCP server reaches the user's project: the client's declared roots, else the launch directory the shipped
launcher keeps; every file a tool reads (configs, measured logs, host profiles, before/after) is bounded and
confined to them. Real stdio clients (python-sdk) spawning the server as a subprocess."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio
import pytest
from mcp import Client, StdioServerParameters, types
from mcp.shared.exceptions import MCPDeprecationWarning

from mbridge_offload.actions.testing.run import DEPTH_ENV
from tests.support import tree

CONFIG = "model:\n  num_layers: 4\n  hidden_size: 256\n  num_attention_heads: 4\n  vocab_size: 1024\n"
LOG = "iteration 2 | elapsed time per iteration (ms): 2500.0 |\n[Rank 0] memory (MB) | max allocated: 40000.0 |\n"
nested = pytest.mark.skipif(int(os.environ.get(DEPTH_ENV, "0") or 0) > 0, reason="nested inside run_unit_tests")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": tree.pythonpath(inherit=True), **extra}


def _project(base: Path) -> Path:
    base.mkdir(parents=True, exist_ok=True)
    (base / "pretrain.yaml").write_text(CONFIG)
    (base / "run.log").write_text(LOG)
    return base


def _server(cwd: Path, *args: str) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable, args=["-m", "mbridge_offload_tools.server.app", *args], cwd=str(cwd), env=_env()
    )


class Roots:
    """The client side of the roots capability: the directories the user opened, changeable mid-session."""

    def __init__(self, *dirs: Path) -> None:
        self.dirs = list(dirs)
        self.asked = 0

    async def __call__(self, context) -> types.ListRootsResult:
        self.asked += 1
        return types.ListRootsResult(roots=[types.Root(uri=d.as_uri(), name=d.name) for d in self.dirs])


async def _validate(client: Client, path: Path):
    return await client.call_tool("validate_config", {"config": str(path)})


@pytest.mark.anyio
async def test_a_client_that_declares_roots_is_asked_and_its_roots_are_followed(tmp_path) -> None:
    a, b, launch = _project(tmp_path / "a"), _project(tmp_path / "b"), _project(tmp_path / "launch")
    roots = Roots(a)
    # The 2025 handshake (what hosts that send roots speak); the launch directory holds neither a nor b.
    async with Client(_server(launch), mode="legacy", list_roots_callback=roots) as client:
        assert not (await _validate(client, a / "pretrain.yaml")).is_error
        refused = await _validate(client, b / "pretrain.yaml")
        assert refused.is_error and "outside the directories this server may read" in refused.content[0].text
        assert str(a) in refused.content[0].text
        # The launch directory is replaced by the client's roots, not added to them.
        assert (await _validate(client, launch / "pretrain.yaml")).is_error
        assert roots.asked == 1  # asked once, then kept for the connection

        roots.dirs = [b]
        with pytest.warns(MCPDeprecationWarning):  # the SDK marks the roots capability deprecated (2026-07-28)
            await client.send_roots_list_changed()
        assert not (await _validate(client, b / "pretrain.yaml")).is_error
        assert (await _validate(client, a / "pretrain.yaml")).is_error
        assert roots.asked == 2

        # Writes follow the same roots: apply_offload may write into b, not into a.
        write_in = await client.call_tool(
            "apply_offload", {"config": str(b / "pretrain.yaml"), "mode": "optimizer", "output": str(b / "o.yaml")}
        )
        assert not write_in.is_error and (b / "o.yaml").is_file()
        write_out = await client.call_tool(
            "apply_offload", {"config": str(b / "pretrain.yaml"), "mode": "optimizer", "output": str(a / "o.yaml")}
        )
        assert write_out.is_error and not (a / "o.yaml").exists()


@pytest.mark.anyio
async def test_declared_roots_keep_the_servers_explicit_root_flags(tmp_path) -> None:
    a, extra = _project(tmp_path / "a"), _project(tmp_path / "extra")
    async with Client(_server(tmp_path, "--root", str(extra)), mode="legacy", list_roots_callback=Roots(a)) as client:
        assert not (await _validate(client, a / "pretrain.yaml")).is_error
        assert not (await _validate(client, extra / "pretrain.yaml")).is_error


@pytest.mark.anyio
async def test_every_file_a_tool_reads_is_bounded_and_inside_the_roots(tmp_path) -> None:
    project, outside = _project(tmp_path / "project"), _project(tmp_path / "outside")
    os.mkfifo(project / "fifo")
    huge = project / "huge.yaml"
    with huge.open("wb") as f:
        f.truncate(64 * 1024 * 1024)  # sparse: 64 MiB on paper
    (project / "profile.json").write_text(json.dumps({"cpu_adam_params_per_s_per_core": 1e8}))
    (project / ".mbridge-offload" / "host-profiles").mkdir(parents=True)
    (project / ".mbridge-offload" / "host-profiles" / "box.json").write_text(
        json.dumps({"name": "box", "cpu_adam_params_per_s_per_core": 2e8})
    )
    plan = {"model": "llama3-8b", "gpu": "h100-80gb"}
    bad = {
        "measured_log": [project / "fifo", Path("/dev/zero"), outside / "run.log"],
        "host_profile": [project / "fifo", Path("/dev/zero"), huge, tmp_path / "nothing.json"],
    }
    with anyio.fail_after(120):  # no read may hang the session
        async with Client(_server(project), mode="legacy", list_roots_callback=Roots(project)) as client:
            for key, paths in bad.items():
                for path in paths:
                    result = await client.call_tool("recommend_mode", {**plan, key: str(path)})
                    assert result.is_error, (key, path)
                    assert "Traceback" not in result.content[0].text
            ok = await client.call_tool(
                "recommend_mode",
                {**plan, "measured_log": str(project / "run.log"), "host_profile": str(project / "profile.json")},
            )
            assert not ok.is_error
            assert ok.structured_content["calibration"]["measured_step_s"] == pytest.approx(2.5)
            # A profile by NAME is looked up in the roots; a huge log is read by its tail, not refused or slurped.
            named = await client.call_tool("recommend_mode", {**plan, "host_profile": "box"})
            (rate,) = [a for a in named.structured_content["assumptions"] if a["name"].startswith("cpu_adam")]
            assert rate["source"] == "host-profile" and rate["value"] == 2e8
            tail = await client.call_tool("recommend_mode", {**plan, "measured_log": str(huge)})
            assert tail.is_error and "nothing measured" in tail.content[0].text  # zeros: no figure, bad input
            huge_log = project / "huge.log"
            with huge_log.open("wb") as f:  # 64 MiB of nothing, then the report at its end: the tail is read
                f.truncate(64 * 1024 * 1024)
                f.seek(0, 2)
                f.write(b"\n[Rank 0] (after 2 iterations) memory (MB) | allocated: 1.0 | max allocated: 40960.0 |\n")
            # At TP 8 on 8 GPUs (1 B parameters a GPU): 40 GiB is a peak the physics checks accept; on one GPU the
            # same figure is below the model's resident state and set aside.
            at_tp8 = {**plan, "num_gpus": 8, "tp": 8}
            tail = await client.call_tool("recommend_mode", {**at_tp8, "measured_log": str(huge_log)})
            assert not tail.is_error and tail.structured_content["calibration"]["measured_peak_gib"] == 40.0
            for before, after in (
                (outside / "pretrain.yaml", project / "pretrain.yaml"),
                (project / "pretrain.yaml", project / "fifo"),
                (project / "pretrain.yaml", huge),
            ):
                result = await client.call_tool("diagnose_failure", {"before": str(before), "after": str(after)})
                assert result.is_error, (before, after)
            refused = await client.call_tool("diagnose_failure", {"config": str(outside / "pretrain.yaml")})
            assert refused.is_error and "outside" in refused.content[0].text
            # The parity run's config is read here, inside the roots, before any child process starts.
            parity = await client.call_tool(
                "run_unit_tests", {"suite": "parity", "config": str(outside / "pretrain.yaml"), "timeout_s": 60}
            )
            assert parity.is_error and "outside" in parity.content[0].text


@pytest.mark.anyio
async def test_a_client_without_roots_gets_the_launch_directory(tmp_path) -> None:
    project, outside = _project(tmp_path / "project"), _project(tmp_path / "outside")
    async with Client(_server(project)) as client:  # the 2026-07-28 default: no roots at all
        assert not (await _validate(client, project / "pretrain.yaml")).is_error
        assert (await _validate(client, outside / "pretrain.yaml")).is_error
    async with Client(_server(project), mode="legacy") as client:  # a 2025 client that declares no roots
        assert not (await _validate(client, project / "pretrain.yaml")).is_error
        assert (await _validate(client, outside / "pretrain.yaml")).is_error
    extra = _project(tmp_path / "extra")
    async with Client(_server(project, "--root", str(extra))) as client:  # --root adds to the launch directory
        assert not (await _validate(client, project / "pretrain.yaml")).is_error
        assert not (await _validate(client, extra / "pretrain.yaml")).is_error
        assert (await _validate(client, outside / "pretrain.yaml")).is_error


@pytest.fixture(scope="module")
def light_copy(tmp_path_factory) -> Path:
    from tests.support.skill_copy import light_skill_copy

    return light_skill_copy(tmp_path_factory.mktemp("skill"))


def _launcher(skill: Path, cwd: Path, **env: str) -> StdioServerParameters:
    from tests.support.skill_copy import clean_env

    return StdioServerParameters(
        command=str(skill / "scripts" / "mcp-server"), cwd=str(cwd), env={**clean_env(), **env}
    )


@nested
@pytest.mark.anyio
async def test_the_shipped_launcher_serves_the_users_project_without_a_restart(light_copy, tmp_path) -> None:
    # The way the docs' project .mcp.json and the plugin start it: the skill's launcher by its path, from the
    # user's project (Claude Code, Codex, Gemini CLI start servers there). The skill folder is not a root.
    project, elsewhere = _project(tmp_path / "project"), _project(tmp_path / "elsewhere")
    async with Client(_launcher(light_copy, project)) as client:
        assert not (await _validate(client, project / "pretrain.yaml")).is_error
        assert (await _validate(client, light_copy / "examples" / "qwen3_30b_a3b_pretrain.yaml")).is_error
        assert (await _validate(client, elsewhere / "pretrain.yaml")).is_error
    # A plugin server started elsewhere: Claude Code names the project in CLAUDE_PROJECT_DIR.
    async with Client(_launcher(light_copy, elsewhere, CLAUDE_PROJECT_DIR=str(project))) as client:
        assert not (await _validate(client, project / "pretrain.yaml")).is_error
        assert (await _validate(client, elsewhere / "pretrain.yaml")).is_error


def test_only_local_file_uris_become_roots(tmp_path) -> None:
    from mbridge_offload_tools.server.roots import paths_of

    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real", target_is_directory=True)
    spaced = tmp_path / "with space"
    got = paths_of([link.as_uri(), spaced.as_uri(), "https://example.com/x", "file://otherhost/etc", "file:///a/../b"])
    assert got == ((tmp_path / "real").resolve(), spaced.resolve(), Path("/b"))
