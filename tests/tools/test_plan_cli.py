"""``estimate`` / ``recommend`` / ``calibrate`` on the command line: the JSON contract, exit codes, human tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mbridge_offload_tools.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
QWEN_RUN = [
    "--model",
    "qwen3-30b-a3b",
    "--num-gpus",
    "16",
    "--tp",
    "2",
    "--pp",
    "2",
    "--ep",
    "4",
    "--etp",
    "1",
    "--global-batch-size",
    "8",
]
QWEN = [*QWEN_RUN, "--gpu", "h100-80gb"]


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run one subcommand in-process through the real entry point (bad input → exit 2 with one line)."""
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    out = capsys.readouterr()
    return int(stop.value.code or 0), out.out, out.err


def test_estimate_json_has_the_contract_keys(capsys):
    code, out, _ = run(["estimate", *QWEN_RUN, "--gpu", "h200-141gb", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert set(data["memory_gb"]) >= {"weights", "gradients", "optimizer", "activations", "other", "total"}
    assert {"host_gb", "offloaded_fraction", "step_time_factor", "step_time_factor_vs_no_levers", "fits"} <= set(data)
    assert data["fits"] is True and data["offloaded_fraction"] == 0.0
    # No offload: step_time_factor (over the run as given with its offload off) is 1.0. The recipe's full recompute
    # shows in the factor over the same run without any lever.
    time_s = data["time_s"]
    assert data["step_time_factor"] == 1.0 and time_s["step"] == time_s["without_offload"]
    assert data["step_time_factor_vs_no_levers"] == pytest.approx(time_s["step"] / time_s["baseline"], abs=2e-3)
    assert data["step_time_factor_vs_no_levers"] > 1.2 and time_s["recompute"] > 0
    parts = sum(v for k, v in data["memory_gb"].items() if k != "total")
    assert parts == pytest.approx(data["memory_gb"]["total"], abs=0.01)


@pytest.mark.parametrize("fraction,measured", [(0.25, 3.8), (0.5, 7.6), (0.75, 11.6), (1.0, 15.2)])
def test_estimate_predicts_upstream_qwen3_savings(capsys, fraction, measured):
    # The card's figures come from Megatron's memory report: GiB.
    _, base, _ = run(["estimate", *QWEN, "--json"], capsys)
    _, off, _ = run(["estimate", *QWEN, "--optimizer-offload-fraction", str(fraction), "--json"], capsys)
    saved = json.loads(base)["memory_gib"]["total"] - json.loads(off)["memory_gib"]["total"]
    assert saved == pytest.approx(measured, rel=0.15)
    assert json.loads(off)["offloaded_fraction"] >= fraction
    assert json.loads(off)["host_gb"] > 0


def test_recommend_json_for_qwen_on_h100_is_none_as_upstream_ran_it(capsys):
    code, out, _ = run(["recommend", *QWEN, "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert {"mode", "overrides", "memory_gb", "fits", "step_time_factor", "rationale"} <= set(data)
    assert data["mode"] == "none" and data["fits"] and data["overrides"] == []
    assert {"before", "after"} <= set(data["memory_gb"])  # and without_offload
    assert data["step_time_factor"] == 1.0  # no change: the config as given
    assert data["step_time_factor_vs_no_levers"] > 1.2  # the recipe's full recompute, a lever, has its cost
    # On a 48 GB GPU the same run needs optimizer offload.
    code, out, _ = run(["recommend", *QWEN_RUN, "--gpu-memory-gb", "48", "--json"], capsys)
    data = json.loads(out)
    assert data["mode"] == "optimizer" and data["fits"] and data["step_time_factor"] > 1
    assert any(o.startswith("optimizer.optimizer_offload_fraction=") for o in data["overrides"])


def test_recommend_reads_a_bridge_yaml(capsys):
    code, out, _ = run(
        [
            "recommend",
            str(ROOT / "examples/qwen3_30b_a3b_pretrain.yaml"),
            "--num-gpus",
            "16",
            "--gpu-memory-gb",
            "48",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    assert json.loads(out)["mode"] == "optimizer"


def test_recommend_none_for_a_fitting_config(capsys):
    code, out, _ = run(["recommend", "--model", "qwen3-0.6b", "--num-gpus", "1", "--json"], capsys)
    assert code == 0 and json.loads(out)["mode"] == "none" and json.loads(out)["overrides"] == []


def test_recommend_activation_for_small_model(capsys):
    code, out, _ = run(
        [
            "recommend",
            "--model",
            "qwen3-0.6b",
            "--num-gpus",
            "1",
            "--seq-length",
            "16384",
            "--micro-batch-size",
            "4",
            "--levers",  # offload only: with recompute allowed, full recompute is faster here (tests/plan/test_options)
            "activation,optimizer,fine-grained",
            "--json",
        ],
        capsys,
    )
    data = json.loads(out)
    assert code == 0
    assert data["mode"] == "activation"
    assert any(o.startswith("model.cpu_offloading_num_layers=") for o in data["overrides"])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "nope"], "unknown model preset 'nope'"),
        (
            ["--model", "llama3-8b", "--num-gpus", "0"],
            "--num-gpus = 0 (flag): input should be greater than or equal to 1",
        ),
        (
            ["--model", "llama3-8b", "--tp", "3", "--num-gpus", "3"],
            "num_attention_heads (32) must be a multiple of tensor_model_parallel_size (3)",
        ),
        (
            ["--model", "llama3-8b", "--optimizer-offload-fraction", "1.5"],
            "1.5 (flag): input should be less than or equal to 1",
        ),
        (["--model", "llama3-8b", "--num-gpus", "12", "--tp", "8"], "not divisible by TP·PP·CP = 8"),
        (["--model", "llama3-8b", "--gpu", "v100"], "unknown GPU preset 'v100'"),
        ([], "no model"),
    ],
)
@pytest.mark.parametrize("command", ["estimate", "recommend"])
def test_bad_input_exits_2_with_one_line(capsys, command, argv, message):
    code, out, err = run([command, *argv, "--json"], capsys)
    assert code == 2
    assert message in json.loads(out)["error"]
    assert err.count("\n") == 1 and message in err


def test_estimate_refuses_activation_offload_with_pp_but_recommend_replans(capsys):
    argv = ["--model", "llama3-8b", "--pp", "2", "--activation-offload-layers", "4", "--json"]
    code, out, _ = run(["estimate", *argv], capsys)
    assert code == 2 and "Pipeline parallelism" in json.loads(out)["error"]
    code, out, _ = run(["recommend", *argv], capsys)
    assert code == 0 and json.loads(out)["mode"] in ("none", "optimizer")


def test_human_output_is_a_table(capsys):
    code, out, _ = run(["estimate", *QWEN, "--optimizer-offload-fraction", "0.5"], capsys)
    assert code == 0
    for word in ("weights", "gradients", "optimizer", "activations", "total", "fits", "step time"):
        assert word in out
    code, out, _ = run(["recommend", *QWEN_RUN, "--gpu-memory-gb", "56"], capsys)
    assert "mode: optimizer" in out and "overrides:" in out and "->" in out


def test_estimate_and_recommend_never_import_torch():
    code = (
        "import sys\nfrom mbridge_offload_tools.cli import plan as cli_plan\nimport argparse\n"
        "p=argparse.ArgumentParser(); cli_plan.add_parsers(p.add_subparsers())\n"
        "for c in ('estimate','recommend'):\n"
        "    a=p.parse_args([c,'--model','llama3-8b','--json']); a.handler(a)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_calibrate_writes_a_named_host_profile_in_the_project(capsys, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    argv = ["calibrate", "--name", "box-1", "--numel", "262144", "--steps", "1", "--threads", "1", "--json"]
    code, out, _ = run(argv, capsys)
    assert code == 0
    target = tmp_path / ".mbridge-offload" / "host-profiles" / "box-1.json"
    stored = json.loads(target.read_text())
    assert stored["name"] == "box-1" and stored["threads"] == 1
    assert stored["cpu_adam_params_per_s_per_core"] > 1e6
    assert stored["torch_version"] and stored["measured_at"] and "cpu_model" in stored
    assert json.loads(out)["path"] == str(target)
    # Used only when named: by its name, from the project.
    code, out, _ = run(["estimate", "--model", "llama3-8b", "--host-profile", "box-1", "--json"], capsys)
    (rate,) = [a for a in json.loads(out)["assumptions"] if a["name"] == "cpu_adam_params_per_s_per_core"]
    assert code == 0 and rate["source"] == "host-profile" and rate["value"] == stored["cpu_adam_params_per_s_per_core"]


def test_calibrate_writes_to_output_and_refuses_a_bad_name_before_timing(capsys, tmp_path):
    pytest.importorskip("torch")
    target = tmp_path / "profiles" / "cal.json"
    argv = ["calibrate", "--output", str(target), "--numel", "262144", "--steps", "1", "--threads", "1", "--json"]
    code, out, _ = run(argv, capsys)
    assert code == 0 and json.loads(out)["path"] == str(target)
    assert json.loads(target.read_text())["cpu_adam_params_per_s_per_core"] > 1e6
    done = subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools", "calibrate", "--name", "../x", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "not a plain name" in json.loads(done.stdout)["error"]
    assert "Traceback" not in done.stderr and not (tmp_path / ".mbridge-offload").exists()


def test_main_cli_registers_plan_subcommands():
    done = subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools", "estimate", "--model", "llama3-8b", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "ModuleNotFoundError" in done.stderr:
        pytest.skip("another subcommand module of mbridge_offload_tools.cli.main is not present yet")
    assert done.returncode == 0, done.stderr
    assert "memory_gb" in json.loads(done.stdout)


def test_unreadable_measured_logs_and_host_profiles_exit_2_with_one_json_error(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    cases = [
        ("--measured-log", str(tmp_path / "fifo"), "FIFO"),
        ("--measured-log", "/dev/zero", "character device"),
        ("--measured-log", str(tmp_path / "missing.log"), "no such file"),
        ("--host-profile", str(tmp_path / "fifo"), "FIFO"),
        ("--host-profile", "no-such-profile", "calibrate --name no-such-profile"),
    ]
    for flag, value, words in cases:
        done = subprocess.run(
            [sys.executable, "-m", "mbridge_offload_tools", "estimate", "--model", "llama3-8b", flag, value, "--json"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, (flag, value, done.stderr)
        (error,) = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        assert error["ok"] is False and words in error["error"], (flag, value, error)
        assert "Traceback" not in done.stderr
