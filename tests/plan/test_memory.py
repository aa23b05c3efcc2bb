"""The memory model against hand-computed bytes, Megatron's theoretical formula and the upstream measurements."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from mbridge_offload.plan.inputs.presets import MODEL_PRESETS, model_preset
from mbridge_offload.plan.memory.activations import layer_activations, stage_activations
from mbridge_offload.plan.memory.stage import estimate_memory, greedy_offload
from mbridge_offload.plan.model.architecture import GB, ModelSpec
from mbridge_offload.plan.model.params import next_pow2, padded_vocab, total_params
from mbridge_offload.plan.model.run import Setup, check_setup
from mbridge_offload_runtime.upstream import TE_MIN_OFFLOAD_NUMEL

QWEN_MOE = Setup(num_gpus=16, tp=2, pp=2, ep=4, etp=1, global_batch_size=8)
# Upstream card (Qwen3-30B-A3B, TP2 PP2 EP4, 2 x 8 H100): GPU memory saved per GPU at each offload fraction.
MEASURED_SAVED_GB = {0.25: 3.8, 0.5: 7.6, 0.75: 11.6, 1.0: 15.3}


# ------------------------------------------------------------------------------------ hand-computed bytes


def test_llama3_8b_weights_gradients_optimizer_match_hand_count():
    m = model_preset("llama3-8b")
    h, ffn, q, kv, v = 4096, 14336, 32 * 128, 8 * 128, 128256
    layer = 2 * h + h * (q + 2 * kv) + q * h + h * 2 * ffn + ffn * h  # norms, qkv, proj, SwiGLU fc1, fc2
    n = 32 * layer + 2 * v * h + h  # untied embedding + output layer, final norm
    assert n == 8_030_261_248
    est = estimate_memory(m, Setup(num_gpus=8))  # DP 8, distributed optimizer, fp32 grads (Bridge recipes)
    w = est.worst
    assert w.params == n
    assert w.weights == 2 * n
    assert w.gradients == 4 * n
    assert w.optimizer == 12 * n // 8  # fp32 master + two fp32 moments, sharded over DP


def test_qwen3_0_6b_tied_tp2_weights_and_no_distributed_optimizer():
    m = model_preset("qwen3-0.6b")
    h, ffn, q, kv, d = 1024, 3072, 16 * 128, 8 * 128, 128
    vocab = 151936  # 1187 x 128 already; with TP 2 padded to a multiple of 256
    assert padded_vocab(m, 2) == 152064
    layer = 2 * h + 2 * d + (h * (q + 2 * kv) + q * h + h * 2 * ffn + ffn * h) // 2
    n = 28 * layer + 152064 * h // 2 + h  # tied: one embedding on the single stage
    est = estimate_memory(m, Setup(num_gpus=2, tp=2, distributed_optimizer=False))
    assert est.worst.params == n
    assert est.worst.optimizer == 12 * n  # Float16Optimizer: unsharded fp32 masters + moments
    assert total_params(m) == 28 * (2 * h + 2 * d + h * (q + 2 * kv) + q * h + 3 * h * ffn) + vocab * h + h


def test_qwen3_30b_a3b_stage0_params_and_sharded_optimizer():
    m = model_preset("qwen3-30b-a3b")
    h, q, kv, moe_ffn = 2048, 32 * 128, 4 * 128, 768
    dense_layer = 2 * h + 2 * 128 + h * (q + 2 * kv) // 2 + q * h // 2 + h * 128  # norms, qk-norm, attn, router
    expert_layer = 32 * (h * 2 * moe_ffn + moe_ffn * h)  # 128 experts / EP 4, ETP 1
    dense = 24 * dense_layer + 152064 * h // 2  # stage 0 of PP 2 holds the embedding
    expert = 24 * expert_layer
    w = estimate_memory(m, QWEN_MOE).stages[0]
    assert w.params == dense + expert
    assert w.weights == 2 * (dense + expert)
    # Dense params shard over DP = 16/(TP2·PP2) = 4, experts over expert DP = 16/(PP2·EP4·ETP1) = 2.
    assert w.optimizer == pytest.approx(12 * (dense / 4 + expert / 2), rel=1e-6)
    assert w.optimizer / GB == pytest.approx(22.91, abs=0.01)


def test_llama3_8b_layer_activations_match_hand_count():
    m = model_preset("llama3-8b")
    s, h, q, kv, ffn = 8192, 4096, 4096, 1024, 14336
    per_token = 2 * h + 2 * h + 2 * q + 2 * kv + 2 * kv + 2 * q + 4 * 32 + 2 * h + 2 * h + 2 * 2 * ffn + 2 * ffn
    acts = layer_activations(m, Setup(num_gpus=1), 0)
    assert sum(t.nbytes for t in acts) == s * per_token
    est = estimate_memory(m, Setup(num_gpus=1))
    logits = 4 * s * 128256 + 4 * s * h
    assert est.worst.activations == 32 * s * per_token + 8 * s + logits


def test_moe_layer_activations_scale_with_topk_routed_tokens():
    m = model_preset("qwen3-30b-a3b")
    acts = {t.name: t for t in layer_activations(m, QWEN_MOE, 0)}
    tokens_per_rank = 4096 // 2  # sequence parallel over TP 2
    assert acts["expert_fc1_in"].numel == tokens_per_rank * 8 * 2048
    assert acts["expert_fc1_out"].numel == tokens_per_rank * 8 * 2 * 768
    assert acts["k"].numel == 4096 * 512 // 2  # GQA: 4 groups x 128, TP 2


# ------------------------------------------------------------------------------------ Megatron's formula


def megatron_theoretical(m: ModelSpec, s: Setup) -> tuple[float, float]:
    """megatron/training/theoretical_memory_usage.py (Korthikanti Table 2), reimplemented from its description:
    weight+optimizer bytes on the most loaded shard and first-stage activation bytes."""
    h, L, a, g = m.hidden_size, m.num_layers, m.num_attention_heads, m.num_query_groups
    ffn, v = m.ffn_hidden_size, padded_vocab(m, s.tp)
    gated = 3 / 2 if m.gated_linear_unit else 1
    layers = 2 * L * h * h * ((1 + g / a) + (ffn / h) * gated + 2 / h + 1 / (L * h))
    emb = h * v
    shard = (layers / s.pp + emb) / s.tp
    if not m.tied_embeddings and s.pp == 1:
        shard += emb / s.tp
    per_param = 6 + 12 / s.dp if s.distributed_optimizer else 18
    seq, b = m.seq_length, s.micro_batch_size
    act = seq * b * h * (18 + 4 * ffn / h) * L
    act += 8 * seq * b * s.pp + seq * b * h * s.pp
    if s.pp == 1:
        act += seq * b * h * 4 * (1 + v / h)
    return shard * per_param, act / s.tp


GPT = ModelSpec(
    name="gpt-5b",
    num_layers=24,
    hidden_size=4096,
    ffn_hidden_size=16384,
    num_attention_heads=32,
    num_query_groups=32,
    kv_channels=128,
    vocab_size=50257,
    seq_length=2048,
    gated_linear_unit=False,
    dropout=0.1,
)


@pytest.mark.parametrize("tp,pp,dist", [(1, 1, True), (4, 1, True), (2, 4, True), (4, 2, False)])
def test_estimator_matches_megatron_theoretical_formula(tp, pp, dist):
    setup = Setup(num_gpus=32, tp=tp, pp=pp, sequence_parallel=True, distributed_optimizer=dist)
    want_static, want_act = megatron_theoretical(GPT, setup)
    est = estimate_memory(GPT, setup)
    # Megatron reports the first stage (embedding + most in-flight micro-batches); its formula counts saved
    # activations (with the output layer's on PP 1), not backward's buffers: the phase with the most activations,
    # whichever phase sets the stage's peak.
    first = est.stages[0]
    assert first.weights + first.gradients + first.optimizer == pytest.approx(want_static, rel=0.01)
    assert max(p.activations for p in first.phases) == pytest.approx(want_act, rel=0.01)


def test_tensor_parallel_without_sequence_parallel_is_korthikanti_10_plus_24_over_t():
    m = GPT
    sbh = m.seq_length * m.hidden_size
    for tp in (2, 4, 8):
        acts = layer_activations(m, Setup(num_gpus=8, tp=tp, sequence_parallel=False), 0)
        per_sbh = sum(t.nbytes for t in acts if t.name != "softmax_lse") / sbh
        assert per_sbh == pytest.approx(10 + 24 / tp)


# ------------------------------------------------------------------------------------ optimizer offload


def test_greedy_split_overshoots_by_at_most_one_whole_tensor():
    sizes = [40, 30, 20, 10]
    assert greedy_offload(sizes, 0.0) == 0
    assert greedy_offload(sizes, 0.25) == 40  # threshold 25: the first tensor crosses it and goes whole
    assert greedy_offload(sizes, 0.5) == 70
    assert greedy_offload(sizes, 0.7) == 70  # 70 reaches the threshold exactly: stop
    assert greedy_offload(sizes, 1.0) == 100


def test_non_precision_aware_offload_moves_only_the_moments():
    base = estimate_memory(model_preset("llama3-8b"), Setup(num_gpus=8)).worst
    full = estimate_memory(model_preset("llama3-8b"), Setup(num_gpus=8, optimizer_offload_fraction=1.0)).worst
    assert base.optimizer - full.optimizer == 8 * full.offloaded_numel  # fp32 main-param shards stay on the GPU
    assert full.optimizer == 4 * full.shard_numel
    assert full.weights == base.weights and full.gradients == base.gradients


def test_precision_aware_offload_moves_masters_too():
    s = Setup(num_gpus=8, precision_aware_optimizer=True, optimizer_offload_fraction=1.0)
    w = estimate_memory(model_preset("llama3-8b"), s).worst
    assert w.optimizer == 0  # HDO owns the fp32 masters: everything is on the CPU
    plain = estimate_memory(model_preset("llama3-8b"), Setup(num_gpus=8, precision_aware_optimizer=True)).worst
    assert plain.optimizer == (2 + 8) * plain.shard_numel  # bf16 remainders + fp32 moments (TE FusedAdam)


@pytest.mark.parametrize("fraction", sorted(MEASURED_SAVED_GB))
def test_qwen3_30b_a3b_predicted_saving_within_15_percent_of_upstream(fraction):
    m = model_preset("qwen3-30b-a3b")
    base = estimate_memory(m, QWEN_MOE).worst.total
    after = estimate_memory(m, Setup(**{**QWEN_MOE.__dict__, "optimizer_offload_fraction": fraction})).worst.total
    saved = (base - after) / GB
    assert saved == pytest.approx(MEASURED_SAVED_GB[fraction], rel=0.15)


def test_qwen3_30b_a3b_static_memory_matches_measured_baseline():
    # The card's 47.2 GB is torch's allocated memory between steps: weights + grads + optimizer state.
    w = estimate_memory(model_preset("qwen3-30b-a3b"), QWEN_MOE).worst
    assert (w.weights + w.gradients + w.optimizer) / GB == pytest.approx(47.2, rel=0.03)


def test_host_memory_pinned_buffers_round_to_powers_of_two():
    m = ModelSpec(
        name="tiny",
        num_layers=2,
        hidden_size=768,
        ffn_hidden_size=3072,
        num_attention_heads=12,
        num_query_groups=12,
        kv_channels=64,
        vocab_size=1000,
        seq_length=128,
    )
    est = estimate_memory(m, Setup(num_gpus=1, optimizer_offload_fraction=1.0))
    w = est.worst
    assert w.offloaded_numel == w.shard_numel
    exact = 16 * w.offloaded_numel  # fp32 clone + fp32 grad + two fp32 moments
    assert exact < w.host <= exact + 8 * w.offloaded_numel  # only the two pinned buffers are rounded up
    assert next_pow2(3 * 2**20) == 4 * 2**20


def test_host_memory_warning_above_host_ram_per_gpu():
    est = estimate_memory(model_preset("llama3-8b"), Setup(num_gpus=1, optimizer_offload_fraction=1.0), host_ram_gb=64)
    assert est.host_peak_gb > 64
    assert any("host memory" in w for w in est.warnings)


# ------------------------------------------------------------------------------------ activation offload


def test_activation_offload_keeps_model_layers_minus_k_eligible_layers():
    m = model_preset("llama3-8b")
    base = estimate_memory(m, Setup(num_gpus=8)).worst.activations
    per_layer = stage_activations(m, Setup(num_gpus=8), 0).offloadable_bytes
    for k in (1, 8, 31):
        est = estimate_memory(m, Setup(num_gpus=8, activation_offload_layers=k))
        assert base - est.worst.activations == k * per_layer
        assert est.worst.host >= k * per_layer


def test_only_tensors_above_the_te_eligibility_size_move():
    m = model_preset("qwen3-0.6b")
    s = Setup(num_gpus=1, seq_length=256)  # short sequence: several saved tensors are below 256 Ki elements
    acts = layer_activations(m, s, 0)
    small = sum(t.nbytes for t in acts if t.numel < TE_MIN_OFFLOAD_NUMEL)
    assert small > 0
    full = estimate_memory(m, s).worst.activations
    most = estimate_memory(m, Setup(num_gpus=1, seq_length=256, activation_offload_layers=27)).worst.activations
    assert full - most == 27 * (sum(t.nbytes for t in acts) - small)


def test_activation_offload_rejected_with_pipeline_parallel_or_recompute():
    m = model_preset("llama3-8b")
    with pytest.raises(ValueError, match="Pipeline parallelism"):
        check_setup(m, Setup(num_gpus=8, pp=2, activation_offload_layers=4))
    with pytest.raises(ValueError, match="recomputation"):
        check_setup(m, Setup(num_gpus=8, recompute_granularity="full", activation_offload_layers=4))
    with pytest.raises(ValueError, match="less than 32"):
        check_setup(m, Setup(num_gpus=8, activation_offload_layers=32))


# ------------------------------------------------------------------------------------ schedules, recompute


def test_1f1b_first_stage_holds_pp_micro_batches():
    m = model_preset("llama3-70b")
    s = Setup(num_gpus=32, tp=4, pp=4)
    stages = estimate_memory(m, s).stages
    per_layer = sum(t.nbytes for t in layer_activations(m, s, 0))
    assert stages[0].activations == pytest.approx(20 * per_layer * 4, rel=0.01)
    assert stages[1].activations == pytest.approx(20 * per_layer * 3, rel=0.01)
    few = estimate_memory(m, Setup(num_gpus=32, tp=4, pp=4, global_batch_size=4)).stages[0]
    assert few.activations == pytest.approx(20 * per_layer * 2, rel=0.01)  # DP 2 x 2 micro-batches: fewer than stages


def test_interleaved_schedule_penalty_on_first_stage():
    m = model_preset("llama3-70b")
    plain = estimate_memory(m, Setup(num_gpus=32, tp=4, pp=4)).stages[0].activations
    inter = estimate_memory(m, Setup(num_gpus=32, tp=4, pp=4, vpp=5)).stages[0].activations
    assert inter / plain == pytest.approx(1 + 3 / (4 * 5), rel=0.01)


def test_full_recompute_keeps_layer_inputs_plus_the_larger_of_one_rebuilt_layer_and_the_logits():
    # The last layer is rebuilt only after the output layer's backward freed the logits: two phases, not a sum.
    m = model_preset("llama3-8b")
    s = Setup(num_gpus=8, tp=2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    worst = estimate_memory(m, s).worst
    phases = {p.name: p for p in worst.phases}
    layer = sum(t.nbytes for t in layer_activations(m, s, 0))
    inputs = 32 * 2 * (8192 // 2) * 4096
    logits = 4 * 8192 * 4096 // 2 + 4 * 8192 * padded_vocab(m, 2) // 2
    assert phases["forward_backward"].activations == inputs + 8 * 8192 + layer
    assert phases["loss"].activations == inputs + 8 * 8192 + logits
    assert worst.peak_phase == "loss" and worst.activations == inputs + 8 * 8192 + logits


def test_selective_recompute_of_moe_act_drops_expert_activation_outputs():
    m = model_preset("qwen3-30b-a3b")
    plain = estimate_memory(m, QWEN_MOE).worst.activations
    sel = estimate_memory(
        m, Setup(**{**QWEN_MOE.__dict__, "recompute_granularity": "selective", "recompute_modules": ("moe_act",)})
    ).worst.activations
    act = next(t for t in layer_activations(m, QWEN_MOE, 0) if t.name == "expert_act_out")
    assert plain - sel == 24 * act.nbytes * 2  # 24 layers on stage 0, 2 micro-batches in flight


# ------------------------------------------------------------------------------------ presets, checks


@pytest.mark.parametrize(
    "name,billions",
    [
        ("llama3-8b", 8.03),
        ("llama3-70b", 70.55),
        ("qwen3-0.6b", 0.60),
        ("qwen3-8b", 8.19),
        ("qwen3-30b-a3b", 30.53),
        ("deepseek-v3", 671.0),
        ("gpt-oss-20b", 20.9),
    ],
)
def test_presets_reproduce_published_parameter_counts(name, billions):
    assert total_params(MODEL_PRESETS[name]) / 1e9 == pytest.approx(billions, rel=0.01)


@pytest.mark.parametrize(
    "setup,match",
    [
        (Setup(num_gpus=0), "num_gpus is 0"),
        (Setup(num_gpus=9, tp=3), r"num_attention_heads \(32\) must be a multiple of tensor_model_parallel_size"),
        (Setup(num_gpus=12, tp=8), "not divisible by TP·PP·CP"),
        (Setup(num_gpus=8, optimizer_offload_fraction=1.5), r"\[0.0, 1.0\]"),
        (Setup(num_gpus=8, ep=2), "expert parallelism needs MoE"),
        # interleaving with fewer micro-batches than PP, or not a multiple of PP: megatron-core's schedule refuses
        (Setup(num_gpus=8, pp=4, vpp=2, global_batch_size=12), "6 micro-batches .* multiple of PP 4"),
        (Setup(num_gpus=8, pp=4, vpp=2, global_batch_size=4), "2 micro-batches .* multiple of PP 4"),
    ],
)
def test_check_setup_rejects_what_megatron_rejects(setup, match):
    with pytest.raises(ValueError, match=match):
        check_setup(model_preset("llama3-8b"), setup)


def test_check_setup_accepts_interleaving_with_a_multiple_of_pp_micro_batches():
    check_setup(model_preset("llama3-8b"), Setup(num_gpus=8, pp=4, vpp=2, global_batch_size=16))


def test_check_setup_accepts_a_tp_that_is_a_multiple_of_the_query_groups():
    # megatron-core 0.19 and the validator accept TP 8 over 4 query groups (each group replicated on 2 ranks); the
    # planner asks the validator, so TP 8 is a layout the TP lever may offer for qwen3-30b-a3b.
    check_setup(model_preset("qwen3-30b-a3b"), Setup(num_gpus=16, tp=8, ep=2))


def test_check_setup_refuses_what_the_validator_refuses_with_its_rule():
    with pytest.raises(ValueError, match=r"num_query_groups \(4\) must be a multiple or divisor .*MC-QUERY-GROUPS-TP"):
        check_setup(model_preset("qwen3-30b-a3b"), Setup(num_gpus=48, tp=3, ep=1))


def test_deepseek_v3_fits_only_with_many_gpus():
    m = model_preset("deepseek-v3")
    est = estimate_memory(m, Setup(num_gpus=1024, tp=2, pp=16, ep=64, etp=1, global_batch_size=1024))
    assert math.isfinite(est.worst.total) and est.worst.total / GB < 141


def _upstream_places_the_layers(pp: int, vpp: int, first: int | None, last: int | None, layers: int) -> bool:
    """megatron-core's own ``get_transformer_layer_offset`` on every rank and virtual stage (False: it raised)."""
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = SimpleNamespace(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_model_parallel_layout=None,
        num_layers=layers,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False,
    )
    try:
        for rank in range(pp):
            for chunk in range(vpp):
                get_transformer_layer_offset(config, vp_stage=chunk, pp_rank=rank)
    except ZeroDivisionError:
        return False
    return True


@pytest.mark.megatron
@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize(("first", "last"), [(2, None), (None, 2), (2, 2), (4, 2)])
def test_check_setup_refuses_an_uneven_interleaved_split_exactly_where_megatron_core_cannot_place_it(pp, first, last):
    pytest.importorskip("megatron.core")
    vpp, per_middle = 2, 4
    layers = (first or 0) + (last or 0) + per_middle * (pp - (first is not None) - (last is not None))
    setup = Setup(
        num_gpus=8 * pp,
        pp=pp,
        vpp=vpp,
        global_batch_size=64 * pp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
    )
    model = replace(model_preset("llama3-8b"), num_layers=layers)
    if _upstream_places_the_layers(pp, vpp, first, last, layers):
        check_setup(model, setup)
    else:
        with pytest.raises(ValueError, match="leaves no middle stage"):
            check_setup(model, setup)
