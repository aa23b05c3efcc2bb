"""The MoE step-time physics (plan/time/moe.py): the EP all-to-all within and across NVLink domains per dispatcher, EP
overlap, load imbalance and the fixed cost per MoE layer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mbridge_offload.config import sources
from mbridge_offload.plan.inputs.hardware import gpu_preset
from mbridge_offload.plan.inputs.presets import model_preset
from mbridge_offload.plan.inputs.resolve import resolve
from mbridge_offload.plan.model.run import Setup
from mbridge_offload.plan.time import moe
from mbridge_offload.plan.time.terms import MOE_LAYER_OVERHEAD_S, step_terms

QWEN = model_preset("qwen3-30b-a3b")  # 128 experts, top-8, hidden 2048
H100, GB200 = gpu_preset("h100-80gb"), gpu_preset("gb200")


def _setup(**changes) -> Setup:
    base = Setup(num_gpus=16, ep=16, etp=1, seq_length=4096, micro_batch_size=1, global_batch_size=1024)
    return replace(base, **changes)


def test_inside_one_nvlink_domain_every_dispatcher_moves_the_same_bytes_over_nvlink_only():
    alltoall = moe.a2a(QWEN, _setup(), GB200)  # EP16 inside one NVL72 domain
    flex = moe.a2a(QWEN, _setup(moe_token_dispatcher_type="flex"), GB200)
    assert alltoall.network_bytes == flex.network_bytes == 0
    assert alltoall.nvlink_bytes == flex.nvlink_bytes == pytest.approx(4096 * 8 * 15 / 16 * 2048 * 2)


def test_across_domains_alltoall_sends_every_remote_copy_over_the_network():
    t = moe.a2a(QWEN, _setup(), H100)  # EP16 over two 8-GPU nodes: half the experts are remote
    assert t.link == "network"
    assert t.network_bytes == pytest.approx(4096 * 8 * 8 / 16 * 2048 * 2)
    assert t.seconds == pytest.approx(t.network_bytes / (H100.network_gbps * 1e9 * moe.COMM_EFFICIENCY))


def test_deepep_and_hybridep_send_a_token_once_per_remote_domain():
    plain = moe.a2a(QWEN, _setup(), H100)
    flex = moe.a2a(QWEN, _setup(moe_token_dispatcher_type="flex"), H100)
    hit = 1 - (1 - 1 / 2) ** 8  # two domains: the chance a token has an expert on the other node
    assert flex.network_bytes == pytest.approx(4096 * hit * 2048 * 2)
    assert plain.network_bytes / flex.network_bytes == pytest.approx(4 / hit)


def test_allgather_gathers_every_ranks_tokens():
    t = moe.a2a(QWEN, _setup(moe_token_dispatcher_type="allgather"), GB200)
    assert t.nvlink_bytes == pytest.approx(4096 * 15 * 2048 * 2)


def test_ep_overlap_hides_the_all_to_alls_behind_compute_but_not_all_of_them():
    assert moe.exposed(1.0, 5.0, overlap=False) == 1.0
    assert moe.exposed(1.0, 5.0, overlap=True) == pytest.approx(moe.OVERLAP_RESIDUAL)
    assert moe.exposed(6.0, 5.0, overlap=True) == pytest.approx(1.0)
    plain = step_terms(QWEN, _setup(), GB200)
    overlapped = step_terms(QWEN, _setup(overlap_moe_expert_parallel_comm=True), GB200)
    assert overlapped.seconds(0.4)["ep_comm"] < plain.seconds(0.4)["ep_comm"] / 5


def test_natural_routing_pays_the_hottest_ranks_share_and_forced_balancing_does_not():
    assert moe.imbalance(QWEN, _setup(moe_router_force_load_balancing=True)) == 1.0
    natural = moe.imbalance(QWEN, _setup())
    assert 1.0 < natural < 1.5
    assert moe.imbalance(QWEN, _setup(ep=4, num_gpus=4)) < natural  # more experts per rank average out
    forced = step_terms(QWEN, _setup(moe_router_force_load_balancing=True), GB200)
    assert step_terms(QWEN, _setup(), GB200).compute > forced.compute


def test_full_iteration_cuda_graphs_remove_the_per_layer_fixed_cost_and_ungrouped_gemms_add_launches():
    assert moe.fixed_seconds(QWEN, _setup(), MOE_LAYER_OVERHEAD_S) == MOE_LAYER_OVERHEAD_S
    assert moe.fixed_seconds(QWEN, _setup(cuda_graph_impl="full_iteration"), MOE_LAYER_OVERHEAD_S) == 0.0
    ungrouped = moe.fixed_seconds(QWEN, _setup(moe_grouped_gemm=False), MOE_LAYER_OVERHEAD_S)
    assert ungrouped == pytest.approx(MOE_LAYER_OVERHEAD_S + 9 * 8 * moe.LAUNCH_S)


def test_the_configs_moe_settings_reach_the_step_model():
    raw = {
        "model": {
            "moe_token_dispatcher_type": "flex",
            "overlap_moe_expert_parallel_comm": True,
            "moe_router_force_load_balancing": True,
            "cuda_graph_impl": "full_iteration",
        }
    }
    r = resolve({"model": "qwen3-30b-a3b", "num_gpus": 16}, sources.build_config(raw, "<moe>"), raw)
    s = r.setup
    assert (s.moe_token_dispatcher_type, s.overlap_moe_expert_parallel_comm) == ("flex", True)
    assert s.moe_router_force_load_balancing and s.cuda_graph_impl == "full_iteration"
    bare = resolve({"model": "qwen3-30b-a3b", "num_gpus": 16}).setup
    assert (bare.moe_token_dispatcher_type, bare.overlap_moe_expert_parallel_comm) == ("alltoall", False)
