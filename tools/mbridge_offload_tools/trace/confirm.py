"""``recommend --confirm``: re-check the recommendation (``options[0]``) with the trace, beside the planner.

Option 0's changes are turned back into planner inputs (each override's last name: ``model.recompute_granularity``
and ``--recompute-granularity`` both name ``recompute_granularity``) and given with the caller's own inputs to
``trace`` (:func:`mbridge_offload_tools.trace.run.trace_answer`), which builds the same config through the one
reading every tool uses. The answer's ``confirm`` holds the trace's peak and categories beside the planner's, the gap,
and whether option 0 still fits by the trace (the trace's peak plus the planner's fitted workspace constant, which
fake tensors cannot see, within the option's budget). Where the trace cannot build the config (or a change cannot be
mapped), ``confirm`` says why and gives no verdict. Never imports torch (the trace runs in its own child process).
"""

from __future__ import annotations

from typing import Any

from mbridge_offload.config.errors import InputError

GIB = 2**30
# An override's last name -> the planner input of the same meaning, where the names differ.
_RENAMED = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "virtual_pipeline_model_parallel_size": "vpp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp",
    "use_distributed_optimizer": "distributed_optimizer",
    "use_precision_aware_optimizer": "precision_aware_optimizer",
    "overlap_cpu_optimizer_d2h_h2d": "overlap",
    "cpu_offloading_num_layers": "activation_offload_layers",
}
# Switches that say "on" for a setting another input carries (the fraction, the layer count); "off" is that input 0.
_IMPLIED = {"optimizer_cpu_offload": "optimizer_offload_fraction", "cpu_offloading": "activation_offload_layers"}
# What layer-level offload keeps in place (activations on, weights off): the planner's only reading of them.
_FIXED = {"cpu_offloading_activations": True, "cpu_offloading_weights": False}


def option_inputs(changes: list[dict[str, Any]]) -> tuple[dict[str, Any], str | None]:
    """The planner inputs that option 0's ``changes`` amount to, or ``(…, why)`` for a change that has none.

    Returns:
        The inputs, and None, or the reason a change cannot be traced.
    """
    from mbridge_offload.plan.inputs.fields import PlanInputs

    out: dict[str, Any] = {}
    for change in changes:
        key, value = str(change["key"]), change["value"]
        name = key.rsplit(".", 1)[-1].lstrip("-").replace("-", "_")
        name = _RENAMED.get(name, name)
        if name in _IMPLIED:
            if value is False:
                out[_IMPLIED[name]] = 0
            continue
        if _FIXED.get(name) is value:
            continue
        if value is None or name not in PlanInputs.model_fields:
            return out, f"option 0 changes {key}, which has no planner input the trace could be given"
        out[name] = value
    return out, None


def _overhead_gib(v: dict[str, Any], inputs: dict[str, Any]) -> float:
    """The planner's fitted workspace constant (``Setup.overhead_gb``) for the option, GiB."""
    from mbridge_offload.plan.inputs.resolve import resolve
    from mbridge_offload.plan.service import plan_source

    args = {k: val for k, val in {**v, **inputs}.items() if k not in ("megatron_core", "stage", "deadline")}
    cfg, raw, source = plan_source(args)
    return float(resolve(args, cfg, raw, source).setup.overhead_gb) * 1e9 / GIB


def confirm(v: dict[str, Any], rec: Any) -> dict[str, Any]:
    """``confirm`` for the recommendation ``rec`` of the planner inputs ``v`` (module docstring)."""
    if not rec.options:
        return {"traced": False, "why": "recommend gave no option to confirm"}
    option = rec.options[0]
    planner = option.memory_gib.model_dump(mode="json")
    out: dict[str, Any] = {"option": 0, "overrides": list(option.overrides), "planner_gib": planner}
    inputs, why = option_inputs([c.model_dump(mode="json") for c in option.changes])
    if why is not None:
        return {**out, "traced": False, "why": why}
    from mbridge_offload_tools.trace.run import trace_answer

    try:
        traced = trace_answer({**v, **inputs})
        overhead = _overhead_gib(v, inputs)
    except InputError as exc:
        return {**out, "traced": False, "why": f"{exc}"}
    peak = float(traced["memory_gib"]["total"])
    with_overhead = peak + overhead
    gap = (planner["total"] - overhead - peak) / peak if peak else None
    return {
        **out,
        "traced": True,
        "trace_gib": traced["memory_gib"],
        "trace_peak_phase": traced["peak_phase"],
        "stage": traced["stage"],
        "megatron_core": traced["under_test"]["megatron_core"],
        "overhead_gib": round(overhead, 4),
        "gap": None if gap is None else round(gap, 4),
        "budget_gib": option.budget_gib,
        "fits_by_trace": with_overhead <= option.budget_gib,
        "verdict": (
            f"option 0 {'still fits' if with_overhead <= option.budget_gib else 'does NOT fit'} by the trace: "
            f"{peak:.2f} GiB traced + {overhead:.2f} GiB of the planner's fitted workspace constant = "
            f"{with_overhead:.2f} GiB against a budget of {option.budget_gib:.2f} GiB (the planner: "
            f"{planner['total']:.2f} GiB; planner - trace without the constant: "
            f"{'n/a' if gap is None else f'{gap * 100:+.1f} %'})"
        ),
        "note": "the trace is simulated on CPU (fake tensors), docs/trace.md",
    }


def recommend_answer(v: dict[str, Any]) -> Any:
    """``recommend`` / ``recommend_mode`` with its ``confirm`` flag: the planner's answer
    (:func:`mbridge_offload.plan.service.plan_answer`), with ``confirm`` filled when it was asked for.

    Raises:
        InputError: as ``plan_answer`` (a trace that cannot run is an answer, not an error).
    """
    from mbridge_offload.plan.service import plan_answer

    args = {k: val for k, val in v.items() if k != "confirm"}
    rec = plan_answer("recommend", args)
    if v.get("confirm"):
        rec.confirm = confirm(args, rec)
    return rec
