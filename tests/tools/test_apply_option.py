"""``apply --option N`` / ``apply_offload(option=N)`` writes exactly recommend's option N: the same planner inputs
(evidence, levers, headroom, GPU, count) on both sides, generated from ``PlanInputs``; and one overlap rule everywhere
(an option at optimizer fraction >= 0.75 carries ``overlap_cpu_optimizer_d2h_h2d=true``, as apply and OPT-OVERLAP).

The CLI runs in-process through ``main()`` (its real parser and handlers), the MCP server through its in-memory
client.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mcp import Client

from mbridge_offload.actions.apply.plan import APPLY_OWN_INPUTS
from mbridge_offload.config import sources
from mbridge_offload.config.rules.optimizer.offload import OVERLAP_FROM_FRACTION
from mbridge_offload.plan.inputs.fields import FIELDS
from mbridge_offload_tools.cli.main import main
from mbridge_offload_tools.server.app import mcp
from tests.support.configs import LLAMA3_8B, bridge_yaml

ROOT = Path(__file__).resolve().parents[2]
SFT = bridge_yaml(
    (
        "model",
        {
            **LLAMA3_8B,
            "gated_linear_unit": True,
            "share_embeddings_and_output_weights": False,
            "seq_length": 16384,
            "tensor_model_parallel_size": 1,
        },
    ),
    ("train", {"micro_batch_size": 1, "global_batch_size": 64}),
    ("optimizer", {"use_distributed_optimizer": True}),
    comment="Llama 3.1 8B SFT at 16k tokens on one 8 x H100 node.",
)
PP2 = """\
model:
  num_layers: 16
  hidden_size: 2048
  num_attention_heads: 16
  vocab_size: 32000
  seq_length: 4096
  pipeline_model_parallel_size: 2
optimizer:
  optimizer: adam
  lr: 0.0003
  use_distributed_optimizer: true
"""
OOM = (
    "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of "
    "79.11 GiB of which 1.20 GiB is free. Including non-PyTorch memory, this process has 77.90 GiB memory in use. Of "
    "the allocated memory 74.12 GiB is allocated by PyTorch, and 2.05 GiB is reserved by PyTorch but unallocated."
)
SETUPS = {
    "sft-16k": (SFT, {"gpu": "h100-80gb", "num_gpus": 8}),
    "sft-16k-oom-levers": (
        SFT,
        {"gpu": "h100-80gb", "num_gpus": 8, "measured_log": OOM, "levers": ["recompute,optimizer,tp"]},
    ),
    "pp2-small-gpu": (PP2, {"gpu_memory_gb": 12, "num_gpus": 2, "headroom_gib": 0.5}),
    "qwen3-card-overlap-off": ((ROOT / "examples" / "qwen3_30b_a3b_pretrain.yaml").read_text(), {"gpu_memory_gb": 60}),
}


def flags(planner: dict) -> list[str]:
    out = []
    for key, value in planner.items():
        out.append("--" + key.replace("_", "-"))
        out += [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return out


def run(argv: list[str], capsys) -> tuple[int, dict]:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--json"])
    return int(done.value.code), json.loads(capsys.readouterr().out)


def with_overrides(text: str, overrides: list[str]) -> dict:
    """The config as ``text`` plus ``overrides``: what writing exactly those overrides must give."""
    return sources.load(text, list(overrides)).config.model_dump(mode="json")


def written(text: str) -> dict:
    """The config a written file holds."""
    return sources.load(text).config.model_dump(mode="json")


@pytest.fixture(params=sorted(SETUPS))
def setup(request, tmp_path):
    text, planner = SETUPS[request.param]
    path = tmp_path / "run.yaml"
    path.write_text(text, encoding="utf-8")
    return path, text, planner


def test_apply_option_n_writes_exactly_recommends_option_n_on_the_cli(setup, capsys):
    path, text, planner = setup
    code, rec = run(["recommend", str(path), *flags(planner)], capsys)
    assert code == 0 and rec["options"], rec
    for option in rec["options"]:
        out = path.with_name(f"option{option['rank']}.yaml")
        argv = ["apply", str(path), "--option", str(option["rank"]), *flags(planner), "--output", str(out)]
        code, applied = run(argv, capsys)
        assert code == 0 and applied["written"] == str(out), applied
        assert written(out.read_text()) == with_overrides(text, option["overrides"]), option
        changed = {c["key"] for c in applied["changes"]}
        assert changed <= {o.partition("=")[0] for o in option["overrides"]}, (changed, option["overrides"])
        assert not any(f["rule"] == "OPT-OVERLAP" for f in applied["findings"])
    # mode recommended writes option 0 when it is the recommendation
    code, applied = run(["apply", str(path), "--mode", "recommended", *flags(planner)], capsys)
    assert with_overrides(text, applied["overrides"]) == with_overrides(text, rec["overrides"])


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["sft-16k-oom-levers", "qwen3-card-overlap-off"])
async def test_apply_offload_option_n_is_recommend_modes_option_n_over_mcp(name, tmp_path) -> None:
    text, planner = SETUPS[name]
    path = tmp_path / "run.yaml"
    path.write_text(text, encoding="utf-8")
    mcp_planner = {k: (v[0].split(",") if k == "levers" else v) for k, v in planner.items()}
    async with Client(mcp, raise_exceptions=True) as client:
        rec = (await client.call_tool("recommend_mode", {"config": str(path), **mcp_planner})).structured_content
        for option in rec["options"]:
            call = {"config": str(path), "option": option["rank"], **mcp_planner}
            result = await client.call_tool("apply_offload", call)
            assert not result.is_error, result.content[0].text
            edit = result.structured_content["overrides"]
            assert with_overrides(text, edit) == with_overrides(text, option["overrides"]), option


def test_every_option_at_or_above_the_overlap_threshold_carries_overlap_on(capsys, tmp_path):
    path = tmp_path / "card.yaml"
    path.write_text(SETUPS["qwen3-card-overlap-off"][0], encoding="utf-8")  # the file sets overlap false
    seen = set()
    for gib in ("56", "60", "66"):
        code, rec = run(["recommend", str(path), "--gpu-memory-gb", gib], capsys)
        assert code == 0, rec
        for option in rec["options"]:
            values = dict(o.split("=", 1) for o in option["overrides"])
            fraction = float(values.get("optimizer.optimizer_offload_fraction", 0))
            if fraction:
                seen.add(fraction >= OVERLAP_FROM_FRACTION)
                want = "true" if fraction >= OVERLAP_FROM_FRACTION else "false"
                assert values["optimizer.overlap_cpu_optimizer_d2h_h2d"] == want, option
    assert seen == {True, False}  # both sides of the threshold were offered


def test_apply_takes_every_planner_input_recommend_takes(capsys):
    from mbridge_offload_tools.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    apply_dests = {a.dest for a in sub.choices["apply"]._actions}
    recommend_dests = {a.dest for a in sub.choices["recommend"]._actions}
    planner = set(FIELDS) - APPLY_OWN_INPUTS
    assert planner <= apply_dests and planner <= recommend_dests
    assert "num_layers" in apply_dests  # apply's own: cpu_offloading_num_layers


@pytest.mark.anyio
async def test_apply_offload_lists_every_planner_input_with_recommend_modes_schema() -> None:
    async with Client(mcp, raise_exceptions=True) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
    apply_props = tools["apply_offload"].input_schema["properties"]
    rec_props = tools["recommend_mode"].input_schema["properties"]
    for name in set(FIELDS) - APPLY_OWN_INPUTS:
        assert apply_props[name] == rec_props[name], name
    assert "cpu_offloading_num_layers" in apply_props["num_layers"]["description"]


def test_apply_with_an_oom_log_writes_an_option_that_fits_the_bound(capsys, tmp_path):
    path = tmp_path / "run.yaml"
    # 8k tokens with full recompute: the model alone says 65 GiB, it fits; the OOM says at least 77.12 GiB.
    recompute = (
        "seq_length: 8192\n  recompute_granularity: full\n  recompute_method: uniform\n  recompute_num_layers: 1"
    )
    path.write_text(SFT.replace("seq_length: 16384", recompute), encoding="utf-8")
    log = tmp_path / "oom.log"
    log.write_text("step 1\n" + OOM + "\n")
    base = ["--gpu", "h100-80gb", "--num-gpus", "8", "--levers", "optimizer"]
    _, plain = run(["recommend", str(path), *base], capsys)
    _, rec = run(["recommend", str(path), *base, "--measured-log", str(log)], capsys)
    code, applied = run(["apply", str(path), "--mode", "recommended", *base, "--measured-log", str(log)], capsys)
    assert rec["calibration"]["measured_kind"] == "bound" and rec["overrides"] != plain["overrides"]
    assert with_overrides(path.read_text(), applied["overrides"]) == with_overrides(path.read_text(), rec["overrides"])
    noise = tmp_path / "noise.log"
    noise.write_text("step 1\nloss 3.2\n")
    for bad_log, words in ((noise, "nothing measured"), (tmp_path / "missing.log", "no such file")):
        argv = ["apply", str(path), "--mode", "recommended", *base, "--measured-log", str(bad_log), "--in-place"]
        code, bad = run(argv, capsys)
        assert code == 2 and words in bad["error"], bad
    assert sorted(p.name for p in tmp_path.iterdir()) == ["noise.log", "oom.log", "run.yaml"]  # nothing written
