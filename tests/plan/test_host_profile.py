"""Host profiles: named, read through the bounded reader, used only when the caller names them (never from HOME)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mbridge_offload.config.errors import InputError
from mbridge_offload.config.reading import set_read_roots
from mbridge_offload.plan.service import plan
from mbridge_offload.plan.time import host_profile

ROOT = Path(__file__).resolve().parents[2]
LLAMA = {"model": "llama3-8b", "gpu": "h100-80gb", "optimizer_offload_fraction": 1.0}


def _profile(path: Path, rate: float = 5.0e7, name: str = "slow-box") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"name": name, "cpu_model": "Test CPU", "threads": 4, "torch_version": "2.13.0", "measured_at": "2026-12-01"}
    path.write_text(json.dumps({**data, "cpu_adam_params_per_s_per_core": rate}))
    return path


def _rate(answer) -> dict:
    (rate,) = [a for a in answer.assumptions if a.name == "cpu_adam_params_per_s_per_core"]
    return rate.model_dump()


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    set_read_roots(None)


def test_a_named_profile_is_found_in_the_project_and_changes_the_step_time(project):
    _profile(host_profile.default_path("slow-box", project))
    without = plan("estimate", dict(LLAMA))
    named = plan("estimate", {**LLAMA, "host_profile": "slow-box"})
    assert _rate(without)["source"] == "preset"
    rate = _rate(named)
    assert rate["source"] == "host-profile" and rate["value"] == 5.0e7
    assert "'slow-box' (Test CPU, 4 threads, torch 2.13.0, 2026-12-01)" in rate["note"]
    assert str(project / ".mbridge-offload/host-profiles/slow-box.json") in rate["note"]
    assert named.step_time_factor > without.step_time_factor  # a slow CPU makes the offloaded step slower


def test_a_profile_file_and_the_old_calibration_name_are_the_same_input(project):
    path = _profile(project / "elsewhere" / "p.json", rate=8.0e7)
    by_file = plan("estimate", {**LLAMA, "host_profile": str(path)})
    by_old_name = plan("estimate", {**LLAMA, "calibration": str(path)})
    assert _rate(by_file)["value"] == _rate(by_old_name)["value"] == 8.0e7
    assert by_file.step_time_factor == by_old_name.step_time_factor


def test_a_flag_rate_wins_over_a_named_profile(project):
    _profile(host_profile.default_path("slow-box", project))
    answer = plan("estimate", {**LLAMA, "host_profile": "slow-box", "cpu_adam_params_per_s": 1.0e9})
    assert _rate(answer)["source"] == "flag" and _rate(answer)["value"] == 1.0e9


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{not json", "not a JSON host profile"),
        ('{"cpu_adam_params_per_s_per_core": -1}', "not a positive number"),
        ('{"cpu_adam_params_per_s_per_core": NaN}', "not a positive number"),
        ('{"cpu_adam_params_per_s_per_core": "fast"}', "not a positive number"),
        ("[]", "not a positive number"),
    ],
)
def test_a_broken_profile_is_refused_not_ignored(project, content, words):
    (project / "p.json").write_text(content)
    with pytest.raises(InputError, match=words):
        plan("estimate", {**LLAMA, "host_profile": str(project / "p.json")})


def test_an_unknown_name_says_where_it_looked_and_how_to_make_it(project):
    with pytest.raises(InputError, match=r"no nope\.json in .*host-profiles; run `mbridge-offload calibrate --name"):
        plan("estimate", {**LLAMA, "host_profile": "nope"})


def test_profile_reads_are_bounded_and_confined(project, tmp_path_factory):
    os.mkfifo(project / "fifo.json")
    with pytest.raises(InputError, match="FIFO"):
        plan("estimate", {**LLAMA, "host_profile": str(project / "fifo.json")})
    with pytest.raises(InputError, match="character device"):
        plan("estimate", {**LLAMA, "host_profile": "/dev/zero"})
    huge = project / "huge.json"
    with huge.open("wb") as f:
        f.truncate(64 * 1024 * 1024)  # sparse: large on paper, nothing on disk
    with pytest.raises(InputError, match="over the"):
        plan("estimate", {**LLAMA, "host_profile": str(huge)})
    outside = _profile(tmp_path_factory.mktemp("outside") / "p.json")
    set_read_roots([project])
    with pytest.raises(InputError, match="outside the directories"):
        plan("estimate", {**LLAMA, "host_profile": str(outside)})
    link = project / "link.json"
    link.symlink_to(outside)  # a link inside the root that points out is judged by its target
    with pytest.raises(InputError, match="outside the directories"):
        plan("estimate", {**LLAMA, "host_profile": str(link)})


def test_a_calibration_in_the_old_home_location_changes_nothing(tmp_path):
    # What `calibrate` wrote before profiles were named, and the variable that pointed at it: neither is read now.
    home = tmp_path / "home"
    _profile(home / ".cache" / "mbridge-offload" / "calibration.json", rate=1.0)
    _profile(home / ".config" / "mbridge-offload" / "calibration.json", rate=1.0)
    args = ["estimate", "--model", "llama3-8b", "--gpu", "h100-80gb", "--optimizer-offload-fraction", "1", "--json"]

    def factor(env_home: Path, extra: dict[str, str]) -> tuple[float, str]:
        env = {**os.environ, "HOME": str(env_home), "XDG_CACHE_HOME": str(env_home / ".cache"), **extra}
        env["XDG_CONFIG_HOME"] = str(env_home / ".config")
        done = subprocess.run(
            [sys.executable, "-m", "mbridge_offload_tools", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        (rate,) = [a for a in answer["assumptions"] if a["name"] == "cpu_adam_params_per_s_per_core"]
        return answer["step_time_factor"], rate["source"]

    empty = tmp_path / "empty-home"
    empty.mkdir()
    clean = factor(empty, {})
    stale = factor(home, {"MBRIDGE_OFFLOAD_CALIBRATION": str(home / ".cache/mbridge-offload/calibration.json")})
    assert stale == clean and clean[1] == "preset"
