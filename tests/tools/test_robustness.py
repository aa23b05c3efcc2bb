"""The robustness suite: hundreds of generated bad inputs over the CLI and one live MCP stdio server.

Every case (tests/support/bad_inputs.py) must be answered within a deadline with exit code 2 (MCP: ``isError``)
and exactly one JSON error object, never a traceback; the MCP server must answer a normal call after each bad
one; and no file in the sandbox may change, nor any file appear outside it.
"""

from __future__ import annotations

import json
import os
from contextlib import redirect_stderr, redirect_stdout
from io import StringIO
from pathlib import Path

import pytest
from mcp import Client

from mbridge_offload_tools.cli.main import main
from tests.support import bad_inputs

OUTER_NAME = "robustness"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory):
    outer = tmp_path_factory.mktemp(OUTER_NAME)
    box = bad_inputs.build_sandbox(outer)
    all_cases = bad_inputs.cases(box)  # planner cases write their model files: part of the sandbox
    before = bad_inputs.snapshot(outer)
    yield box, all_cases
    after = bad_inputs.snapshot(outer)
    changed = {k: (before.get(k), after.get(k)) for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assert not changed, f"files changed or appeared: {sorted(changed)[:20]}"


def _ids() -> tuple[list[str], list[str]]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        generated = bad_inputs.cases(bad_inputs.build_sandbox(Path(tmp)))
    return [c.id for c in generated if c.cli is not None], [c.id for c in generated if c.mcp is not None]


CLI_IDS, MCP_IDS = _ids()


def test_there_are_at_least_300_bad_inputs() -> None:
    assert len(CLI_IDS) + len(MCP_IDS) >= 300, (len(CLI_IDS), len(MCP_IDS))
    assert len(set(CLI_IDS)) == len(CLI_IDS) and len(set(MCP_IDS)) == len(MCP_IDS)


@pytest.mark.parametrize("case_id", CLI_IDS)
def test_cli_answers_every_bad_input_with_exit_2_and_one_json_error(sandbox, case_id: str) -> None:
    box, all_cases = sandbox
    case = next(c for c in all_cases if c.id == case_id)
    outcome = bad_inputs.run_cli_inprocess(case, box)
    assert outcome.held, outcome.detail


def test_cli_subprocess_sample_exits_2_with_one_json_object(sandbox) -> None:
    box, all_cases = sandbox
    sample = [c for c in all_cases if c.cli is not None][::25]
    assert len(sample) >= 8
    failures = [o for o in (bad_inputs.run_cli_subprocess(c, box) for c in sample) if not o.held]
    assert not failures, [(o.case, o.detail) for o in failures]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_mcp_server_answers_every_bad_input_and_keeps_answering(sandbox) -> None:
    box, all_cases = sandbox
    normal = ("validate_config", {"config": str(box / "good.yaml")})
    async with Client(bad_inputs.server_params(box)) as client:
        outcomes = await bad_inputs.run_mcp_cases(client, all_cases, normal)
    assert len(outcomes) == len(MCP_IDS)
    failed = [(o.case, o.detail) for o in outcomes if not o.held]
    assert not failed, failed


@pytest.mark.anyio
async def test_mcp_errors_carry_the_same_text_as_the_cli(sandbox) -> None:
    box, all_cases = sandbox
    sample = [
        c
        for c in all_cases
        if c.id.startswith("validate:") and c.cli and c.mcp and "link" not in c.id and not c.id.startswith("validate:/")
    ]
    assert len(sample) >= 30
    async with Client(bad_inputs.server_params(box)) as client:
        for case in sample:
            result = await client.call_tool(*case.mcp)
            text = result.content[0].text
            assert result.is_error
            out = StringIO()
            with redirect_stdout(out), redirect_stderr(StringIO()), pytest.raises(SystemExit):
                main([*case.cli, "--json"])
            error = json.loads(out.getvalue())["error"]
            assert text.endswith(error), (case.id, text, error)


@pytest.mark.anyio
async def test_mcp_server_answers_while_calls_on_fifos_run_concurrently(sandbox) -> None:
    import anyio

    box, _ = sandbox
    results: list = []
    async with Client(bad_inputs.server_params(box)) as client:

        async def call(args: dict) -> None:
            results.append(await client.call_tool("validate_config", args))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                for _ in range(12):  # more than the worker pool
                    group.start_soon(call, {"config": str(box / "fifo.yaml")})
                group.start_soon(call, {"config": str(box / "good.yaml")})
    assert len(results) == 13
    assert sum(r.is_error for r in results) == 12


def test_the_sandbox_outside_is_not_touched_by_cwd_relative_writes(sandbox) -> None:
    box, _ = sandbox
    assert not (box.parent / "escaped.yaml").exists()
    assert not Path("/etc/mbridge-offload-robustness.yaml").exists()
    assert os.access(box / "good.yaml", os.R_OK)
