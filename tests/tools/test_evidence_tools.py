"""The user's log through every tool that sizes: ``estimate``, ``recommend`` and ``apply`` on the CLI (``main()``, its
real parser) and ``estimate_memory``, ``recommend_mode`` and ``apply_offload`` over MCP (the in-memory client) give
the same calibration and the same GiB for the same log; a log with no figure is exit 2 / ToolError, nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mcp import Client

from mbridge_offload_tools.cli.main import main
from mbridge_offload_tools.server.app import mcp

LOG = "\n".join(
    [
        "[rank15]: [2026-12-04 10:00:01] iteration        1/     100 | elapsed time per iteration (ms): 9123.4 |",
        "[rank0]: [Rank 0] (after 2 iterations) memory (MB) | allocated: 30123.50 | max allocated: 44544.00 | "
        "reserved: 47000.00 | max reserved: 47000.00",
        "[rank8]: [Rank 8] (after 2 iterations) memory (MB) | allocated: 30123.50 | max allocated: 46080.00 | "
        "reserved: 47000.00 | max reserved: 47000.00",
        "[rank15]: [2026-12-04 10:00:03] iteration        2/     100 | elapsed time per iteration (ms): 2480.0 |",
        "[rank15]: [2026-12-04 10:00:05] iteration        3/     100 | elapsed time per iteration (ms): 2490.0 |",
        "[rank12]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 4 has a total capacity "
        "of 79.11 GiB of which 1.20 GiB is free. Of the allocated memory 48.50 GiB is allocated by PyTorch, and 1.50 "
        "GiB is reserved by PyTorch but unallocated.",
    ]
)
PLAN = {"gpu": "h100-80gb", "num_gpus": 16}
CONFIG = Path(__file__).resolve().parents[2] / "examples" / "qwen3_30b_a3b_pretrain.yaml"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def cli(argv: list[str], capsys) -> tuple[int, dict]:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--json"])
    return int(done.value.code), json.loads(capsys.readouterr().out)


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)  # the MCP server reads inside its launch directory
    (tmp_path / "run.yaml").write_text(CONFIG.read_text(), encoding="utf-8")
    (tmp_path / "train.log").write_text(LOG + "\n", encoding="utf-8")
    (tmp_path / "noise.log").write_text("loss 3.2\nloss 3.1\n", encoding="utf-8")
    return tmp_path


@pytest.mark.anyio
async def test_the_same_log_gives_the_same_calibration_on_the_cli_and_over_mcp(project, capsys) -> None:
    flags = ["--gpu", "h100-80gb", "--num-gpus", "16", "--measured-log", "train.log"]
    _, est_cli = cli(["estimate", "run.yaml", *flags], capsys)
    _, rec_cli = cli(["recommend", "run.yaml", *flags], capsys)
    async with Client(mcp, raise_exceptions=True) as client:
        args = {"config": "run.yaml", **PLAN, "measured_log": "train.log"}
        est_mcp = (await client.call_tool("estimate_memory", args)).structured_content
        rec_mcp = (await client.call_tool("recommend_mode", args)).structured_content
        applied = (await client.call_tool("apply_offload", {**args, "option": 0})).structured_content
    for a, b in ((est_cli, est_mcp), (rec_cli, rec_mcp)):
        assert a["calibration"] == b["calibration"]
    assert est_cli["memory_gib"] == est_mcp["memory_gib"] and rec_cli["options"] == rec_mcp["options"]
    cal = est_cli["calibration"]
    # Both stages reported, rank 0 on stage 0 and rank 8 on stage 1 (TP2 PP2 EP4 on 16 GPUs); the OOM of rank 12
    # (stage 1) bounds stage 1 at 50.5 GiB, above its report, so the bound sets the shift.
    stages = {f["line_number"]: f["stage"] for f in cal["figures"]}
    assert stages[2] == 0 and stages[3] == 1 and stages[6] == 1
    assert cal["measured_kind"] == "bound" and cal["measured_bound_gib"] == pytest.approx(50.5)
    assert cal["measured_peak_gib"] == pytest.approx(45.0) and cal["measured_step_s"] == pytest.approx(2.485)
    assert cal["ooms"] and not est_cli["fits"] and cal["fragmentation_gib"] == pytest.approx(1.5)
    assert est_cli["memory_gib"]["total"] >= 50.5
    assert set(applied["overrides"]) <= set(rec_cli["options"][0]["overrides"])


@pytest.mark.anyio
async def test_a_log_with_no_figure_is_bad_input_in_every_tool(project, capsys) -> None:
    for command in ("estimate", "recommend", "apply"):
        extra = ["--mode", "recommended", "--in-place"] if command == "apply" else []
        code, data = cli([command, "run.yaml", *extra, "--measured-log", "noise.log"], capsys)
        assert code == 2 and "nothing measured" in data["error"] and "Tried to allocate" in data["error"], data
    async with Client(mcp, raise_exceptions=True) as client:
        for tool in ("estimate_memory", "recommend_mode", "apply_offload"):
            extra = {"in_place": True} if tool == "apply_offload" else {}
            result = await client.call_tool(tool, {"config": "run.yaml", "measured_log": "noise.log", **extra})
            assert result.is_error and "nothing measured" in result.content[0].text, tool
    assert sorted(p.name for p in project.iterdir()) == ["noise.log", "run.yaml", "train.log"]  # nothing written
    assert (project / "run.yaml").read_text() == CONFIG.read_text()
