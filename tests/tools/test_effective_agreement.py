"""One effective config: validate, estimate, recommend and diagnose read the same input the same way.

A differential test over generated configs (``tests/support/config_gen.py``: Bridge YAML, Hydra ``--set`` overrides,
Megatron-LM argv) and Bridge 0.6.2's own run_config.yaml fixtures: the ``effective`` block each tool prints is
identical, and the per-GPU memory agrees (estimate's total, recommend's ``before`` total, diagnose's comparison).
Then the issue's case end to end through the real CLI and the real MCP server.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from ruamel.yaml import YAML

from mbridge_offload.actions.diagnose.diagnose import diagnose
from mbridge_offload.config import sources
from mbridge_offload.config.errors import BoundsError as InputError
from mbridge_offload.config.validate import validate
from mbridge_offload.plan.service import plan
from tests.support import config_gen, tree

ROOT = Path(__file__).resolve().parents[2]
PERF = ROOT / "tests" / "data" / "bridge-0.6.2" / "perf"
EXAMPLE = ROOT / "examples" / "qwen3_30b_a3b_pretrain.yaml"
FLAGS = {"gpu": "h100-80gb"}  # the same planner flags for every tool that takes them


def _answers(loaded: sources.LoadedConfig) -> dict[str, Any] | None:
    """Each tool's ``effective`` block and memory total for one loaded config; None when the planner refuses it."""
    cfg, raw, src = loaded.config, loaded.raw, loaded.source
    blocks = {"validate": validate(cfg, raw, source=src).to_dict()["effective"]}
    try:
        est = plan("estimate", dict(FLAGS), cfg, raw, src)
        rec = plan("recommend", dict(FLAGS), cfg, raw, src)
    except (InputError, ValueError, KeyError):
        return None  # no model sizes, a setup megatron-core rejects: no memory to compare (validate still answers)
    blocks["estimate"] = est.model_dump(mode="json")["effective"]
    blocks["recommend"] = rec.model_dump(mode="json")["effective"]
    blocks["diagnose"] = diagnose(config=cfg, raw=raw, source=src).model_dump(mode="json")["effective"]
    compared = diagnose(before=loaded, after=loaded).comparison or {}
    totals = {
        "estimate": est.memory_gib.total,
        "recommend": rec.memory_gib.before.total,
        "diagnose": compared.get("memory_gib", {}).get("before", {}).get("total"),
    }
    return {"blocks": blocks, "totals": totals}


def _assert_agree(name: str, got: dict[str, Any]) -> None:
    blocks = got["blocks"]
    for tool, block in blocks.items():
        assert block == blocks["validate"], f"{name}: {tool}'s effective differs from validate's"
    assert blocks["validate"], name
    totals = got["totals"]
    assert totals["estimate"] == totals["recommend"] == totals["diagnose"], f"{name}: {totals}"


def _yaml_text(raw: dict[str, Any]) -> str:
    import io

    out = io.StringIO()
    YAML(typ="safe", pure=True).dump(raw, out)
    return out.getvalue()


def _load_generated(case: dict[str, Any], tmp_path: Path) -> sources.LoadedConfig:
    """A generated case as a Bridge YAML file, or its model section as a file and the rest as ``--set`` overrides."""
    raw = config_gen.planner_raw(case)
    path = tmp_path / f"case{case['id']}.yaml"
    if case["source"] != "overrides":
        path.write_text(_yaml_text(raw))
        return sources.load(str(path))
    path.write_text(_yaml_text({"model": raw.pop("model")}))
    overrides = [
        f"+{section}.{key}={config_gen._override_value(value)}"
        for section, body in raw.items()
        for key, value in body.items()
    ]
    return sources.load(str(path), overrides)


def test_every_tool_prints_the_same_effective_config_and_memory_for_generated_configs(tmp_path: Path) -> None:
    rng = random.Random(24)
    compared, kinds = 0, set()
    for case in config_gen.generate(seed=2024, n=60):
        case = config_gen.planner_variant(rng, case)
        try:
            loaded = _load_generated(case, tmp_path)
        except sources.ConfigError:
            continue  # a type variant the reader refuses: exit 2 before any tool, nothing to compare
        got = _answers(loaded)
        if got is None:
            continue
        _assert_agree(f"case {case['id']} {case['perturbations']}", got)
        compared += 1
        kinds.add((case["source"] == "overrides", "_target_" in case["model"], "mixed_precision" in case))
    assert compared >= 20, f"only {compared} generated configs could be sized by the planner"
    assert len(kinds) >= 4, kinds  # files and --set, Bridge containers and plain configs, with and without a block


@pytest.mark.parametrize(
    "argv",
    [
        "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --vocab-size 32000 --seq-length 2048 --bf16 "
        "--use-distributed-optimizer --optimizer-cpu-offload --tensor-model-parallel-size 2",
        "--num-layers 4 --hidden-size 256 --num-attention-heads 4 --vocab-size 1000 --seq-length 1024 "
        "--pipeline-model-parallel-size 2 --recompute-activations",
        "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --vocab-size 32000 --seq-length 2048 --bf16 "
        "--cpu-offloading-num-layers 2 --micro-batch-size 2",
    ],
)
def test_every_tool_agrees_on_a_megatron_lm_command_line(argv: str) -> None:
    got = _answers(sources.load(argv=argv.split()))
    assert got is not None
    _assert_agree(argv, got)
    assert {v["source"] for v in got["blocks"]["validate"].values()} & {"argv"}


@pytest.mark.skipif(not PERF.is_dir(), reason="no Bridge 0.6.2 perf fixtures")
def test_every_tool_agrees_on_bridges_own_run_configs() -> None:
    compared = 0
    for path in sorted(PERF.glob("*_config.yaml"))[::3]:  # a spread of models, precisions and parallelisms
        got = _answers(sources.load(str(path)))
        if got is None:
            continue  # a GPU without a preset, a vocabulary only the tokenizer knows: said by the planner
        _assert_agree(path.name, got)
        compared += 1
    assert compared >= 3


def _qwen_without_etp(tmp_path: Path) -> Path:
    path = tmp_path / "qwen.yaml"
    lines = EXAMPLE.read_text().splitlines()
    path.write_text("\n".join(line for line in lines if "expert_tensor_parallel_size" not in line) + "\n")
    return path


def _cli(*args: str, cwd: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=tree.pythonpath(inherit=True))
    done = subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools", *args, "--json"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode in (0, 1), done.stderr
    return json.loads(done.stdout)


def test_the_qwen_bridge_yaml_without_etp_is_etp_1_in_every_cli_answer(tmp_path: Path) -> None:
    path = str(_qwen_without_etp(tmp_path))
    val = _cli("validate", path, cwd=tmp_path)
    est = _cli("estimate", path, "--gpu", "h100-80gb", cwd=tmp_path)
    rec = _cli("recommend", path, "--gpu", "h100-80gb", cwd=tmp_path)
    dia = _cli("diagnose", "--config", path, "--before", path, "--after", path, cwd=tmp_path)
    plot = _cli("plot", path, "--gpu", "h100-80gb", "--kind", "options", "--output", "o.svg", cwd=tmp_path)
    etp = {"value": 1, "source": "bridge finalize (0.6)"}
    for answer in (val, est, rec, dia, plot):
        assert answer["effective"]["model.expert_tensor_parallel_size"] == etp
        assert answer["effective"] == val["effective"]
    assert est["parallel"]["etp"] == 1  # the memory model uses it too
    before = dia["comparison"]["memory_gib"]["before"]["total"]
    assert est["memory_gib"]["total"] == rec["memory_gib"]["before"]["total"] == before == plot["given_gib"]
    # Written ETP 1 (the example) is the same run: the same GiB.
    assert _cli("estimate", str(EXAMPLE), "--gpu", "h100-80gb", cwd=tmp_path)["memory_gib"] == est["memory_gib"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_the_mcp_tools_print_the_cli_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mbridge_offload_tools.server.app import mcp

    monkeypatch.chdir(tmp_path)
    path = str(_qwen_without_etp(tmp_path))
    loaded = sources.load(path)
    expected = validate(loaded.config, loaded.raw, source=loaded.source).to_dict()["effective"]
    async with Client(mcp, raise_exceptions=True) as client:
        calls = {
            "validate_config": {"config": path},
            "estimate_memory": {"config": path, "gpu": "h100-80gb"},
            "recommend_mode": {"config": path, "gpu": "h100-80gb"},
            "diagnose_failure": {"config": path},
            "plot_offload": {"config": path, "gpu": "h100-80gb", "kind": "options"},
        }
        for tool, args in calls.items():
            result = await client.call_tool(tool, args)
            assert not result.is_error, tool
            assert result.structured_content["effective"] == expected, tool


def test_apply_prints_the_effective_config_of_the_file_it_would_write(tmp_path: Path) -> None:
    from mbridge_offload.actions.apply.apply import apply_offload

    path = _qwen_without_etp(tmp_path)
    result = apply_offload(str(path), "optimizer", fraction=0.25)
    edited = tmp_path / "edited.yaml"
    edited.write_text(result.text)
    loaded = sources.load(str(edited))
    expected = validate(loaded.config, loaded.raw, source=loaded.source).to_dict()["effective"]
    assert result.to_dict()["effective"] == expected
    assert expected["optimizer.optimizer_offload_fraction"] == {"value": 0.25, "source": "config"}
    assert expected["model.expert_tensor_parallel_size"] == {"value": 1, "source": "bridge finalize (0.6)"}


def test_recommends_catalogue_vetting_and_memory_model_see_the_same_etp(tmp_path: Path) -> None:
    import copy

    from mbridge_offload.plan.inputs.resolve import resolve

    loaded = sources.load(str(_qwen_without_etp(tmp_path)))
    r = resolve(dict(FLAGS), loaded.config, loaded.raw, loaded.source)
    assert r.raw_config is not None
    raw = copy.deepcopy(r.raw_config)  # what advice.Vetter validates, candidate overrides applied on top
    vetted = validate(sources.build_config(raw), raw, source=r.source)
    assert vetted.effective["model.expert_tensor_parallel_size"].value == r.setup.etp == 1
    etp = next(a for a in r.assumptions if a.name == "etp")
    assert (etp.source, etp.note) == ("config", "effective model.expert_tensor_parallel_size: bridge finalize (0.6)")
