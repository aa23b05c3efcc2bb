"""Worker for tests/runtime/test_optimizer_megatron.py: our HDO inside real megatron-core training, on CPU.

``python tests/support/megatron_optimizer_worker.py WORLD_SIZE OUT.json`` (``PYTHONPATH`` selects the megatron-core
version). Spawns WORLD_SIZE gloo ranks; each builds a real tiny ``GPTModel``, wraps it in Megatron's
``DistributedDataParallel`` and gets its optimizer from the real ``get_megatron_optimizer`` with
``optimizer_cpu_offload=True`` after :func:`install_optimizer_offload`, for two set-ups:

- ``fp32``: fp32 model, no distributed optimizer (Megatron's ``FP32Optimizer`` wrapper);
- ``f16``: bf16 model, no distributed optimizer (``Float16OptimizerWithFloat16Params``, which swaps each bf16
  parameter of the HDO's groups for its fp32 main copy after the HDO is built; megatron-core's own HDO fails there
  with a KeyError at its first step, NVIDIA/Megatron-LM#4042);
- ``do``: bf16 model, distributed optimizer with the precision-aware path (``DistributedOptimizer`` re-creates
  the HDO over its bf16 shards, the HDO keeps the fp32 masters), against Megatron's bf16 DO + plain Adam.

Rank 0 writes one JSON object with the figures the test asserts on (the test, not this worker, decides).

CPU stand-ins (labelled; megatron-core's optimizer wrappers assume CUDA tensors), beside the two of
``cpu_compat_shims``: SHIM-CUDA-FACTORY: ``device="cuda"`` in a tensor factory becomes the CPU and ``.cuda()``
returns the tensor (``found_inf``, ``_scale``, the grad-norm buffers); SHIM-CUDA-TYPE: ``Tensor.type()`` reports
``torch.cuda.*`` names (the wrappers sort parameters by ``param.type() == 'torch.cuda.FloatTensor'``). Nothing
in the optimizer logic (ours or Megatron's) is replaced. SHIM-CUDA-SYNC: ``torch.cuda.synchronize`` is a no-op
(dist-checkpointing waits for the device before writing; CPU work is already complete). SHIM-TE-VERSION:
``optimizer_config.is_te_min_version`` returns True, as in any TE install (0.16.1's precision-aware check compares
TE's version and raises a TypeError without TE; tests/support/mcore_oracle.py does the same). SHIM-CUDA-STREAM:
``torch.cuda.current_stream()`` is a stream whose work is done (0.19.2's DDP grad sync waits on it for CUDA-graph
events). Our runtime never sees these: it asks ``runtime.device``, which finds no CUDA and uses its own no-ops.
SHIM-ADAM-KERNEL (one comparison only, :func:`plain_adam_kernel`): every ``torch.optim.AdamW`` built inside runs
torch's single-tensor kernel, the one Megatron's plain Adam runs on a machine without TE or Apex, instead of the
fused kernel our HDO picks by default; the optimizer logic on both sides stays as it is.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings

import torch
from torch.overrides import TorchFunctionMode

_TYPE = torch.Tensor.type
_CUDA = torch.Tensor.cuda
STEPS, SPLIT_AT = 5, 3
FRACTIONS = (0.0, 0.5, 1.0)


class _DoneStream:
    """SHIM-CUDA-STREAM: the current stream, with every queued piece of work already complete (CPU is synchronous)."""

    def wait_event(self, event: object) -> None:
        return None

    def wait_stream(self, stream: object) -> None:
        return None


class CudaOnCpu(TorchFunctionMode):
    """SHIM-CUDA-FACTORY and SHIM-CUDA-TYPE (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = "cpu"
        if func is _CUDA:
            return args[0]
        if func is _TYPE and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def plain_adam_kernel():
    """SHIM-ADAM-KERNEL: torch AdamW built here runs the single-tensor kernel (no ``fused`` flag anywhere)."""
    init = torch.optim.AdamW.__init__

    def single_tensor(self, params, *args, fused=None, **kwargs):
        params = list(params)
        if params and isinstance(params[0], dict):
            params = [{k: v for k, v in group.items() if k != "fused"} for group in params]
        init(self, params, *args, **kwargs)

    torch.optim.AdamW.__init__ = single_tensor
    try:
        yield
    finally:
        torch.optim.AdamW.__init__ = init


def build(setup: str, fraction: float | None, seed: int = 1234):
    """A DDP-wrapped tiny GPT and Megatron's optimizer for it (``fraction=None``: offload off, plain Adam)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from mbridge_offload_runtime.megatron import build_tiny_gpt

    bf16, use_do = setup in ("f16", "do"), setup == "do"
    model = build_tiny_gpt(2, 64, 4, 128, 32, seed=seed, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else None)
    if bf16:
        model = Float16Module(model.config, model)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=use_do, grad_reduce_in_fp32=True)
    model = DistributedDataParallel(model.config, ddp, model)
    config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        weight_decay=0.01,
        bf16=bf16,
        use_distributed_optimizer=use_do,
        optimizer_cpu_offload=fraction is not None,
        optimizer_offload_fraction=fraction or 0.0,
        # Megatron-LM requires the precision-aware path with optimizer_cpu_offload (validate_args): the HDO holds
        # the fp32 masters and reads ``decoupled_grad``; checkpoints go through its ``state`` and the sync hook.
        use_precision_aware_optimizer=use_do and fraction is not None,
    )
    return model, get_megatron_optimizer(config, [model])


def inner(opt):
    """The torch optimizer inside Megatron's wrapper (through a one-element ChainedOptimizer)."""
    wrappers = getattr(opt, "chained_optimizers", [opt])
    assert len(wrappers) == 1
    return wrappers[0].optimizer


def train(model, opt, first: int, last: int) -> None:
    from mbridge_offload_runtime.megatron import tiny_batch

    rank = torch.distributed.get_rank()
    for it in range(first, last):
        model.zero_grad_buffer()
        opt.zero_grad()
        model(**tiny_batch(2, 32, 128, seed=100 * it + rank)).float().mean().backward()
        model.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok


def weights(model) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in model.parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def dist_ckpt_round_trip(model, opt, setup: str, fraction: float, ckpt_dir: str):
    """Save with megatron's dist-checkpointing, load into a new model (other init) + optimizer at ``fraction``."""
    from megatron.core import dist_checkpointing

    # 'fully_reshardable' (Megatron-LM's default for the distributed optimizer): its load ends in
    # load_parameter_state_from_fully_reshardable, which calls the HDO hook _sync_hdo_state_to_sub_optimizers.
    meta = {"distrib_optim_sharding_type": "fully_reshardable"}
    optim = opt.sharded_state_dict(model.sharded_state_dict(), metadata=meta)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "optimizer": optim}, ckpt_dir)
    model2, opt2 = build(setup, fraction, seed=999)
    # Without TE/Apex (this CPU machine) DistributedOptimizer.state_dict() reads 'step' from every state entry,
    # which a fresh optimizer has none of; with TE (any GPU install) it takes its HDO branch instead. Materialize
    # the state first, as DistributedOptimizer.load_state_dict itself does for an HDO (dummy_step).
    inner(opt2).dummy_step()
    sharded = {"model": model2.sharded_state_dict()}
    sharded["optimizer"] = opt2.sharded_state_dict(model2.sharded_state_dict(), is_loading=True, metadata=meta)
    loaded = dist_checkpointing.load(sharded, ckpt_dir)
    # The sharded keys carry Float16Module's "module." prefix; its load_state_dict forwards to the GPT without it.
    model2.load_state_dict({k.removeprefix("module."): v for k, v in loaded["model"].items()})
    opt2.load_state_dict(loaded["optimizer"])
    return model2, opt2


def dp_zero_round_trip(model, opt, setup: str, fraction: float, path: str):
    """Megatron's legacy distributed-optimizer checkpoint: ``state_dict()`` plus ``save_parameter_state`` (gathered
    on DP rank 0 over gloo), loaded with ``load_state_dict`` + ``load_parameter_state``, which writes each loaded
    tensor into ``optimizer.state[param][key]`` (no sync hook on this path)."""
    common = opt.state_dict()
    opt.save_parameter_state(path)
    torch.distributed.barrier()
    model2, opt2 = build(setup, fraction, seed=999)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(common)
    opt2.load_parameter_state(path)
    return model2, opt2


def torch_state_round_trip(model, opt, setup: str, fraction: float | None, path: str):
    """Megatron's (non-distributed) optimizer ``state_dict`` through torch.save, loaded at ``fraction``."""
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    ckpt = torch.load(path, weights_only=False)
    model2, opt2 = build(setup, fraction, seed=999)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    return model2, opt2


def scenario(setup: str, tmp: str, first_steps: dict) -> dict:
    """The figures of one set-up; ``first_steps`` gets the weights after step 1 (Megatron's plain Adam and ours at
    each fraction, default kernels) for the test to compare element by element."""
    from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer

    out: dict = {}
    model, opt = build(setup, None)
    out["plain_inner"] = type(inner(opt)).__name__
    train(model, opt, 0, 1)
    first_steps["plain"] = weights(model)
    train(model, opt, 1, STEPS)
    plain = weights(model)
    full = {}
    for f in FRACTIONS:
        model, opt = build(setup, f)
        hdo = inner(opt)
        out[f"ours_{f}"] = isinstance(hdo, HybridDeviceOptimizer)
        out[f"achieved_{f}"] = hdo.offloaded_fraction
        train(model, opt, 0, 1)
        first_steps[f] = weights(model)
        train(model, opt, 1, STEPS)
        full[f] = weights(model)
        out[f"vs_plain_adam_{f}"] = max_diff(full[f], plain)
        with plain_adam_kernel():  # the same five steps with the kernel Megatron's plain Adam runs
            model, opt = build(setup, f)
            train(model, opt, 0, STEPS)
        out[f"same_kernel_vs_plain_adam_{f}"] = max_diff(weights(model), plain)
    out["fractions_bit_identical"] = all(same(full[f], full[0.5]) for f in FRACTIONS)
    rank = torch.distributed.get_rank()
    for f2 in (0.0, 1.0):
        # Without the distributed optimizer, megatron-core's FP32Optimizer.sharded_state_dict(is_loading=True) calls
        # init_state_fn, which its factory sets to None for optimizer_cpu_offload (upstream's HDO fails the same
        # way): that set-up checkpoints through the optimizer's torch state_dict instead.
        for kind in ("dist_ckpt", "dp_zero") if setup == "do" else ("torch",):
            model, opt = build(setup, 0.5)
            train(model, opt, 0, SPLIT_AT)
            path = os.path.join(tmp, f"{setup}_{kind}_{f2}")
            os.makedirs(path, exist_ok=True)
            torch.distributed.barrier()
            if kind == "dist_ckpt":
                model2, opt2 = dist_ckpt_round_trip(model, opt, setup, f2, path)
            elif kind == "dp_zero":
                model2, opt2 = dp_zero_round_trip(model, opt, setup, f2, os.path.join(path, "param_state.pt"))
            else:
                model2, opt2 = torch_state_round_trip(model, opt, setup, f2, f"{path}_{rank}.pt")
            train(model2, opt2, SPLIT_AT, STEPS)
            out[f"resume_{kind}_0.5_to_{f2}_bit_exact"] = same(weights(model2), full[0.5])
            out[f"resume_{kind}_0.5_to_{f2}_diff"] = max_diff(weights(model2), full[0.5])
    if setup == "fp32":  # offload turned off: Megatron's plain Adam loads the HDO checkpoint
        model, opt = build(setup, 0.5)
        train(model, opt, 0, SPLIT_AT)
        model2, opt2 = torch_state_round_trip(model, opt, setup, None, os.path.join(tmp, f"off_{rank}.pt"))
        train(model2, opt2, SPLIT_AT, STEPS)
        out["resume_offload_off_vs_uninterrupted"] = max_diff(weights(model2), full[0.5])
    return out


def bridge_scenario() -> dict:
    """Megatron Bridge's ``setup_optimizer`` (training/optim.py) with our install: it builds ours, and trains.

    Bridge imports Transformer Engine unconditionally, so the labelled TE import stub of tests/support/te_stub.py
    is installed after megatron-core (which keeps HAVE_TE=False) and after the models are built (megatron-core's
    layers must not see the stub), before Bridge is imported.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from mbridge_offload_runtime.megatron import build_tiny_gpt
    from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer
    from tests.support import te_stub

    models = {}
    for offload in (False, True):
        model = build_tiny_gpt(2, 64, 4, 128, 32)
        models[offload] = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    te_stub.install("2.12.0")
    from megatron.bridge.training.config import SchedulerConfig
    from megatron.bridge.training.optim import setup_optimizer

    out = {}
    for offload, model in models.items():
        config = OptimizerConfig(
            lr=1e-3, min_lr=0.0, weight_decay=0.01, optimizer_cpu_offload=offload, optimizer_offload_fraction=0.5
        )
        sched = SchedulerConfig(lr_decay_style="constant", start_weight_decay=0.01, end_weight_decay=0.01)
        sched.lr_warmup_steps, sched.lr_decay_steps, sched.wd_incr_steps = 0, 10, 10  # ConfigContainer sets these
        opt, _ = setup_optimizer(config, sched, [model], use_gloo_process_groups=True)
        hdo = inner(opt)
        out[f"offload_{offload}_ours"] = isinstance(hdo, HybridDeviceOptimizer)
        out[f"offload_{offload}_groups"] = len(hdo.param_groups)  # Bridge's no-weight-decay overrides: 2 groups
        train(model, opt, 0, 3)
        out[f"offload_{offload}_weights"] = weights(model)
    out["largest_weight"] = max(w.abs().max().item() for w in out["offload_False_weights"])
    out["vs_plain"] = max_diff(out.pop("offload_True_weights"), out.pop("offload_False_weights"))
    return out


def upstream_first_step(setup: str) -> str | None:
    """megatron-core's own HDO (ours not installed) through one step of ``setup``: the exception's type, or None."""
    model, opt = build(setup, 0.5)
    try:
        train(model, opt, 0, 1)
    except Exception as exc:  # what upstream raises is the finding (the test asserts which)
        return type(exc).__name__
    return None


def rank_main(rank: int, world: int, store_path: str, out_path: str) -> None:
    warnings.simplefilter("ignore")
    store = torch.distributed.FileStore(store_path, world)
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=world)
    from megatron.core import parallel_state

    from mbridge_offload_runtime.megatron import cpu_compat_shims
    from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer
    from mbridge_offload_runtime.optimizer.megatron import install_optimizer_offload

    parallel_state.initialize_model_parallel(1, 1)
    import megatron.core.optimizer.optimizer_config as optimizer_config

    optimizer_config.is_te_min_version = lambda *args, **kwargs: True  # SHIM-TE-VERSION
    import megatron.core

    result = {"version": megatron.core.__version__, "world": world}
    tmp = os.path.dirname(os.path.abspath(out_path))  # shared by the ranks (dist-checkpointing writes there)
    torch.cuda.synchronize = lambda *args, **kwargs: None  # SHIM-CUDA-SYNC (this worker process only)
    torch.cuda.current_stream = lambda *args, **kwargs: _DoneStream()  # SHIM-CUDA-STREAM (0.19.2's DDP grad sync)
    calls = [0]
    hook = HybridDeviceOptimizer._sync_hdo_state_to_sub_optimizers

    def counted(self):  # a spy: counts the DistributedOptimizer's calls of the hook, then runs it unchanged
        calls[0] += 1
        return hook(self)

    HybridDeviceOptimizer._sync_hdo_state_to_sub_optimizers = counted
    with cpu_compat_shims(), CudaOnCpu():
        with install_optimizer_offload() as installed:
            result["patched_modules"] = sorted(m.__name__ for m in installed.patched)
            if os.environ.get("MBRIDGE_OFFLOAD_WORKER_BRIDGE") == "1":
                result["bridge"] = bridge_scenario()
            else:
                first_steps: dict = {}
                for setup in ("fp32", "f16", "do"):
                    result[setup] = scenario(setup, tmp, first_steps.setdefault(setup, {}))
                if rank == 0:  # rank 0's shard of the model is the whole model (data parallel): its weights
                    torch.save(first_steps, os.path.splitext(out_path)[0] + ".step1.pt")
        import megatron.core.optimizer as mopt

        result["restored"] = mopt.HybridDeviceOptimizer is installed.upstream
        result["f16_upstream_first_step"] = upstream_first_step("f16")
    result["sync_hook_calls"] = calls[0]
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(result, fh)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    world, out_path = int(sys.argv[1]), sys.argv[2]
    store_path = out_path + ".store"
    if world == 1:
        rank_main(0, 1, store_path, out_path)
    else:
        torch.multiprocessing.spawn(rank_main, args=(world, store_path, out_path), nprocs=world)


if __name__ == "__main__":
    main()
