"""Oracle for the differential test: evaluate generated configs with the *real* megatron-core.

Run once per installed megatron-core version, in its own process (``python tests/support/mcore_oracle.py < cases.json``,
with ``PYTHONPATH`` pointing at the version to test). Reads ``{"cases": [{"id", "model", "optimizer"}]}`` on
stdin and prints one JSON object: the version, the dataclass field names, and per case the outcome of three
upstream stages, each ``null`` (passed) or ``{"type", "message"}``:

- ``transformer``: ``TransformerConfig(num_layers=…, hidden_size=64, num_attention_heads=4, **model)``.
  ``pipeline_dtype`` arrives as a short name (``"fp32"``) and becomes a torch dtype. Keys that are not fields
  of this version's dataclass are dropped and listed in ``dropped`` (a 0.16.1 config cannot carry them).
- ``optimizer_config``: ``OptimizerConfig(lr=1e-3, **optimizer)`` (``skip_megatron_wrapping`` is not a field).
- ``factory``: the real ``_get_megatron_optimizer_based_on_param_groups`` — where the offload asserts
  (``decoupled_weight_decay``, ``skip_megatron_wrapping``) live — called with one CPU parameter group. Its
  checks run for real; the one thing replaced is the ``HybridDeviceOptimizer`` constructor, which needs CUDA
  streams, by a sentinel that makes the constructor's first use of the config (the offload fraction times the
  GPU parameters' size, compared with a count: a TypeError for text, a list or null) and then stops the call.
  It is only called when the optimizer config was accepted and either ``optimizer_cpu_offload`` or
  ``skip_megatron_wrapping`` is set (otherwise the function goes on to wrap a plain optimizer, which needs CUDA);
  ``"not-run"`` otherwise.

Two labelled environment stand-ins, because this machine has no Transformer Engine: ``is_te_min_version``
in ``optimizer_config`` returns True (TE ≥ 2.1 present, as in any training environment; without it 0.16.1
raises a TypeError comparing None with a Version). Nothing else is patched.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import warnings


class _ChecksPassed(Exception):
    """Raised by the HybridDeviceOptimizer stand-in: the factory got past all of its checks."""


def _outcome(fn):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
    except _ChecksPassed:
        return None
    except Exception as exc:  # the verdict is whatever upstream raises
        return {"type": type(exc).__name__, "message": str(exc)}
    return None


def main() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core
        import megatron.core.optimizer as mopt
        import megatron.core.optimizer.optimizer_config as mopt_config
        import torch
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer import TransformerConfig

    mopt_config.is_te_min_version = lambda *args, **kwargs: True

    class _HDOSentinel:
        def __init__(self, *args, offload_fraction=0.5, **kwargs):
            # The first use of the config in the real constructor (HybridDeviceOptimizer.
            # _get_sub_optimizer_param_groups, both releases): `threshold = gpu_params_total_numel *
            # offload_fraction`, then `offload_params_numel < threshold`; here no parameter is on a GPU (0).
            threshold = 0 * offload_fraction
            _ = 0 < threshold  # noqa: SIM300 -- upstream's operand order decides the TypeError's text
            raise _ChecksPassed

    mopt.HybridDeviceOptimizer = _HDOSentinel
    factory = mopt._get_megatron_optimizer_based_on_param_groups
    factory_args = set(inspect.signature(factory).parameters)

    tc_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    oc_fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

    cases = json.load(sys.stdin)["cases"]
    results = []
    for case in cases:
        model = dict(case["model"])
        dropped = sorted(k for k in model if k not in tc_fields)
        kwargs = {k: v for k, v in model.items() if k in tc_fields}
        for key in ("pipeline_dtype", "params_dtype"):
            if isinstance(kwargs.get(key), str) and kwargs[key] in dtypes:
                kwargs[key] = dtypes[kwargs[key]]
        kwargs.setdefault("hidden_size", 64)
        kwargs.setdefault("num_attention_heads", 4)
        transformer = _outcome(lambda kw=kwargs: TransformerConfig(**kw))

        opt = dict(case["optimizer"])
        skip = bool(opt.pop("skip_megatron_wrapping", False))
        dropped += sorted(f"optimizer.{k}" for k in opt if k not in oc_fields)
        okw = {k: v for k, v in opt.items() if k in oc_fields}
        for key in ("params_dtype", "main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            if isinstance(okw.get(key), str) and okw[key] in dtypes:  # Bridge YAML: {_target_: torch.bfloat16}
                okw[key] = dtypes[okw[key]]
        holder: dict = {}

        def build(okw=okw, holder=holder):
            holder["config"] = OptimizerConfig(**{"lr": 1e-3, **okw})

        optimizer_config = _outcome(build)
        factory_outcome: object = "not-run"
        config = holder.get("config")
        run_factory = config is not None and (config.optimizer_cpu_offload or skip)
        if run_factory and skip and "skip_megatron_wrapping" not in factory_args:
            run_factory = config.optimizer_cpu_offload  # 0.16.1 has no such argument: the flag does not exist
            skip = False
        if run_factory:
            extra = {"skip_megatron_wrapping": True} if skip else {}
            groups = [
                {
                    "params": [torch.nn.Parameter(torch.zeros(4))],
                    "wd_mult": 1.0,
                    "lr_mult": 1.0,
                    "is_expert_parallel": False,
                    "is_decoupled_lr": False,
                }
            ]
            factory_outcome = _outcome(lambda c=config, g=groups, e=extra: factory(c, [], g, **e))
        results.append(
            {
                "id": case["id"],
                "transformer": transformer,
                "optimizer_config": optimizer_config,
                "factory": factory_outcome,
                "dropped": dropped,
            }
        )

    json.dump(
        {
            "version": megatron.core.__version__,
            "transformer_fields": sorted(tc_fields),
            "optimizer_fields": sorted(oc_fields),
            "results": results,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
