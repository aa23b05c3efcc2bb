"""Fault injection for apply's writes: ENOSPC, kill -9 mid-write, read-only targets, symlinks, races, and
byte-identical round trips. Real files in tmp_path; the faults are injected at the write call."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mbridge_offload.actions import safe_write
from mbridge_offload.actions.apply.apply import apply_offload
from mbridge_offload.actions.apply.result import ApplyResult
from mbridge_offload.actions.safe_write import WriteError
from mbridge_offload.config.errors import InputError
from tests.support import tree

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """\
# Bridge-style config (as a user keeps it)
model:
  num_layers: 8   # decoder layers
  hidden_size: 1024
  gradient_accumulation_fusion: False
  tp_comm_overlap_cfg:
  apply_query_key_layer_scaling: True
  recompute_modules: [core_attn]
  rotary_base: 10000.0
optimizer:
  optimizer: 'adam'
  lr: 3.0e-4
  use_distributed_optimizer: yes
"""


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp") or ".bak" in p.name)


@pytest.fixture
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG, encoding="utf-8")
    path.chmod(0o640)
    return path


def test_untouched_bytes_stay_identical(config_file: Path) -> None:
    result = apply_offload(str(config_file), "optimizer", fraction=0.75, in_place=True)
    new = config_file.read_text(encoding="utf-8")
    old_lines, new_lines = CONFIG.splitlines(), new.splitlines()
    assert [line for line in old_lines if line not in new_lines] == []  # no line of the user's rewritten
    added = [line for line in new_lines if line not in old_lines]
    assert sorted(added) == sorted(
        [
            "  optimizer_cpu_offload: true",
            "  optimizer_offload_fraction: 0.75",
            "  overlap_cpu_optimizer_d2h_h2d: true",
        ]
    )
    assert "gradient_accumulation_fusion: False" in new and "tp_comm_overlap_cfg:\n" in new
    assert Path(result.backup).read_text(encoding="utf-8") == CONFIG


def test_a_comment_only_or_empty_yaml_stays_yaml_with_its_comments(tmp_path: Path) -> None:
    for text in ("# only a comment\n# and another\n", ""):
        path = tmp_path / "c.yaml"
        path.write_text(text, encoding="utf-8")
        out = tmp_path / "out.yaml"
        out.unlink(missing_ok=True)
        apply_offload(str(path), "optimizer", output=out)
        written = out.read_text(encoding="utf-8")
        assert written.startswith(text) and not written.lstrip().startswith("{")
        assert "optimizer:\n  optimizer_cpu_offload: true\n" in written


def test_an_existing_output_is_refused_without_force_and_backed_up_with_it(config_file: Path) -> None:
    out = config_file.parent / "README.md"
    out.write_text("# keep me\n", encoding="utf-8")
    with pytest.raises(WriteError, match="exists; nothing written"):
        apply_offload(str(config_file), "optimizer", output=out)
    assert out.read_text() == "# keep me\n" and _leftovers(config_file.parent) == []
    result = apply_offload(str(config_file), "optimizer", output=out, overwrite=True)
    assert Path(result.backup).read_text() == "# keep me\n" and result.written == str(out)


def test_output_equal_to_the_input_counts_as_in_place(config_file: Path) -> None:
    with pytest.raises(WriteError, match="exists"):
        apply_offload(str(config_file), "optimizer", output=str(config_file))
    assert config_file.read_text() == CONFIG
    result = apply_offload(str(config_file), "optimizer", output=str(config_file), overwrite=True)
    assert result.backup and Path(result.backup).read_text() == CONFIG


def test_backups_are_never_clobbered(config_file: Path) -> None:
    (config_file.parent / "run.yaml.bak").write_text("an older backup\n")
    first = apply_offload(str(config_file), "optimizer", fraction=0.25, in_place=True)
    second = apply_offload(str(config_file), "optimizer", fraction=0.5, in_place=True)
    assert (config_file.parent / "run.yaml.bak").read_text() == "an older backup\n"
    assert len({first.backup, second.backup}) == 2
    assert Path(first.backup).read_text() == CONFIG


def test_mode_is_kept_and_new_files_follow_the_umask(config_file: Path) -> None:
    apply_offload(str(config_file), "optimizer", in_place=True)
    assert stat.S_IMODE(config_file.stat().st_mode) == 0o640
    out = config_file.parent / "new.yaml"
    old = os.umask(0o022)
    try:
        apply_offload(str(config_file), "none", output=out)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


def test_a_read_only_target_is_refused_even_with_force(config_file: Path) -> None:
    config_file.chmod(0o444)
    with pytest.raises(WriteError, match="read-only"):
        apply_offload(str(config_file), "optimizer", in_place=True)
    out = config_file.parent / "ro.yaml"
    out.write_text("x: 1\n")
    out.chmod(0o444)
    with pytest.raises(WriteError, match="read-only"):
        apply_offload(str(config_file), "optimizer", output=out, overwrite=True)
    assert config_file.read_text() == CONFIG and out.read_text() == "x: 1\n"
    assert _leftovers(config_file.parent) == []


def test_a_symlink_stays_a_link_and_its_target_is_edited(config_file: Path) -> None:
    link = config_file.parent / "link.yaml"
    link.symlink_to(config_file.name)
    result = apply_offload(str(link), "optimizer", in_place=True)
    assert link.is_symlink() and os.readlink(link) == config_file.name
    assert "optimizer_cpu_offload: true" in config_file.read_text()
    assert Path(result.backup).read_text() == CONFIG and stat.S_IMODE(config_file.stat().st_mode) == 0o640


def test_a_link_that_leads_outside_the_allowed_roots_is_refused(tmp_path: Path, config_file: Path) -> None:
    elsewhere = tmp_path.parent / f"{tmp_path.name}-out"
    elsewhere.mkdir()
    victim = elsewhere / "victim.yaml"
    victim.write_text(CONFIG)
    link = config_file.parent / "sneaky.yaml"
    link.symlink_to(victim)
    with pytest.raises(InputError, match="outside the directories"):
        apply_offload(str(config_file), "optimizer", output=link, overwrite=True)
    assert victim.read_text() == CONFIG


@pytest.mark.parametrize("failing_call", [1, 2])
def test_enospc_at_the_backup_or_the_write_changes_nothing_and_leaves_nothing(
    config_file: Path, monkeypatch: pytest.MonkeyPatch, failing_call: int
) -> None:
    real_write, calls = os.write, []

    def full_disk(fd: int, data) -> int:
        calls.append(fd)
        if len(calls) == failing_call:  # 1: the backup's first write; 2: the new file's first write
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(safe_write.os, "write", full_disk)
    with pytest.raises(WriteError, match="No space left on device"):
        apply_offload(str(config_file), "optimizer", in_place=True)
    assert config_file.read_text() == CONFIG
    assert _leftovers(config_file.parent) == []


def test_an_exception_mid_write_leaves_no_temp_file(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(safe_write.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        safe_write.atomic_write(config_file, "x: 1\n")
    assert config_file.read_text() == CONFIG and _leftovers(config_file.parent) == []


def test_a_read_only_directory_fails_cleanly(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(safe_write.tempfile, "mkstemp", refuse)
    with pytest.raises(WriteError, match="cannot write there"):
        apply_offload(str(config_file), "optimizer", output=config_file.parent / "new.yaml")
    assert _leftovers(config_file.parent) == [] and not (config_file.parent / "new.yaml").exists()


_SLOW_WRITER = """
import os, sys, time
from mbridge_offload.actions import safe_write
real = os.write
def slow(fd, data):
    n = real(fd, bytes(data)[: len(data) // 2])
    sys.stdout.write("half\\n"); sys.stdout.flush()
    time.sleep(60)
    return n
safe_write.os.write = slow
safe_write.atomic_write(sys.argv[1], "model:\\n  num_layers: 2\\n" * 1000)
"""


def test_kill_9_mid_write_keeps_the_original_and_the_next_write_removes_the_stray_temp(config_file: Path) -> None:
    env = dict(os.environ, PYTHONPATH=tree.pythonpath())
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_WRITER, str(config_file)], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "half"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert config_file.read_text() == CONFIG  # the original is intact
    stray = [p for p in config_file.parent.iterdir() if p.name.endswith(".tmp")]
    assert len(stray) == 1 and str(proc.pid) in stray[0].name  # a kill runs no cleanup ...
    apply_offload(str(config_file), "optimizer", in_place=True)
    assert [p for p in config_file.parent.iterdir() if p.name.endswith(".tmp")] == []  # ... the next write does


def test_concurrent_applies_never_share_a_backup_and_leave_no_temp(config_file: Path) -> None:
    results: list[ApplyResult] = []
    errors: list[BaseException] = []
    fractions = [0.1, 0.2, 0.3, 0.4, 0.6, 0.7, 0.8, 0.9]

    def run(fraction: float) -> None:
        try:
            results.append(apply_offload(str(config_file), "optimizer", fraction=fraction, in_place=True))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(f,)) for f in fractions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    backups = [r.backup for r in results if r.backup]
    assert len(backups) == len(set(backups)) == len(fractions)
    assert [p for p in config_file.parent.iterdir() if p.name.endswith(".tmp")] == []
    final = config_file.read_text()
    assert any(f"optimizer_offload_fraction: {f}" in final for f in fractions)
    time.sleep(0)


def test_concurrent_cli_processes_never_share_a_backup(config_file: Path) -> None:
    env = dict(os.environ, PYTHONPATH=tree.pythonpath())
    fractions = ["0.2", "0.4", "0.6", "0.8"]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mbridge_offload_tools",
                "apply",
                str(config_file),
                "--mode",
                "optimizer",
                "--fraction",
                f,
                "--in-place",
                "--json",
            ],
            cwd=config_file.parent,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for f in fractions
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), outputs
    backups = [json.loads(out)["backup"] for out, _ in outputs]
    assert len(set(backups)) == len(fractions) and all(Path(b).is_file() for b in backups)
    assert [p for p in config_file.parent.iterdir() if p.name.endswith(".tmp")] == []
