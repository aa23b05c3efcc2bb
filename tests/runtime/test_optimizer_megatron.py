"""Our HybridDeviceOptimizer inside real megatron-core training: ``get_megatron_optimizer`` builds it.

Each case runs ``tests/support/megatron_optimizer_worker.py`` in its own process group (gloo; world size 1 and 2
via torch.multiprocessing.spawn, under a timeout) against megatron-core 0.16.1 (the venv) and 0.19.2 (.mcore/),
with a real tiny GPTModel in Megatron's DistributedDataParallel, with and without the DistributedOptimizer. The
worker's CPU stand-ins are listed in its docstring; the optimizer logic on both sides is real. Megatron Bridge's
``setup_optimizer`` is tested where Bridge is importable (``make test-bridge``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import tree
from tests.support.differential import version_env

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.megatron
ROOT = Path(__file__).resolve().parents[2]
_RESULTS: dict[tuple[str, int], dict] = {}
CASES = [
    pytest.param(
        label,
        version_env(label),
        world,
        marks=[
            pytest.mark.skipif(version_env(label) is None, reason=f"megatron-core {label} not installed"),
            *([pytest.mark.long] if world == 2 else []),  # two gloo ranks: the same checks, twice the processes
        ],
        id=f"{label}-world{world}",
    )
    for label in ("0.16.1", "0.19.2")
    for world in (1, 2)
]


def worker(label: str, env: dict[str, str], world: int, tmp_path_factory) -> dict:
    """The worker's report for one megatron-core version and world size (one run, cached for the module)."""
    if (label, world) not in _RESULTS:
        out = tmp_path_factory.mktemp(f"mcore-{label}-{world}") / "result.json"
        script = ROOT / "tests" / "support" / "megatron_optimizer_worker.py"
        # This tree first (never an installed copy of the package), then the release's megatron-core tree.
        path = tree.pythonpath(*filter(None, [env.get("PYTHONPATH")]))
        proc = subprocess.run(
            [sys.executable, str(script), str(world), str(out)],
            capture_output=True,
            text=True,
            # One thread, as torchrun gives each rank: a multi-threaded CPU backward may sum in another order from
            # run to run, and the runs compared here must differ only by their optimizer.
            env={**env, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
            cwd=ROOT,
            timeout=420,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        _RESULTS[label, world] = json.loads(out.read_text())
        _RESULTS[label, world]["step1"] = torch.load(out.with_suffix(".step1.pt"))
    return _RESULTS[label, world]


@pytest.mark.parametrize(("label", "env", "world"), CASES)
def test_get_megatron_optimizer_builds_ours_and_install_is_undone(label, env, world, tmp_path_factory):
    r = worker(label, env, world, tmp_path_factory)
    assert r["version"].startswith(label) and r["world"] == world
    assert {"megatron.core.optimizer", "megatron.core.optimizer.distrib_optimizer"} <= set(r["patched_modules"])
    # megatron-core's own HDO cannot step the f16 set-up at all (validate's OPT-HDO-FLOAT16-WRAPPER, the planner's
    # refusal: NVIDIA/Megatron-LM#4042); ours can (below)
    assert r["f16_upstream_first_step"] == "KeyError"
    for setup in ("fp32", "f16", "do"):
        assert r[setup]["plain_inner"] == "AdamW"  # offload off: Megatron's own Adam path, untouched
        assert all(r[setup][f"ours_{f}"] for f in (0.0, 0.5, 1.0)), setup
        assert r[setup]["achieved_0.0"] == 0.0 and r[setup]["achieved_1.0"] == 1.0
        assert 0.5 <= r[setup]["achieved_0.5"] < 1.0
    assert r["restored"]


# Ours against Megatron's plain Adam (Megatron's own optimizer, offload off), derived bounds.
#
# Why they differ at all: the optimizer logic is the same, the Adam kernel is not. Megatron's plain Adam on a machine
# without TE or Apex is torch's AdamW with its single-tensor kernel; our HDO runs torch's fused AdamW kernel (faster,
# and the same on both of its sides). The two evaluate the same formula with differently rounded operations (fused
# multiply-adds, constants cast to float at other points), and which ones depends on the CPU's vector unit
# (ATEN_CPU_CAPABILITY: AVX512 here, AVX2 on an AMD EPYC, none with `default`). Run with the single-tensor kernel
# (SHIM-ADAM-KERNEL), ours is bit-identical to Megatron's at every fraction, both set-ups, world 1 and 2, measured
# under ATEN_CPU_CAPABILITY=avx512, avx2 (with ONEDNN_MAX_CPU_ISA=AVX2) and default: the logic matches exactly, so
# any difference left is the kernel's rounding. Gradients are identical on both sides (same model, data and
# all-reduce; a sum over two ranks is the same in either order), so the kernels start from the same numbers.
#
# Step 1, from identical weights, gradients and (empty) moments. Each kernel computes
#   w' = w * (1 - lr * wd) - lr * m^ / (sqrt(v^) + eps),  with |m^ / sqrt(v^)| = 1 at step 1,
# so |update| <= lr. Per kernel, the error against the exact value is at most: 1 ulp(w) for the decay constant
# rounded to float plus 1/2 ulp for the decay product, 1/2 ulp(w') for the subtraction, and for the update about ten
# roundings (the moments, the square, sqrt, the two bias-correction constants, + eps, the division, the step size),
# each <= 2**-24 relative: <= 2 ulp(m) + 10 * 2**-24 * lr, with m = max(|w|, |w'|) <= max(|x|, |y|) + lr. Two kernels
# are therefore apart by at most 4 ulp_fp32(m) + 20 * 2**-24 * lr. In the bf16 set-up that bound holds for the fp32
# masters, far below one bf16 step (2**16 fp32 ulps), so the bf16 weights rounded from them differ by at most one
# bf16 step (a master within that bound of a rounding boundary rounds the other way).
#
# Five steps: after a first rounding difference the two runs see different weights, hence different gradients; Adam
# normalises them, so the gap is bounded by Adam's own step bound, not by the rounding. For any gradients,
#   |m^_t / sqrt(v^_t)| <= B_t = (1 - b1) / (1 - b1**t) * sqrt((1 - b2**t) / (1 - b2)) * sqrt(sum_{k<t} (b1**2 / b2)**k)
# (Cauchy-Schwarz on m_t = (1 - b1) sum b1**k g_{t-k} against v_t; eps and gradient clipping only shrink it), and the
# decay factor (1 - lr * wd) < 1 does not grow a gap, so |w_T - w'_T| <= 2 * lr * sum_{t<=T} B_t, plus the
# roundings (4 fp32 ulps per step) and, for bf16 weights, one bf16 step. For T = 5, b1 = 0.9, b2 = 0.999:
# B_t <= 1.011, the bound is 1.0e-2. The AMD EPYC failure (5.3e-4 at world 2, DO, fraction 0, on 0.16.1 and 0.19.2)
# fits this picture: a master rounded to the other bf16 neighbour at an early step, and the runs then drifted apart
# by Adam-sized steps; that is inside this bound, and beyond the old one-bf16-step allowance, which assumed that a
# rounding difference never feeds back through the model. Hosts tried here (the suite under each): AVX512 with AMX,
# ATEN_CPU_CAPABILITY=avx2 with ONEDNN_MAX_CPU_ISA=AVX2 (an AMD EPYC's code path), avx512 with AVX512_CORE, and
# default (no vector unit) with SSE41; the worker runs one thread per rank, so the host's thread count does not enter.
#
# What still catches a bug: the same-kernel comparison is exact, and the step-1 bound is a few ulps; the five-step
# bound is only a sanity bound. Mutants of the HDO run through the worker (world 1, 0.16.1; its sub-optimizers given
# eps * 2, lr * (1 + 2**-20), weight decay * 2, or beta2 = 0.99): each failed the same-kernel check in both set-ups
# at every fraction; eps and weight decay failed the step-1 bound too, the lr one in the bf16 set-up; beta2, which
# step 1 cannot see (Adam's ratio is 1 there whatever beta2 is), only the same-kernel check; the five-step bound none.
LR, BETAS, STEPS = 1e-3, (0.9, 0.999), 5  # tests/support/megatron_optimizer_worker.py: build() and STEPS


def _ulp(x: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """The spacing of the format's numbers at |x| (fp32: 23 stored bits, bf16: 7)."""
    return torch.pow(2.0, torch.floor(torch.log2(x.abs().float().clamp_min(2.0**-126))) - mantissa_bits)


def adam_ratio_bound(t: int, b1: float = BETAS[0], b2: float = BETAS[1]) -> float:
    """B_t: the largest |m^_t / sqrt(v^_t)| Adam can take at step t, over every gradient sequence."""
    series = sum((b1 * b1 / b2) ** k for k in range(t))
    return (1 - b1) / (1 - b1**t) * math.sqrt((1 - b2**t) / (1 - b2)) * math.sqrt(series)


def step1_excess(ours: list[torch.Tensor], plain: list[torch.Tensor], bf16: bool) -> float:
    """How far any element is beyond the step-1 bound above (0.0: none is)."""
    worst = 0.0
    for x, y in zip(ours, plain, strict=True):
        top = torch.maximum(x.abs(), y.abs())
        allowed = _ulp(top, 7) if bf16 else 4 * _ulp(top + LR, 23) + 20 * 2.0**-24 * LR
        worst = max(worst, ((x - y).abs() - allowed).clamp_min(0).max().item())
    return worst


def five_step_bound(bf16: bool, largest_weight: float, steps: int = STEPS) -> float:
    """The gap two correct Adam runs (lr = LR) can open in ``steps`` steps, from the derivation above."""
    top = math.floor(math.log2(largest_weight + steps * LR))
    rounding = steps * 4 * 2.0 ** (top - 23)
    one_bf16_step = 2.0 ** (top - 7) if bf16 else 0.0
    return 2 * LR * sum(adam_ratio_bound(t) for t in range(1, steps + 1)) + rounding + one_bf16_step


def test_adams_step_bound_is_what_the_derivation_says():
    assert adam_ratio_bound(1) == pytest.approx(1.0)  # |m^ / sqrt(v^)| = |g| / |g| at step 1
    assert max(adam_ratio_bound(t) for t in range(1, 6)) == pytest.approx(1.0106, abs=1e-3)
    # no sequence of gradients gets past it: random, constant, growing and alternating ones, with torch's own AdamW
    gen = torch.Generator().manual_seed(0)
    sequences = [
        torch.randn(5, 4096, generator=gen),
        torch.ones(5, 1),
        torch.logspace(-3, 3, 5)[:, None],
        torch.tensor([[1.0], [-1.0], [1.0], [-1.0], [1.0]]),
        torch.tensor([[1e-4], [1e-4], [1e-4], [1e-4], [50.0]]),
    ]
    for grads in sequences:
        w = torch.zeros(grads.shape[1], requires_grad=True)
        opt = torch.optim.AdamW([w], lr=1.0, betas=BETAS, eps=0.0, weight_decay=0.0)
        for t, g in enumerate(grads, 1):
            before = w.detach().clone()
            w.grad = g.clone()
            opt.step()
            # Slack for the CPU kernel, not the math: this suite saw torch's AdamW return |step| = 1.0003 at step 1 on
            # an x86 VM in some processes (a square root good to ~12 bits, as x86's rsqrtps: 1.5 * 2**-12 relative).
            assert (w.detach() - before).abs().max().item() <= adam_ratio_bound(t) * (1 + 2.0**-11)


@pytest.mark.parametrize(("label", "env", "world"), CASES)
def test_five_steps_match_megatrons_plain_adam_and_every_fraction_is_bit_identical(label, env, world, tmp_path_factory):
    r = worker(label, env, world, tmp_path_factory)
    # f16: Megatron's Float16Optimizer swaps our groups' bf16 params for fp32 mains after we are built; an HDO that
    # kept stepping the params it was built with would leave the model where it started (ours did, before 2026-12-07)
    for setup in ("fp32", "f16", "do"):
        bf16 = setup != "fp32"
        first = r["step1"][setup]
        largest = max(w.abs().max().item() for w in first["plain"])
        for f in (0.0, 0.5, 1.0):
            # The logic: with the kernel Megatron's plain Adam runs, ours is Megatron's Adam bit for bit.
            assert r[setup][f"same_kernel_vs_plain_adam_{f}"] == 0.0, (setup, f)
            # The kernel: one step from the same state is a few roundings apart (fp32), or one bf16 step (bf16).
            assert step1_excess(first[f], first["plain"], bf16) == 0.0, (setup, f)
            # Five steps through the model: within Adam's own step bound.
            assert r[setup][f"vs_plain_adam_{f}"] <= five_step_bound(bf16, largest), (setup, f)
        assert r[setup]["fractions_bit_identical"], setup


@pytest.mark.parametrize(("label", "env", "world"), CASES)
def test_checkpoints_through_megatron_resume_bit_exactly_across_fractions(label, env, world, tmp_path_factory):
    r = worker(label, env, world, tmp_path_factory)
    for f2 in (0.0, 1.0):
        assert r["fp32"][f"resume_torch_0.5_to_{f2}_bit_exact"], r["fp32"][f"resume_torch_0.5_to_{f2}_diff"]
        assert r["f16"][f"resume_torch_0.5_to_{f2}_bit_exact"], r["f16"][f"resume_torch_0.5_to_{f2}_diff"]
        assert r["do"][f"resume_dist_ckpt_0.5_to_{f2}_bit_exact"], r["do"][f"resume_dist_ckpt_0.5_to_{f2}_diff"]
        # the legacy save_parameter_state / load_parameter_state, which writes optimizer.state[param][key] directly
        assert r["do"][f"resume_dp_zero_0.5_to_{f2}_bit_exact"], r["do"][f"resume_dp_zero_0.5_to_{f2}_diff"]
    # dist-checkpointing's load reached the DistributedOptimizer's HDO hook, once per load.
    assert r["sync_hook_calls"] == 2


@pytest.mark.parametrize(("label", "env", "world"), CASES)
def test_megatrons_plain_adam_resumes_our_checkpoint_with_offload_off(label, env, world, tmp_path_factory):
    r = worker(label, env, world, tmp_path_factory)
    assert r["fp32"]["resume_offload_off_vs_uninterrupted"] == 0.0


BRIDGE_PATH = os.environ.get("MBRIDGE_OFFLOAD_BRIDGE_PATH")


@pytest.mark.skipif(
    not BRIDGE_PATH,
    reason="megatron-bridge is not importable here: run `make test-bridge` (installs megatron-bridge 0.3.1 into "
    ".bridge/ and sets MBRIDGE_OFFLOAD_BRIDGE_PATH)",
)
def test_bridge_setup_optimizer_builds_ours(tmp_path):
    paths = [tree.pythonpath(), *(str(ROOT / p) if not os.path.isabs(p) else p for p in BRIDGE_PATH.split(":"))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), HF_HUB_OFFLINE="1", MBRIDGE_OFFLOAD_WORKER_BRIDGE="1")
    out = tmp_path / "bridge.json"
    script = ROOT / "tests" / "support" / "megatron_optimizer_worker.py"
    proc = subprocess.run(
        [sys.executable, str(script), "1", str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=420
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())["bridge"]
    assert r["offload_True_ours"] and not r["offload_False_ours"]
    assert r["offload_True_groups"] == 2  # Bridge's no-weight-decay override reached our param groups
    # 3 steps vs Bridge's plain Adam: torch's single-tensor vs our fused kernel, within Adam's step bound (above)
    assert r["vs_plain"] <= five_step_bound(False, r["largest_weight"], steps=3)
