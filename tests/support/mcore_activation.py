"""Our activation offload inside a real megatron-core ``GPTModel``, run in its own process per MCore version.

``python tests/support/mcore_activation.py`` with ``PYTHONPATH`` pointing at the megatron-core to test (the
venv's 0.16.1, or ``.mcore/0.19.2``) prints one JSON object: the version, the arguments ``TransformerBlock``
passed to the offload factory (by name, after our adapter bound them), and per case whether the losses and
gradients of a few training steps equal those without offload, with the offload accounting. The CPU shims of
``runtime.megatron.cpu_compat_shims`` are the only patches.
"""

from __future__ import annotations

import json
import warnings


def _train(model, steps: int = 3) -> list:
    import torch

    from mbridge_offload_runtime.megatron import tiny_batch

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for it in range(steps):
        loss = model(**tiny_batch(2, 32, 128, seed=it)).mean()
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    return out


def _case(name: str, **config) -> dict:
    import torch

    from mbridge_offload_runtime.megatron import build_tiny_gpt, install_activation_offload

    reference = _train(build_tiny_gpt(4, 64, 4, 128, 32))
    with install_activation_offload(min_tensor_size=1024) as installed:
        model = build_tiny_gpt(4, 64, 4, 128, 32, cpu_offloading=True, cpu_offloading_num_layers=2, **config)
    got = _train(model)
    equal = all(
        torch.equal(la, lb) and all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))
        for (la, ga), (lb, gb) in zip(got, reference, strict=True)
    )
    stats = model.decoder.offload_context.stats
    return {
        "case": name,
        "calls": [{k: v for k, v in call.items()} for call in installed.calls],
        "equal_to_no_offload": equal,
        "bytes_offloaded": stats.bytes_offloaded if stats else 0,
        "retain": model.decoder.offload_context.pool.retain,
    }


def main() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core
        from megatron.core.transformer import TransformerConfig

        from mbridge_offload_runtime.megatron import cpu_compat_shims

        cases = [("default", {})]
        if "cpu_offloading_retain_pinned_cpu_buffers" in TransformerConfig.__dataclass_fields__:
            cases.append(("retain", {"cpu_offloading_retain_pinned_cpu_buffers": True}))
        with cpu_compat_shims():
            results = [_case(name, **config) for name, config in cases]
    print(json.dumps({"version": megatron.core.__version__, "results": results}))


if __name__ == "__main__":
    main()
