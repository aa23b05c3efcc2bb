"""One error shape: a failure while handling a call → one JSON object and exit 2 (bad input) or 3 (a bug of ours,
``kind: "internal"``); MCP isError with the same text. Never a traceback."""

from __future__ import annotations

import json
from contextlib import redirect_stderr, redirect_stdout
from io import StringIO
from pathlib import Path

import pytest
from mcp import Client

from mbridge_offload.config import validate as validate_module
from mbridge_offload_tools.cli.main import main
from mbridge_offload_tools.server.app import mcp

FAILURES = [
    RecursionError("maximum recursion depth exceeded"),
    ZeroDivisionError("division by zero"),
    OverflowError("int too large to convert to float"),
    IsADirectoryError(21, "Is a directory", "/x"),
    PermissionError(13, "Permission denied", "/x"),
    UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
    MemoryError(),
]
BUGS = [
    RuntimeError("an unexpected bug"),
    AttributeError("'NoneType' object has no attribute 'layers'"),
    TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'"),
    KeyError("num_layers"),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = StringIO(), StringIO()
    with redirect_stdout(out), redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, out.getvalue(), err.getvalue()


@pytest.mark.anyio
@pytest.mark.parametrize("failure", FAILURES, ids=lambda e: type(e).__name__)
async def test_any_failure_is_exit_2_with_one_json_error_and_the_same_text_over_mcp(
    failure: BaseException, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  num_layers: 4\n")
    monkeypatch.chdir(tmp_path)

    def broken(*args, **kwargs):
        raise failure

    monkeypatch.setattr(validate_module, "validate", broken)
    code, out, err = _cli(["validate", str(config), "--json"])
    assert code == 2 and "Traceback" not in out + err
    payload = json.loads(out)  # exactly one JSON object
    assert payload["ok"] is False and payload["error"]
    human_code, human_out, human_err = _cli(["validate", str(config)])
    assert human_code == 2 and human_out == "" and human_err.count("\n") == 1  # one clean line without --json
    async with Client(mcp) as client:
        result = await client.call_tool("validate_config", {"config": str(config)})
    assert result.is_error and "Traceback" not in result.content[0].text
    assert result.content[0].text.endswith(payload["error"])


@pytest.mark.anyio
@pytest.mark.parametrize("bug", BUGS, ids=lambda e: type(e).__name__)
async def test_a_bug_is_reported_as_an_internal_error_with_exit_3_not_as_bad_input(
    bug: BaseException, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  num_layers: 4\n")
    monkeypatch.chdir(tmp_path)

    def broken(*args, **kwargs):
        raise bug

    monkeypatch.setattr(validate_module, "validate", broken)
    code, out, err = _cli(["validate", str(config), "--json"])
    assert code == 3 and "Traceback" not in out + err
    payload = json.loads(out)  # exactly one JSON object, kind named
    assert payload["ok"] is False and payload["kind"] == "internal" and "internal error" in payload["error"]
    assert type(bug).__name__ in payload["error"] and "check the input" not in payload["error"]
    async with Client(mcp) as client:
        result = await client.call_tool("validate_config", {"config": str(config)})
    assert result.is_error and "Traceback" not in result.content[0].text
    assert result.content[0].text.endswith(payload["error"])
