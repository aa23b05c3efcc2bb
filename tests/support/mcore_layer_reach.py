"""What a real megatron-core's GPT block and hybrid stack do with layer-level offload and full recompute, on CPU.

``python tests/support/mcore_layer_reach.py`` with ``PYTHONPATH`` pointing at the megatron-core to test (the venv's
0.16.1, or ``.mcore/0.19.2``) prints one JSON object. It builds a ``TransformerBlock`` and the release's hybrid stack
(0.16.1 ``MambaStack``, 0.19.2 ``HybridStack``) from the same local-spec transformer layers (pattern ``*-*-``, no
Mamba layer: mamba_ssm's kernels need CUDA) and reports, per container:

- ``offload``: how often the container asked for a CPU-offload context (our runtime is installed in megatron-core's
  place, ``runtime.megatron.install_activation_offload``) and how many bytes a forward/backward offloaded;
- ``full_checkpoints``: how many ``tensor_parallel.checkpoint`` calls one forward made under
  ``recompute_granularity=full``.

The CPU shims of ``runtime.megatron.cpu_compat_shims`` are the only patches; the checkpoint counter wraps
``tensor_parallel.checkpoint`` and calls it.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

LAYERS, HIDDEN, HEADS, SEQ, BATCH = 4, 64, 4, 16, 2


def _config(**fields: Any):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        transformer_impl="local",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **fields,
    )


def _stack(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    pg = ProcessGroupCollection.use_mpu_process_groups()
    spec = get_gpt_layer_local_spec()
    try:  # 0.19.2: the stack takes the pattern pre-split by HybridModel
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules

        subs = HybridStackSubmodules(attention_layer=spec, mlp_layer=spec)
        return HybridStack(config, subs, layer_type_list=list("*-*-"), post_layer_norm=False, pg_collection=pg)
    except ImportError:  # 0.16.1
        from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules

        subs = MambaStackSubmodules(attention_layer=spec, mlp_layer=spec)
        return MambaStack(config, subs, hybrid_override_pattern="*-*-", post_layer_norm=False, pg_collection=pg)


def _block(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    return TransformerBlock(config, get_gpt_layer_local_spec(), post_layer_norm=False)


def _step(module) -> None:
    import torch

    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    out = module(hidden_states=x, attention_mask=mask)
    (out[0] if isinstance(out, tuple) else out).sum().backward()


def _offload(build) -> dict[str, int]:
    from mbridge_offload_runtime.megatron import install_activation_offload

    with install_activation_offload(min_tensor_size=16) as installed:
        module = build(_config(cpu_offloading=True, cpu_offloading_num_layers=2))
    _step(module)
    stats = getattr(getattr(module, "offload_context", None), "stats", None)
    return {"calls": len(installed.calls), "bytes": stats.bytes_offloaded if stats else 0}


def _full_checkpoints(build, method: str) -> int:
    from megatron.core import tensor_parallel

    calls: list[int] = []
    original = tensor_parallel.checkpoint

    def counting(*args: Any, **kwargs: Any):
        calls.append(1)
        return original(*args, **kwargs)

    tensor_parallel.checkpoint = counting  # the blocks look it up on the module at call time
    try:
        _step(build(_config(recompute_granularity="full", recompute_method=method, recompute_num_layers=1)))
    finally:
        tensor_parallel.checkpoint = original
    return len(calls)


def main() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core
        import torch
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from mbridge_offload_runtime.megatron import cpu_compat_shims, ensure_model_parallel

        ensure_model_parallel()
        out: dict[str, Any] = {"version": megatron.core.__version__}
        with cpu_compat_shims():
            torch.manual_seed(0)
            model_parallel_cuda_manual_seed(0)
            for name, build in (("block", _block), ("hybrid", _stack)):
                out[name] = {
                    "offload": _offload(build),
                    "full_checkpoints": {m: _full_checkpoints(build, m) for m in ("uniform", "block")},
                }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
