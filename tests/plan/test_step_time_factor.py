"""The factor users compare: ``step_time_factor`` is the step time over the run as given without the change,
the upstream card's definition (its Qwen3-30B-A3B setup at 50 % optimizer offload: ×2.5; in ``options[]``, 1.0 = the
config as given); the ratio over the run with no lever at all stays beside it as ``step_time_factor_vs_no_levers``,
in every answer that has a ``step_time_factor``."""

from __future__ import annotations

import json

import pytest
from mcp import Client

from mbridge_offload.plan import service
from mbridge_offload_tools.cli.main import main
from mbridge_offload_tools.server.app import mcp

CARD = {"model": "qwen3-30b-a3b", "gpu": "h100-80gb"}  # the card's recipe: TP2 PP2 EP4, full recompute, 16 H100
CARD_50 = 2484 / 996  # the card's measured 50 % step over its baseline: ×2.49


@pytest.mark.parametrize("baseline", [None, 0.996], ids=["predicted", "calibrated"])
def test_the_cards_setup_at_50_percent_reads_x2_5(baseline):
    est = service.estimate_for_inputs(**CARD, optimizer_offload_fraction=0.5, baseline_step_s=baseline)
    assert est.step_time_factor == pytest.approx(CARD_50, rel=0.10)
    assert est.step_time_factor == pytest.approx(est.time_s.step / est.time_s.without_offload, abs=2e-3)
    # Beside it, the ratio over the run with no lever (the recipe's full recompute off too): what it read before.
    assert est.step_time_factor_vs_no_levers == pytest.approx(est.time_s.step / est.time_s.baseline, abs=2e-3)
    assert est.step_time_factor_vs_no_levers > est.step_time_factor
    if baseline is not None:
        # The "x3.56", less the hottest EP rank's share under natural routing (plan/time/moe.py), which the
        # recipe's recompute-free run now pays too: x3.54.
        assert est.step_time_factor_vs_no_levers == pytest.approx(3.54, abs=0.02)


def test_no_change_reads_x1_and_the_no_lever_ratio_keeps_the_recomputes_cost():
    rec = service.recommend_for_inputs(**CARD)
    (no_change,) = [o for o in rec.options if o.levers == []]
    assert rec.mode == "none" and no_change.step_time_factor == rec.step_time_factor == 1.0
    assert no_change.step_time_factor_vs_no_levers == pytest.approx(1.42, abs=0.02)  # the "x1.42"
    est = service.estimate_for_inputs(**CARD)
    assert est.step_time_factor == 1.0
    assert est.step_time_factor_vs_no_levers == no_change.step_time_factor_vs_no_levers


def test_every_option_and_the_fallback_divide_by_the_config_as_given():
    rec = service.recommend_for_inputs(**CARD, gpu_memory_gb=48)
    given = service.estimate_for_inputs(**CARD, gpu_memory_gb=48)
    for option in rec.options:
        assert option.step_time_factor == pytest.approx(option.step_time_s / given.time_s.step, abs=2e-3)
        assert option.step_time_factor_vs_no_levers == pytest.approx(
            option.step_time_s / given.time_s.baseline, abs=2e-3
        )
    assert (rec.step_time_factor, rec.step_time_factor_vs_no_levers) == (
        rec.options[0].step_time_factor,
        rec.options[0].step_time_factor_vs_no_levers,
    )
    fits = service.recommend_for_inputs(**{**CARD, "gpu": "h200-141gb"})
    assert fits.mode == "none" and fits.fallback is not None
    at = service.estimate_for_inputs(**{**CARD, "gpu": "h200-141gb"})
    f = fits.fallback
    assert f.step_time_factor > 1 and f.step_time_factor_vs_no_levers > f.step_time_factor
    assert f.step_time_factor_vs_no_levers / f.step_time_factor == pytest.approx(
        at.time_s.step / at.time_s.baseline, rel=3e-3
    )


def test_an_option_that_drops_the_given_offload_reads_below_1():
    # The config as given offloads the whole optimizer on a GPU where it fits without: no change is the slow one.
    h200 = {**CARD, "gpu": "h200-141gb", "optimizer_offload_fraction": 1.0}
    rec = service.recommend_for_inputs(**h200)
    given = service.estimate_for_inputs(**h200)
    assert rec.mode == "none" and rec.given_mode == "optimizer"
    assert rec.step_time_factor == pytest.approx(1 / given.step_time_factor, rel=3e-3)
    assert "predicted step time x" in (rec.advice or "")


def test_the_json_of_every_tool_carries_both(capsys):
    with pytest.raises(SystemExit):
        main(["estimate", "--model", "qwen3-30b-a3b", "--optimizer-offload-fraction", "0.5", "--json"])
    est = json.loads(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        main(["recommend", "--model", "qwen3-30b-a3b", "--gpu", "h200-141gb", "--json"])
    rec = json.loads(capsys.readouterr().out)
    for answer in (est, rec, rec["fallback"], *rec["options"]):
        assert {"step_time_factor", "step_time_factor_vs_no_levers"} <= set(answer)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_the_mcp_tools_say_what_it_means() -> None:
    async with Client(mcp, raise_exceptions=True) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        for name in ("estimate_memory", "recommend_mode"):
            schema = json.dumps(tools[name].output_schema)
            assert "over the run as given without the change" in schema and "step_time_factor_vs_no_levers" in schema
        answer = await client.call_tool(
            "estimate_memory", {"model": "qwen3-30b-a3b", "optimizer_offload_fraction": 0.5}
        )
        assert answer.structured_content["step_time_factor"] == pytest.approx(CARD_50, rel=0.10)
