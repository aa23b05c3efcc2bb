"""Megatron Bridge's performance summary (``data/performance_summary.yaml``): the step-time model's fit and accuracy.

Each published row becomes a ``ModelSpec`` and a ``Setup`` with that row's settings; its measured step time is
``GBS x seq / (tokens/s/GPU x GPUs)``. ``row_efficiency`` solves the compute efficiency at which the model's step
equals it; ``fit`` takes the geometric mean of those per group (GPU preset x precision x dense/MoE), which
``step_time.EFFICIENCY`` holds rounded (a test checks they agree); ``leave_one_out`` refits without each row in
turn. Never imports torch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

from mbridge_offload.plan.inputs.hardware import GpuPreset, gpu_preset
from mbridge_offload.plan.inputs.presets import model_preset
from mbridge_offload.plan.model.architecture import ModelSpec
from mbridge_offload.plan.model.run import Setup
from mbridge_offload.plan.time.terms import StepTerms, efficiency_key, step_terms
from mbridge_offload_tools.evidence import data_files

_FP8 = {"fp8-cs": "tensorwise", "fp8-mx": "mxfp8", "bf16": None}
_COLUMNS = ("gpu", "model", "gpus", "precision", "gbs", "mbs", "seq", "fsdp", "tp", "pp", "cp", "vp", "ep", "ga")


def load() -> dict[str, Any]:
    """The data file, parsed (``data/performance_summary.yaml``)."""
    return data_files.load("performance_summary")


@dataclass(frozen=True)
class Row:
    """One published row as the step-time model sees it."""

    label: str
    model: ModelSpec
    setup: Setup
    gpu: GpuPreset
    tokens_per_s_per_gpu: float

    @property
    def measured_step_s(self) -> float:
        tokens = (self.setup.global_batch_size or 0) * (self.setup.seq_length or self.model.seq_length)
        return tokens / (self.tokens_per_s_per_gpu * self.setup.num_gpus)

    @property
    def key(self) -> tuple[str, str, str]:
        return efficiency_key(self.model, self.setup, self.gpu)

    @property
    def terms(self) -> StepTerms:
        return step_terms(self.model, self.setup, self.gpu)


def model_spec(name: str) -> ModelSpec:
    """A model preset, or a model the data file gives inline by its Hugging Face config."""
    inline = load()["models"].get(name)
    return ModelSpec(name=name, **inline) if inline else model_preset(name)


def _row(values: list[Any]) -> Row:
    v = dict(zip(_COLUMNS, values[:-1], strict=True))
    setup = Setup(
        num_gpus=v["gpus"],
        tp=v["tp"],
        pp=v["pp"],
        vpp=v["vp"] if v["vp"] and v["vp"] > 1 else None,
        cp=v["cp"],
        ep=v["ep"],
        seq_length=v["seq"],
        micro_batch_size=v["mbs"],
        global_batch_size=v["gbs"],
        fp8_recipe=_FP8[v["precision"]],
        use_megatron_fsdp=bool(v["fsdp"]),
        fsdp_sharding_strategy="optim_grads_params" if v["fsdp"] else "no_shard",
        tp_comm_overlap=v["tp"] > 1,
        # Bridge's performance scripts force balanced routing on the mock data these rows ran (its MoE perf recipes
        # and the verification cards' performance items say so); the dispatcher and EP overlap are not published.
        moe_router_force_load_balancing=True,
    )
    label = f"{v['gpu']} {v['model']} {v['precision']} TP{v['tp']} PP{v['pp']} CP{v['cp']} EP{v['ep']} x{v['gpus']}"
    return Row(label, model_spec(v["model"]), setup, gpu_preset(v["gpu"]), float(values[-1]))


@lru_cache(maxsize=1)
def rows() -> tuple[Row, ...]:
    """Every published row."""
    return tuple(_row(r) for r in load()["rows"])


@cache
def row_efficiency(index: int) -> float:
    """The compute efficiency at which row ``index``'s predicted step equals its measured one."""
    r = rows()[index]
    eff = r.terms.efficiency_for(r.measured_step_s)
    if eff is None:
        raise ValueError(f"{r.label}: no efficiency in (0, 1.5] reproduces {r.measured_step_s:.3f} s")
    return eff


def fit(leave_out: int | None = None) -> dict[tuple[str, str, str], float]:
    """Efficiency per (GPU preset, precision, dense/moe): the geometric mean over that group's rows."""
    logs: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for i, r in enumerate(rows()):
        if i != leave_out:
            logs[r.key].append(math.log(row_efficiency(i)))
    return {k: math.exp(sum(v) / len(v)) for k, v in logs.items()}


def predicted_tokens(index: int, efficiencies: dict[tuple[str, str, str], float]) -> float | None:
    """Row ``index``'s tokens/s/GPU at the given efficiencies (None when its group has none)."""
    r = rows()[index]
    eff = efficiencies.get(r.key)
    if eff is None:
        return None
    return r.tokens_per_s_per_gpu * r.measured_step_s / r.terms.step(eff)


def errors() -> list[tuple[str, float, float | None]]:
    """Per row: its label, the relative error of the fitted model, and the leave-one-out error (None when the row
    is alone in its group)."""
    fitted = fit()
    out = []
    for i, r in enumerate(rows()):
        pred = predicted_tokens(i, fitted) or 0.0
        loo = predicted_tokens(i, fit(leave_out=i))
        out.append(
            (r.label, pred / r.tokens_per_s_per_gpu - 1, None if loo is None else loo / r.tokens_per_s_per_gpu - 1)
        )
    return out


def render_table() -> str:
    """The step-time model's accuracy per published row (docs/planner.md, section step-time; generated)."""
    lines = [
        "| row (GPU, model, precision, layout) | published tokens/s/GPU | predicted | error | leave-one-out |",
        "|---|---|---|---|---|",
    ]
    fitted = fit()
    for i, (label, err, loo) in enumerate(errors()):
        r = rows()[i]
        pred = predicted_tokens(i, fitted) or 0.0
        loo_text = "— (alone in its group)" if loo is None else f"{loo:+.1%}"
        lines.append(f"| {label} | {r.tokens_per_s_per_gpu:g} | {pred:.0f} | {err:+.1%} | {loo_text} |")
    groups = ", ".join(f"{'/'.join(k)} {v:.3f}" for k, v in fitted.items())
    lines += [
        "",
        f"Fitted compute efficiencies (GPU preset/precision/kind): {groups}. Source: Megatron Bridge "
        "performance summary page (NVIDIA-NeMo/Megatron-Bridge, NeMo 25.11), copied with its settings into "
        "`tools/mbridge_offload_tools/evidence/data/performance_summary.yaml`; the settings it does not publish "
        "(recompute, TP overlap, ETP) are assumed as that file says. Measured by NVIDIA; none was run by this project.",
    ]
    return "\n".join(lines) + "\n"
