"""The table of Megatron Bridge's offload perf recipes against the planner (docs/planner.md, section perf-recipes).

Rows come from ``mbridge_offload_tools.evidence.perf_check`` over the committed ``bridge`` fixtures.
"""

from __future__ import annotations


def _gib(value: float | None, fits: bool | None) -> str:
    if value is None:
        return "—"
    return f"{value:.1f} ({'fits' if fits else 'does not fit'})"


def render_perf_recipes() -> str:
    from mbridge_offload.plan.inputs.hardware import DEFAULT_MARGIN
    from mbridge_offload_tools.evidence.perf_check import check_all, load_index

    rows = check_all()
    if not rows:
        return "No Bridge 0.6.2 perf fixtures are committed yet (`perf_check.FIXTURES` has no index.json).\n"
    lines = [
        "| recipe | GPU × N (exposed GiB) | NVIDIA's choice | predicted with it, GiB | without offload, GiB "
        "| our recommendation (from offload off) | fine-grained saving |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.error:
            lines.append(f"| `{r.recipe}` | {r.gpu} × {r.num_gpus} | {r.nvidia} | error: {r.error} | | | |")
            continue
        if r.recommended_mode == "activation":
            ours = f"activation, {r.recommended_layers} layers"
        else:
            ours = str(r.recommended_mode)
        ours += " (fits)" if r.recommended_fits else " (nothing allowed fits)"
        lines.append(
            f"| `{r.recipe}` | {r.gpu} × {r.num_gpus} ({r.capacity_gib:.1f}) | {r.nvidia} "
            f"| {_gib(r.with_gib, r.with_fits)} | {_gib(r.without_gib, r.without_fits)} | {ours} "
            f"| {r.fine_grained_saving or '—'} |"
        )
    skipped = load_index()["skipped"]
    if skipped:
        lines.append("")
        lines.append(f"Not built offline by the fixture generator: {', '.join(f'`{n}`' for n in sorted(skipped))}.")
    lines.append("")
    lines.append(
        "GiB = peak allocated on the worst stage. 'fits' compares it, grown by the allocator overhead (dense "
        "models 1.45 %, Megatron-LM #965; dropless MoE 11.8 %, the card's OOM point; no expandable_segments: "
        "these recipes do not set it), with what the GPU exposes less the CUDA context, no margin. The "
        f"recommendation keeps {DEFAULT_MARGIN:.0%} of that free (the margin: what the tightest published recipe "
        "keeps, rounded down). Where only the overhead makes it 'does not fit', the answer "
        "carries a 'borderline' warning with the fragmentation it would take."
    )
    return "\n".join(lines) + "\n"
