"""What one real megatron-core MoE layer saves for backward, measured on CPU in its own process.

``python tests/support/mcore_moe_saved.py CASE_JSON...`` with ``PYTHONPATH`` pointing at the megatron-core to measure
(the venv's 0.16.1, or ``.mcore/0.19.2``) builds, per case, the local spec's pre-MLP norm and ``MoELayer``
(``get_gpt_layer_local_spec(num_experts=...)``: router, alltoall or allgather dispatcher, ``SequentialMLP`` experts,
shared experts), bf16, EP 1 on a one-rank fake process group, runs one forward on real CPU tensors and counts every
tensor autograd saves (``torch.autograd.graph.saved_tensors_hooks``) once per storage, parameters left out. It prints
one JSON object: the version and per case the saved bytes by the module that saved them.

CPU stand-ins, none of which changes what is saved: CUDA streams and events are no-ops, ``device="cuda"`` becomes
the CPU, and ``te_general_gemm`` (imported only with Transformer Engine) is ``None`` so the router's gating linear
takes its torch path.
"""

from __future__ import annotations

import contextlib
import json
import sys
import warnings

import torch
from torch.overrides import TorchFunctionMode


class _Stream:
    """A CUDA stream or event stand-in: every wait and record is a no-op on one CPU stream."""

    def wait_stream(self, *args) -> None:
        return None

    def wait_event(self, *args) -> None:
        return None

    def record_event(self, *args) -> _Stream:
        return self

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__


class _CpuDevice(TorchFunctionMode):
    """Turns every ``device="cuda"`` argument (router and tracker buffers) into the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _cpu_stand_ins() -> None:
    stream = _Stream()
    torch.cuda.Stream = lambda *a, **k: stream  # type: ignore[assignment,misc]
    torch.cuda.Event = lambda *a, **k: stream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: stream  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.Tensor.record_stream = lambda self, *a: None  # type: ignore[method-assign]
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _init() -> None:
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    with contextlib.suppress(Exception):  # the CUDA RNG tracker is not needed on CPU
        model_parallel_cuda_manual_seed(1234)


def measure(case: dict) -> dict[str, int]:
    """Saved bytes by module of one pre-MLP norm + ``MoELayer`` forward for ``case`` (its keys: h, ffn, experts,
    topk, seq, glu, shared, dispatcher)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    h, glu = case["h"], case.get("glu", True)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=4, ffn_hidden_size=case["ffn"],
        moe_ffn_hidden_size=case["ffn"], num_moe_experts=case["experts"], moe_router_topk=case["topk"],
        moe_token_dispatcher_type=case.get("dispatcher", "alltoall"),
        moe_shared_expert_intermediate_size=case.get("shared") or None, gated_linear_unit=glu,
        activation_func=F.silu if glu else F.gelu, add_bias_linear=False, bias_activation_fusion=glu,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        use_cpu_initialization=True, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(num_experts=case["experts"])
    norm = build_module(spec.submodules.pre_mlp_layernorm, config=cfg, hidden_size=h, eps=1e-5)
    mlp = spec.submodules.mlp  # a ModuleSpec (0.16.1) or a builder to call (0.19.2's partial)
    moe = build_module(mlp, config=cfg) if isinstance(mlp, ModuleSpec) else mlp(config=cfg)
    where = ["outside"]

    def enter(name: str):
        return lambda mod, args: where.append(name) and None  # a hook returning None leaves args alone

    def leave(mod, args, out) -> None:
        where.pop()

    named = [("norm", norm), ("router", moe.router), ("experts", moe.experts), ("shared_experts", moe.shared_experts)]
    for name, module in named:
        if module is not None:
            module.register_forward_pre_hook(enter(name))
            module.register_forward_hook(leave)
    params = {p.untyped_storage().data_ptr() for p in [*norm.parameters(), *moe.parameters()]}
    seen: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in seen:
            seen[key] = (where[-1] if where[-1] != "outside" else "dispatcher", t.untyped_storage().nbytes())
        return t

    x = torch.randn(case["seq"], 1, h, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = moe(norm(x))
    out.float().sum().backward()  # the graph is a real one: backward runs on what was saved
    by_module: dict[str, int] = {}
    for module, nbytes in seen.values():
        by_module[module] = by_module.get(module, 0) + nbytes
    return by_module


def main() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core

        _cpu_stand_ins()
        _init()
        with _CpuDevice():
            results = [measure(json.loads(arg)) for arg in sys.argv[1:]]
    print(json.dumps({"version": megatron.core.__version__, "results": results}))


if __name__ == "__main__":
    main()
