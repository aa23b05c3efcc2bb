"""card.yaml ``measured_results``: this project's own numbers, copied by code from the benchmark fragments.

Each value names the fragment's table row and column it comes from: nothing is typed in, rounded or computed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
BEGIN, END = "# BEGIN GENERATED: measured_results\n", "# END GENERATED: measured_results\n"

# (name, fragment, script, config, {value name: (first cell of the row, column index)})
MEASURED: list[tuple[str, str, str, str, dict[str, tuple[str, int]]]] = [
    (
        "hybrid_device_optimizer_step_cpu",
        "docs/benchmarks-optimizer.md",
        "benchmarks/cpu_optimizer.py",
        "GPT-like fp32 parameter set (~110 M elements), one intra-op thread; one step per fraction vs its floor",
        {
            **{f"ours_vs_floor_fraction_{f}": (f"f = {f}", 6) for f in ("0.00", "0.25", "0.50", "0.75", "1.00")},
            "state_dict_s_fraction_1": ("fraction 1.0", 4),
            "state_dict_copied_percent_fraction_1": ("fraction 1.0", 3),
            "fused_adamw_in_place_s_per_step": ("(a) fused AdamW in place (no offload)", 1),
            "ours_fraction_1_overlap_s_per_step": ("(b) HybridDeviceOptimizer, fraction 1.0, overlap", 1),
            "per_parameter_upstream_scheme_s_per_step": ("(c) per-parameter optimizers (upstream scheme)", 1),
            "floor_flat_copy_adamw_copy_back_s_per_step": ("(d) floor: flat copy + one fused AdamW + copy back", 1),
            "ours_vs_floor": ("(b) HybridDeviceOptimizer, fraction 1.0, overlap", 2),
            "upstream_scheme_vs_floor": ("(c) per-parameter optimizers (upstream scheme)", 2),
        },
    ),
    (
        "activation_offload_hook_overhead_cpu",
        "docs/benchmarks-activation.md",
        "benchmarks/cpu_activation.py",
        "12-layer toy transformer (hidden 64), forward + backward, per saved tensor",
        {
            "no_offload_step_ms": ("`none`", 2),
            "save_on_cpu_us_per_saved_tensor": ("`save_on_cpu`", 4),
            "ours_k0_us_per_saved_tensor": ("`ours_k0`", 4),
            "ours_k0_vs_save_on_cpu": ("`ours_k0`", 5),
            "ours_k11_copying_step_ms": ("`ours_k11`", 2),
            "ours_k11_us_per_saved_tensor": ("`ours_k11`", 4),
        },
    ),
    (
        "validate_latency_cpu",
        "docs/benchmarks-validate.md",
        "",
        "mbridge-offload validate on the bundled example, whole process, median of 20 runs",
        {
            "median": ("`mbridge-offload validate examples/qwen3_30b_a3b_pretrain.yaml`", 1),
            "with_set_override_median": (
                "same, `--json --set optimizer.optimizer_offload_fraction=1.0` (loads Hydra's override parser)",
                1,
            ),
        },
    ),
    (
        "mcp_server_latency_cpu",
        "docs/benchmarks-mcp.md",
        "benchmarks/mcp_latency.py",
        "stdio server started by a separate client process; median ms",
        {
            "start_to_first_list_tools_ms": ("server start → first list_tools", 1),
            "validate_config_warm_ms": ("validate_config (warm)", 1),
            "recommend_mode_warm_ms": ("recommend_mode (warm)", 1),
        },
    ),
]


def _cells(text: str, label: str) -> list[str]:
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("|") and cells[0] == label:
            return cells
    raise KeyError(f"no table row {label!r}")


def _measured_on(text: str) -> str:
    # The date the page gives its measurement ("Measured 2026-12-02"), else its first date: a page may also carry
    # other runs (docs/benchmarks-validate.md's differential section, rerun on another day) before it.
    stated = re.search(r"[Mm]easured (?:on )?(\d{4}-\d{2}-\d{2})", text)
    date = stated[1] if stated else (found[0] if (found := re.search(r"\d{4}-\d{2}-\d{2}", text)) else None)
    return f"this project's CPU machine (no GPU), {date or 'date not stated'}; details in the source"


def _q(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def render_block(root: Path = ROOT) -> str:
    lines = ["measured_results:"]
    for name, source, script, config, values in MEASURED:
        text = (root / source).read_text()
        lines += [f"  - name: {name}", f"    measured_on: {_q(_measured_on(text))}", f"    source: {source}"]
        if script:
            lines.append(f"    script: {script}")
        lines += [f"    config: {_q(config)}", "    values:"]
        for key, (label, column) in values.items():
            lines.append(f"      {key}: {_q(_cells(text, label)[column].strip('*'))}")
    return "\n".join(lines) + "\n"


def render_card(text: str, root: Path = ROOT) -> str:
    """``text`` (card.yaml) with the measured_results block re-copied from the fragments."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + render_block(root) + text[end:]
