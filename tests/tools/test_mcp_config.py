"""``mbridge-offload mcp-config``: the project-scope ``.mcp.json`` entry that starts this server from any project.

The entry names this checkout's launcher by its absolute path (a relative ``./scripts/mcp-server`` exists only when
the host opens the skill folder itself). Writing follows the house rules for a user's file: a new file is created,
an existing one changes only with ``--force`` (its other servers kept, a backup written), a bad one is never touched.
The last test is the whole path: the entry the command writes into a scratch project, started by a real MCP stdio
client exactly as the file says, from that project, serving a config there.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mbridge_offload.actions.testing.run import DEPTH_ENV
from tests.support import tree

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "scripts" / "mcp-server"
CONFIG = "model:\n  num_layers: 4\n  hidden_size: 256\n  num_attention_heads: 4\n  vocab_size: 1024\n"
nested = pytest.mark.skipif(int(os.environ.get(DEPTH_ENV, "0") or 0) > 0, reason="nested inside run_unit_tests")


def _cli(*args: str) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools.cli.main", "mcp-config", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": tree.pythonpath(inherit=True)},
    )
    return proc.returncode, json.loads(proc.stdout)


def _ours() -> dict:
    return {"command": str(LAUNCHER), "args": []}


def test_without_a_project_it_prints_the_entry_with_the_launchers_absolute_path(tmp_path):
    code, out = _cli()
    assert code == 0 and out["written"] is None and out["project"] is None
    assert out["entry"] == {"mcpServers": {"mbridge-offload": _ours()}}
    assert Path(out["entry"]["mcpServers"]["mbridge-offload"]["command"]).is_absolute()
    assert os.access(LAUNCHER, os.X_OK)


def test_a_project_without_an_mcp_json_gets_one_and_a_second_run_changes_nothing(tmp_path):
    code, out = _cli("--project", str(tmp_path))
    assert code == 0 and out["changed"] and out["written"] == str(tmp_path / ".mcp.json") and out["backup"] is None
    assert json.loads((tmp_path / ".mcp.json").read_text()) == {"mcpServers": {"mbridge-offload": _ours()}}
    before = (tmp_path / ".mcp.json").stat().st_mtime_ns
    code, again = _cli("--project", str(tmp_path))
    assert code == 0 and not again["changed"] and again["written"] is None
    assert (tmp_path / ".mcp.json").stat().st_mtime_ns == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".mcp.json"]  # no temp file, no backup


def test_an_existing_mcp_json_changes_only_with_force_keeping_its_servers_and_a_backup(tmp_path):
    mine = {"mcpServers": {"git": {"command": "uvx", "args": ["mcp-server-git"]}, "mbridge-offload": {"command": "x"}}}
    text = json.dumps(mine, indent=4)
    (tmp_path / ".mcp.json").write_text(text)
    code, refused = _cli("--project", str(tmp_path))
    assert code == 2 and refused["ok"] is False and "--force" in refused["error"]
    assert (tmp_path / ".mcp.json").read_text() == text  # untouched
    code, out = _cli("--project", str(tmp_path), "--force")
    assert code == 0 and out["changed"] and out["backup"] == str(tmp_path / ".mcp.json.bak")
    written = json.loads((tmp_path / ".mcp.json").read_text())
    assert written == {"mcpServers": {"git": mine["mcpServers"]["git"], "mbridge-offload": _ours()}}
    assert (tmp_path / ".mcp.json.bak").read_text() == text


def test_a_symlinked_mcp_json_stays_a_link_and_its_target_is_edited(tmp_path):
    real = tmp_path / "shared.json"
    real.write_text('{"mcpServers": {}}')
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / ".mcp.json").symlink_to(real)
    code, _ = _cli("--project", str(tmp_path / "project"), "--force")
    assert code == 0 and (tmp_path / "project" / ".mcp.json").is_symlink()
    assert json.loads(real.read_text()) == {"mcpServers": {"mbridge-offload": _ours()}}


@pytest.mark.parametrize(
    ("name", "content", "args", "says"),
    [
        ("not-json", "{mcpServers: nope", ["--force"], "cannot be read as JSON"),
        ("servers-not-object", '{"mcpServers": ["a"]}', ["--force"], "not an MCP config"),
        ("top-level-list", "[1, 2]", ["--force"], "not an MCP config"),
        ("read-only", '{"mcpServers": {}}', ["--force"], "read-only"),
    ],
)
def test_a_bad_or_protected_mcp_json_is_refused_and_left_as_it_was(tmp_path, name, content, args, says):
    path = tmp_path / ".mcp.json"
    path.write_text(content)
    if name == "read-only":
        path.chmod(stat.S_IRUSR)
    code, out = _cli("--project", str(tmp_path), *args)
    assert code == 2 and out["ok"] is False and says in out["error"], out
    assert path.read_text() == content and sorted(p.name for p in tmp_path.iterdir()) == [".mcp.json"]


@pytest.mark.parametrize("args", [["--project", "/no/such/folder"], ["--force"]])
def test_bad_usage_is_one_json_error(tmp_path, args):
    code, out = _cli(*args)
    assert code == 2 and out["ok"] is False and out["error"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def light_copy(tmp_path_factory) -> Path:
    from tests.support.skill_copy import light_skill_copy

    return light_skill_copy(tmp_path_factory.mktemp("skill"))


@nested
@pytest.mark.anyio
async def test_a_real_client_started_from_the_project_with_exactly_that_entry_serves_it(light_copy, tmp_path):
    from mcp import Client, StdioServerParameters

    from tests.support.skill_copy import clean_env

    # The skill where an installer put it, and a user's project elsewhere with a config and nothing of the skill.
    project = tmp_path / "my-project"
    project.mkdir()
    (project / "pretrain.yaml").write_text(CONFIG)
    done = subprocess.run(
        [str(light_copy / "scripts" / "mbridge-offload"), "mcp-config", "--project", str(project), "--json"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    server = json.loads((project / ".mcp.json").read_text())["mcpServers"]["mbridge-offload"]
    assert server["command"] == str(light_copy / "scripts" / "mcp-server") and not (project / "scripts").exists()
    # How a host starts a project-scope server: the command and args as written, in the project.
    params = StdioServerParameters(command=server["command"], args=server["args"], cwd=str(project), env=clean_env())
    async with Client(params) as client:
        names = {t.name for t in (await client.list_tools()).tools}
        assert {"validate_config", "recommend_mode", "apply_offload"} <= names
        answer = await client.call_tool("validate_config", {"config": "pretrain.yaml"})
        assert not answer.is_error, answer.content
        outside = await client.call_tool(
            "validate_config", {"config": str(light_copy / "examples" / "qwen3_30b_a3b_pretrain.yaml")}
        )
        assert outside.is_error  # the project is the server's root, not the skill folder
