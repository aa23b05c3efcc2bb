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
    from mbridge_offload_tools.docgen.skill.references import number_word

    targets = _ci_steps((ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    assert targets == ["lint", "test", "test-long", "test-bridge"], targets
    sentence = " ".join(README.split("CI (`.ci/run`)", 1)[1].split("\n\n", 1)[0].split())
    assert f"runs {number_word(len(targets))} steps" in sentence, sentence
    named = re.findall(r"`make ([\w-]+)`", sentence)
    assert named == targets, (named, targets)


def test_the_ci_steps_are_read_with_their_comments() -> None:
    script = "set -e\nmake lint  # ruff\nmake test\n    timeout 1800 make check-hosts\n"
    assert _ci_steps(script) == ["lint", "test"]


# ---------------------------------------------------------------------------------------------- the one set-up


def _venv_with(tmp_path: Path, python: str) -> Path:
    """A venv folder whose stamp says a full set-up of this checkout and whose python is ``python``."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(python)} "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    cksum = subprocess.run(["cksum"], stdin=(ROOT / "pyproject.toml").open("rb"), capture_output=True, timeout=30)
    (venv / ".mbridge-offload-setup").write_text(f"full {cksum.stdout.split()[0].decode()} {ROOT}\n")
    return venv


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="triton is installed on Linux only")
@pytest.mark.skipif(not (ROOT / ".mcore/0.19.2/megatron/core").is_dir(), reason="needs scripts/setup's .mcore/0.19.2")
def test_setup_check_wants_the_pinned_triton_that_megatron_core_0192_imports(tmp_path: Path) -> None:
    import sys

    from tests.support.skill_copy import base_python

    pin = re.search(r"^TRITON_VERSION=(\S+)$", (ROOT / "scripts" / "setup").read_text(), re.M)
    assert pin is not None
    check = [str(ROOT / "scripts" / "setup"), "--check", "--venv"]
    # This test venv has what scripts/setup installs, triton at the pin included.
    ok = subprocess.run([*check, str(_venv_with(tmp_path / "a", sys.executable))], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # A Python without triton: the same stamp is not enough, and the answer names what is missing.
    done = subprocess.run([*check, str(_venv_with(tmp_path / "b", base_python()))], capture_output=True, text=True)
    assert done.returncode == 3 and f"missing: triton=={pin.group(1)}" in done.stdout, done.stdout
    # The Makefile installs nothing that scripts/setup does not.
    recipe = (ROOT / "Makefile").read_text().split("$(VENV)/.ready:", 1)[1].split("\n\n", 1)[0]
    assert "pip install" not in recipe and "scripts/setup" in recipe


def _du(path: Path) -> float:
    """Bytes under ``path`` (symlinks followed at the top only), in GB."""
    total = 0
    for folder, _, files in os.walk(path.resolve()):
        total += sum(os.lstat(os.path.join(folder, f)).st_size for f in files)
    return total / 1e9


@pytest.mark.skipif(not (ROOT / ".venv" / "bin").is_dir(), reason="needs the set-up venv")
def test_readme_states_the_set_up_size_as_measured() -> None:
    claim = re.search(r"installs about ([\d.]+) GB:\s+`\.venv` ([\d.]+) GB, of which triton is ([\d.]+) GB", README)
    assert claim is not None
    total, venv, triton = (float(x) for x in claim.groups())
    site = next((ROOT / ".venv" / "lib").glob("python3*/site-packages"))
    measured = {"venv": _du(ROOT / ".venv"), "triton": _du(site / "triton")}
    measured["total"] = measured["venv"] + (_du(ROOT / ".mcore") if (ROOT / ".mcore").exists() else 0.0)
    # Within 25 %: a different platform's wheels differ a little; a stale claim (a dependency added or dropped) not.
    for name, said in (("total", total), ("venv", venv), ("triton", triton)):
        assert abs(measured[name] - said) <= 0.25 * said, (name, said, measured)
