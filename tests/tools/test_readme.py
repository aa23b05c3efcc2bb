"""README's commands run as written after ``make run``, and what it says CI runs is what ``.ci/run`` runs."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import tree

ROOT = tree.ROOT
README = (ROOT / "README.md").read_text(encoding="utf-8")
# What `make run` leaves behind that a reader may call by path (nothing goes on PATH).
EXECUTABLES = (".venv/bin/mbridge-offload", ".venv/bin/mbridge-offload-mcp", "scripts/mbridge-offload")
# Commands that start a server or a long job: checked with --help instead of run.
_HELP_ONLY = {"serve", "test", "calibrate"}


def _fenced_commands(text: str) -> list[str]:
    """Every command line in the bash blocks of ``text`` (comments and blank lines dropped)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced and line.strip() in ("```bash", "```sh", "```")
            continue
        if fenced and line.strip() and not line.strip().startswith("#"):
            lines.append(line.strip())
    return lines


def _tool_commands() -> list[list[str]]:
    return [
        shlex.split(c, comments=True)
        for c in _fenced_commands(README)
        if shlex.split(c, comments=True)[0].endswith(("mbridge-offload", "mbridge-offload-mcp"))
    ]


def test_readme_calls_the_cli_by_a_path_that_exists_after_make_run() -> None:
    commands = _tool_commands()
    assert len(commands) >= 6
    for argv in commands:
        assert argv[0] in EXECUTABLES, f"`{shlex.join(argv)}`: {argv[0]} is not on PATH after make run"
        assert (ROOT / argv[0]).is_file() and os.access(ROOT / argv[0], os.X_OK), argv[0]


def test_a_bare_command_is_caught() -> None:
    text = "```bash\nmbridge-offload validate x.yaml\n```\n"
    assert shlex.split(_fenced_commands(text)[0])[0] not in EXECUTABLES


@pytest.mark.parametrize("argv", _tool_commands(), ids=lambda a: " ".join(a[1:3]))
def test_each_readme_command_runs_as_written(argv: list[str], tmp_path: Path) -> None:
    # In a scratch folder holding the bundled config as my_run.yaml (the reader's own config), the examples and
    # the two launchers, so that writes land in tmp_path and never in the checkout.
    shutil.copy(ROOT / "examples" / "qwen3_30b_a3b_pretrain.yaml", tmp_path / "my_run.yaml")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    run = [str(ROOT / argv[0]), *argv[1:]]
    if argv[0].endswith("mbridge-offload-mcp") or argv[1] in _HELP_ONLY:
        run = [str(ROOT / argv[0]), *(argv[1:2] if argv[0].endswith("mbridge-offload") else []), "--help"]
    done = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert done.returncode in (0, 1), f"`{shlex.join(argv)}` exits {done.returncode}: {done.stderr[-800:]}"
    assert "Traceback" not in done.stderr


def _ci_steps(script: str) -> list[str]:
    """The make targets ``.ci/run`` always runs, in order (a trailing comment allowed; the opt-in step not)."""
    return re.findall(r"^make ([\w-]+)\s*(?:#.*)?$", script, re.M)


def test_readme_says_what_ci_runs() -> None:
    from mbridge_offload_tools.docgen.references import number_word

    targets = _ci_steps((ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    assert targets == ["lint", "test", "test-bridge"], targets
    sentence = " ".join(README.split("CI (`.ci/run`)", 1)[1].split("\n\n", 1)[0].split())
    assert f"runs {number_word(len(targets))} steps" in sentence, sentence
    named = re.findall(r"`make ([\w-]+)`", sentence)
    assert named == targets, (named, targets)


def test_the_ci_steps_are_read_with_their_comments() -> None:
    script = "set -e\nmake lint  # ruff\nmake test\n    timeout 1800 make check-hosts\n"
    assert _ci_steps(script) == ["lint", "test"]
