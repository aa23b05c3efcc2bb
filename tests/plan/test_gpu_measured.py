"""The planner against memory measured phase by phase on a GPU, in real megatron-core.

``tools/mbridge_offload_tools/evidence/data/gpu_memory_phases.json`` was written on a lent H200 by
``benchmarks/gpu_memory_phases.py`` (docs/benchmarks-memory-gpu.md): a 0.94 B megatron-core 0.19.2 GPTModel (local
spec), bf16 weights, the distributed optimizer, world size 1, with fp32 or bf16 gradient buffers and our
HybridDeviceOptimizer at fractions 0.5 and 1.0, and megatron-core's own at 0.5 (what Bridge builds; the script runs no
gc.collect() before training, like a run with ``train.manual_gc=False``). Allocated memory at the start of a step is
the resident state; the optimizer step's peak over it is the step's transient. The planner must reproduce both: this
is what the peak's phases rest on (the fp32 gradient copy belongs to the step, not to the activation peak).

Not compared: the forward/backward peak. The local spec's attention is unfused (it saves the softmax probabilities,
batch x heads x seq^2 per layer), which no Bridge recipe runs; the planner models fused attention.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mbridge_offload.config import sources
from mbridge_offload.plan.inputs.resolve import resolve
from mbridge_offload.plan.memory.stage import StageMemory, estimate_memory
from mbridge_offload.plan.model.architecture import GB
from mbridge_offload.plan.model.run import Setup

DATA = Path(__file__).resolve().parents[2] / "tools/mbridge_offload_tools/evidence/data/gpu_memory_phases.json"
GiB = 2**30
MEASURED = json.loads(DATA.read_text())
ROWS = {r["setup"]: r for r in MEASURED["results"]}
# Small buffers the model does not list (RoPE tables, DDP bucket padding, the step counter): under 0.25 GiB here.
RESIDENT_TOLERANCE_GIB = 0.25


def _plan_model(row: dict):
    """The planner's model of the measured run, as :func:`_plan` reads it."""
    return _resolved(row, False).model


def _plan(row: dict, manual_gc: bool = False) -> tuple[StageMemory, Setup]:
    """The planner's worst (only) stage for a measured set-up, and the settings it read."""
    r = _resolved(row, manual_gc)
    return estimate_memory(r.model, r.setup).worst, r.setup


def _resolved(row: dict, manual_gc: bool) -> Any:
    """The planner's reading of a measured set-up (its config as the benchmark built it)."""
    shape = MEASURED["shape"]
    raw = {
        "model": {
            "num_layers": shape["layers"],
            "hidden_size": shape["hidden"],
            "ffn_hidden_size": shape["ffn"],
            "num_attention_heads": shape["heads"],
            "num_query_groups": shape["heads"],
            "kv_channels": shape["hidden"] // shape["heads"],
            "seq_length": shape["seq"],
            "vocab_size": shape["vocab"],
            "gated_linear_unit": False,  # the local spec's MLP: GeLU, with biases, LayerNorm, untied output layer
            "add_bias_linear": True,
            "normalization": "LayerNorm",
            "share_embeddings_and_output_weights": False,
            "bf16": True,
            "params_dtype": "bfloat16",
        },
        "ddp": {"use_distributed_optimizer": True, "grad_reduce_in_fp32": row["grad_reduce_in_fp32"]},
        "optimizer": {
            "use_distributed_optimizer": True,
            "bf16": True,
            "optimizer_cpu_offload": row["offload"] != "none",
            "optimizer_offload_fraction": row["fraction"],
            "use_precision_aware_optimizer": row["offload"] != "none",
        },
        "train": {"micro_batch_size": shape["batch"], "global_batch_size": shape["batch"], "manual_gc": manual_gc},
    }
    which = "ours" if row["offload"] == "ours" else "megatron-core"
    flags = {"gpu": "h200-141gb", "num_gpus": 1, "hybrid_optimizer": which}
    return resolve(flags, sources.build_config(raw, "<gpu-measured>"), raw)


def _ours_transient_gib(row: dict) -> float:
    """The planner's optimizer-step bytes beyond the resident state and the workspaces every phase carries."""
    stage, setup = _plan(row)
    step = next(p for p in stage.phases if p.name == "optimizer_step")
    return (step.other - int(setup.overhead_gb * GB)) / GiB


def _measured_transient_gib(row: dict) -> float:
    return (row["peak_bytes"]["optimizer_step"] - row["allocated_before_step_bytes"]) / GiB


def test_the_measurement_is_a_gpu_measurement_of_this_model():
    assert MEASURED["cuda"] is True and "H200" in MEASURED["device"]
    assert all(r["error"] is None for r in MEASURED["results"])
    stage, _ = _plan(ROWS["fp32 grads"])
    assert stage.params == pytest.approx(ROWS["fp32 grads"]["params"], rel=1e-3)


MEGATRON_CORE_HDO = "bf16 grads, megatron-core HDO 0.5"


@pytest.mark.parametrize(
    "setup", ["fp32 grads", "bf16 grads", "bf16 grads, ours 0.5", "bf16 grads, ours 1.0", MEGATRON_CORE_HDO]
)
def test_the_resident_state_is_what_the_gpu_held_at_the_start_of_a_step(setup):
    row = ROWS[setup]
    stage, _ = _plan(row)
    ours = (stage.weights + stage.gradients + stage.optimizer) / GiB
    assert ours == pytest.approx(row["allocated_before_step_bytes"] / GiB, abs=RESIDENT_TOLERANCE_GIB)


def test_bf16_gradients_add_their_fp32_copy_to_the_step_and_only_to_the_step():
    # Megatron's plain path steps with torch's foreach AdamW here (no TE, no apex), whose own temporaries are in both
    # runs: the difference between the two transients is the fp32 gradient copy alone (4 bytes per parameter).
    fp32, bf16 = ROWS["fp32 grads"], ROWS["bf16 grads"]
    measured = _measured_transient_gib(bf16) - _measured_transient_gib(fp32)
    ours = _ours_transient_gib(bf16) - _ours_transient_gib(fp32)
    assert ours == pytest.approx(4 * bf16["params"] / GiB, rel=0.01)
    assert ours == pytest.approx(measured, abs=0.05)


@pytest.mark.parametrize("setup", ["bf16 grads, ours 0.5", "bf16 grads, ours 1.0", MEGATRON_CORE_HDO])
def test_the_hybrid_optimizers_step_transient_is_the_fp32_copy_of_what_it_steps_on_the_gpu(setup):
    # Its GPU part is torch's fused AdamW (no temporaries of its own): the transient is the copy alone (ours), or for
    # megatron-core's HDO, which keeps its copies resident, the new copy of its largest GPU-stepped tensor.
    row = ROWS[setup]
    assert _ours_transient_gib(row) == pytest.approx(_measured_transient_gib(row), abs=RESIDENT_TOLERANCE_GIB)


def _first_build_gpu_numel(setup: Setup) -> int:
    """Elements the factory's first HDO steps on the GPU: its greedy split walks the full local parameters in
    megatron-core's group order (decay group first, model order), not the distributed optimizer's buffer order."""
    from mbridge_offload.plan.memory.stage import greedy_offload, optimizer_param_order
    from mbridge_offload.plan.model.params import stage_params

    row = ROWS[MEGATRON_CORE_HDO]
    numels = [t.numel for t in optimizer_param_order(stage_params(_plan_model(row), setup, 0))]
    return sum(numels) - greedy_offload(numels, setup.optimizer_offload_fraction)


def test_megatron_core_hdo_holds_what_the_gpu_held_beyond_ours():
    # The planner's reason for the measured gap (plan/memory/stage.py _megatron_core_kept): 4 bytes of kept fp32
    # gradient per parameter the distributed optimizer's HDO steps on the GPU (its split walks the shards in buffer
    # order), and 4 bytes of the first build's fp32 clone per parameter that build put on the GPU (world size 1).
    ours, _ = _plan(ROWS["bf16 grads, ours 0.5"])
    upstream, setup = _plan(ROWS[MEGATRON_CORE_HDO])
    gpu_stepped = upstream.shard_numel - upstream.offloaded_numel
    assert upstream.optimizer - ours.optimizer == 4 * gpu_stepped + 4 * _first_build_gpu_numel(setup)
    measured = (
        ROWS[MEGATRON_CORE_HDO]["allocated_before_step_bytes"]
        - ROWS["bf16 grads, ours 0.5"]["allocated_before_step_bytes"]
    )
    assert measured == pytest.approx(upstream.optimizer - ours.optimizer, rel=0.01)


def test_a_garbage_collection_before_training_frees_the_first_build():
    kept, _ = _plan(ROWS[MEGATRON_CORE_HDO])
    stage, setup = _plan(ROWS[MEGATRON_CORE_HDO], manual_gc=True)  # Bridge's recipes' train.manual_gc=True
    assert setup.manual_gc
    assert kept.optimizer - stage.optimizer == 4 * _first_build_gpu_numel(setup)
