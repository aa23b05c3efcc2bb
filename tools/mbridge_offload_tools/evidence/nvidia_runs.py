"""Every NVIDIA-measured run the planner is held to, in one table: the model verification cards' rows
(``data/nvidia_runs.yaml``) with the rows kept beside them — Megatron Bridge's performance summary
(``performance_summary.yaml``, throughput), the recipe docstrings (``published_recipes.yaml``) and the CPU-offloading
card (``published.yaml``). Rows a planner constant was fitted on carry ``fitted``; the headline counts only the
others. Rendered into ``docs/planner.md`` (``render_table``) and held to the goal (memory within 10 %, step time
within 20 %) by ``tests/tools/test_nvidia_runs.py``. Never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from mbridge_offload_tools.evidence import data_files

MEMORY_GOAL = 0.10
STEP_GOAL = 0.20
_FP8 = {"fp8-cs": "tensorwise", "fp8-mx": "mxfp8", "bf16": None}


@dataclass(frozen=True)
class RunRow:
    """One published figure with the planner's prediction, in the figure's own unit."""

    id: str
    kind: str  # memory | step
    unit: str  # as published: GiB, ms, tokens/s/GPU (compared as step time), ...
    published: float
    predicted: float
    source: str
    revision: str
    fitted: bool
    moe: bool
    settings: str
    traced: float | None = None  # the trace's figure (stored: data/nvidia_runs_traced.yaml), in the row's unit
    trace_note: str = "not traced"  # why there is no trace figure, where there is none

    @property
    def error(self) -> float:
        """Predicted over published, less one (tokens/s rows: the step time's error)."""
        if self.unit == "tokens/s/GPU":
            return self.published / self.predicted - 1
        return self.predicted / self.published - 1

    @property
    def within_goal(self) -> bool:
        return abs(self.error) <= (MEMORY_GOAL if self.kind == "memory" else STEP_GOAL)


def load() -> dict[str, Any]:
    """The data file, parsed (``data/nvidia_runs.yaml``)."""
    return data_files.load("nvidia_runs")


def card_setup(row: dict[str, Any]) -> Any:
    """The planner's ``Setup`` for one card row."""
    from mbridge_offload.plan.model.run import Setup

    recompute = str(row.get("recompute", "none"))
    granularity: str | None = None
    modules: tuple[str, ...] = ("core_attn",)
    if recompute.startswith("selective"):
        granularity = "selective"
        modules = tuple(m.strip() for m in recompute.partition(":")[2].split(",") if m.strip())
    elif recompute.startswith("full"):
        granularity = "full"
    return Setup(
        num_gpus=row["num_gpus"],
        tp=row["tp"],
        pp=row["pp"],
        vpp=row.get("vpp"),
        cp=row["cp"],
        ep=row["ep"],
        etp=row.get("etp"),
        seq_length=row["seq"],
        micro_batch_size=row["mbs"],
        global_batch_size=row["gbs"],
        fp8_recipe=_FP8[row["precision"]],
        recompute_granularity=granularity,
        recompute_modules=modules,
        tp_comm_overlap=row["tp"] > 1,
        moe_token_dispatcher_type="flex" if row.get("dispatcher") in ("deepep", "hybridep") else "alltoall",
        overlap_moe_expert_parallel_comm=bool(row.get("ep_overlap")),
        moe_router_force_load_balancing=bool(row.get("forced_balance")),
        cuda_graph_impl=str(row.get("cuda_graph", "none")),
    )


def _settings(row: dict[str, Any]) -> str:
    vpp = f" VPP{row['vpp']}" if row.get("vpp") else ""
    return (
        f"{row['num_gpus']}x {row['gpu']} TP{row['tp']} PP{row['pp']}{vpp} CP{row['cp']} EP{row['ep']} "
        f"MBS{row['mbs']} GBS{row['gbs']} seq{row['seq']} {row['precision']}"
    )


def _card_rows() -> list[RunRow]:
    from mbridge_offload.plan.inputs.hardware import gpu_preset
    from mbridge_offload.plan.time.terms import efficiency, step_terms
    from mbridge_offload_tools.evidence.step_fit import model_spec

    data, out = load(), []
    for row in data["rows"]:
        m, s, gpu = model_spec(row["model"]), card_setup(row), gpu_preset(row["gpu"])
        predicted = step_terms(m, s, gpu).step(efficiency(m, s, gpu)[0])
        out.append(
            RunRow(
                row["id"],
                "step",
                "ms",
                row["step_ms"],
                predicted * 1000,
                f"model verification card {row['card']}: {row['item']}",
                row["revision"],
                False,
                m.is_moe,
                _settings(row),
            )
        )
    return out


def _summary_rows() -> list[RunRow]:
    from mbridge_offload_tools.evidence.step_fit import fit, rows

    efficiencies, out = fit(), []
    for r in rows():
        predicted = r.terms.step(efficiencies[r.key])
        tokens = r.tokens_per_s_per_gpu * r.measured_step_s / predicted
        out.append(
            RunRow(
                r.label,
                "step",
                "tokens/s/GPU",
                r.tokens_per_s_per_gpu,
                tokens,
                "Megatron Bridge docs/performance-summary.md (NeMo 25.11)",
                "commit 00b7660be0254ac6f95f44164ddd0c3e9cc798ed",
                True,
                r.model.is_moe,
                f"GBS{r.setup.global_batch_size} MBS{r.setup.micro_batch_size} seq{r.setup.seq_length}",
            )
        )
    return out


def memory_model(name: str) -> Any:
    """A model the memory rows give inline (``memory_models``), else a preset or a performance-summary model."""
    from mbridge_offload.plan.model.architecture import MLASpec, ModelSpec
    from mbridge_offload_tools.evidence.step_fit import model_spec

    inline = load().get("memory_models", {}).get(name)
    if inline is None:
        return model_spec(name)
    mla = inline.get("mla")
    return ModelSpec(name=name, **{**inline, "mla": MLASpec(**mla) if mla else None})


def memory_setup(row: dict[str, Any]) -> Any:
    """The planner's ``Setup`` for one memory row: its defaults, with the row's ``setup`` fields."""
    from mbridge_offload.plan.model.run import Setup

    fields = dict(row["setup"])
    if "recompute_modules" in fields:
        fields["recompute_modules"] = tuple(fields["recompute_modules"])
    return Setup(**fields)


def _in_unit(nbytes: float, unit: str) -> float:
    from mbridge_offload.plan.model.architecture import GB, GiB

    return nbytes / {"GiB": GiB, "GB": GB}[unit]


def _trace_cell(m: Any, s: Any, row_id: str, unit: str) -> tuple[float | None, str]:
    """The stored trace figure for a row (the trace's peak plus ``Setup.overhead_gb``, the allocator workspaces the
    trace cannot see, as the differential adds them), or why the row cannot be traced."""
    from mbridge_offload.plan.model.architecture import GB, GiB
    from mbridge_offload_tools.trace.spec import unsupported

    missing = unsupported(m, s)
    if missing:
        return None, f"not traced: {missing[0]}"
    stored = data_files.load("nvidia_runs_traced")["rows"].get(row_id)
    if stored is None:
        return None, "not traced yet"
    return _in_unit(stored["peak_gib"] * GiB + s.overhead_gb * GB, unit), ""


def _memory_rows() -> list[RunRow]:
    from mbridge_offload.plan.memory.stage import estimate_memory

    out = []
    for row in load().get("memory_rows", []):
        m, s = memory_model(row["model"]), memory_setup(row)
        predicted = _in_unit(estimate_memory(m, s).worst.total, row["unit"])
        traced, note = _trace_cell(m, s, row["id"], row["unit"])
        out.append(
            RunRow(
                row["id"],
                "memory",
                row["unit"],
                row["published"],
                predicted,
                row["source"].split(" (")[0],
                row["revision"],
                False,
                m.is_moe,
                row["settings"],
                traced,
                note,
            )
        )
    return out


CARD = "qwen3-30b-a3b-card"


@cache
def planner_inputs() -> dict[str, dict[str, Any]]:
    """Row id → planner inputs, for the memory rows given as planner inputs: the recipe docstrings' and the
    CPU-offloading card's points (its OOM point is a bound, not a row). ``traced_rows`` traces the same runs."""
    from mbridge_offload_tools.evidence.published import load as offload_runs
    from mbridge_offload_tools.evidence.published_recipes import load as recipes

    out = {row["id"]: row["inputs"] for row in recipes()["rows"]}
    (card,) = (run for run in offload_runs()["runs"] if run["id"] == CARD)
    for p in card["points"]:
        if not p.get("oom"):
            out[f"{CARD}: {p['label']}"] = {**card["inputs"], **p.get("set", {})}
    return out


def _resolved_trace(row_id: str, unit: str) -> tuple[float | None, str]:
    """The trace cell of a row given as planner inputs (``planner_inputs``)."""
    from mbridge_offload.plan.inputs.resolve import resolve

    r = resolve(planner_inputs()[row_id])
    return _trace_cell(r.model, r.setup, row_id, unit)


def _recipe_rows() -> list[RunRow]:
    from mbridge_offload_tools.evidence.published_recipes import accuracy

    out = []
    for r in accuracy():
        common = ("Bridge recipe docstring (nightly API docs)", "NeMo 26.10.rc10", False, False, r.id)
        traced, note = _resolved_trace(r.id, "GiB")
        out.append(RunRow(r.id, "memory", "GiB", r.measured_gib, r.predicted_gib, *common, traced, note))
        if r.measured_step_s is not None:
            out.append(RunRow(r.id, "step", "s", r.measured_step_s, r.predicted_step_s, *common))
    return out


def _offload_card_rows() -> list[RunRow]:
    from mbridge_offload_tools.evidence.published import accuracy

    out = []
    for p in accuracy():
        if p.run != CARD or p.memory_error is None:
            continue
        row_id = f"{p.run}: {p.label}"
        traced, note = _resolved_trace(row_id, "GiB")
        out.append(
            RunRow(
                row_id,
                "memory",
                "GiB",
                float(p.measured_memory or 0.0),
                p.predicted_memory,
                "NVIDIA/skills nemo-mbridge-perf-cpu-offloading card.yaml",
                "validated_on 2026-03-30",
                True,  # the allocator overhead and the CPU AdamW rate are fitted on this card
                True,
                "16x h100-80gb TP2 PP2 EP4 full recompute seq4096",
                traced,
                note,
            )
        )
    return out


@cache
def accuracy() -> tuple[RunRow, ...]:
    """Every row with the planner's prediction: the cards', the performance summary's, the recipes', the card's."""
    return tuple(_card_rows() + _memory_rows() + _recipe_rows() + _offload_card_rows() + _summary_rows())


def headline() -> dict[str, tuple[int, int]]:
    """Unmarked rows within the goal, by kind: ``{"memory": (within, total), "step": (...)}``."""
    out: dict[str, tuple[int, int]] = {}
    for kind in ("memory", "step"):
        rows = [r for r in accuracy() if r.kind == kind and not r.fitted]
        out[kind] = (sum(r.within_goal for r in rows), len(rows))
    return out


def render_table() -> str:
    """The markdown table of ``docs/planner.md`` (generated; see mbridge_offload_tools.docgen.registry)."""
    counts = headline()
    lines = [
        f"Held-out rows within the goal (memory {MEMORY_GOAL:.0%}, step time {STEP_GOAL:.0%}): memory "
        f"{counts['memory'][0]} of {counts['memory'][1]}, step time {counts['step'][0]} of {counts['step'][1]} "
        f"(rows marked fitted are left out of these counts). Figures as published, in the unit published; GPU-measured "
        f"by NVIDIA, predicted here on CPU.",
        "",
        "| run | settings | figure | published | estimate | estimate error | trace error | fitted "
        "| source (revision) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in accuracy():
        if r.kind == "step":
            trace = "— (memory only)"
        else:
            trace = r.trace_note if r.traced is None else f"{r.traced / r.published - 1:+.1%}"
        lines.append(
            f"| {r.id} | {r.settings} | {r.kind} ({r.unit}) | {r.published:g} | {r.predicted:.4g} | {r.error:+.1%} | "
            f"{trace} | {'fitted' if r.fitted else ''} | {r.source} ({r.revision[:12]}) |"
        )
    unchecked = ", ".join(c["id"] for c in load().get("context", []) + load().get("memory_context", []))
    lines += ["", f"Recorded, not checked (a bound, or a model without a preset): {unchecked}."]
    return "\n".join(lines) + "\n"
