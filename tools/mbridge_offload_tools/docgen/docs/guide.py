"""The activation-offload schedule diagram of docs/cpu-offloading.md, drawn from the runtime's schedule.

Every cell comes from :class:`~mbridge_offload_runtime.activation.schedule.Schedule`, and the resident-layer row must
stay within ``L − k``.
"""

from __future__ import annotations

from mbridge_offload_runtime.activation.schedule import Schedule

# Shown in the guide: small enough to read, with more than one offloaded layer.
DIAGRAM_LAYERS, DIAGRAM_OFFLOADED = 6, 2


def _on_device(s: Schedule, layer: int, phase: str, at: int) -> bool:
    """Whether ``layer``'s offloadable activations are on the device while ``at`` runs (forward or backward)."""
    if phase == "F":
        if at < layer:
            return False
        return not s.is_offloaded(layer) or at < s.release_at(layer)
    # backward runs from the last layer down; a layer's activations go once its own backward is done
    if at < layer:
        return False
    return not s.is_offloaded(layer) or at <= s.reload_at(layer)


def render_schedule(model_layers: int = DIAGRAM_LAYERS, num_layers: int = DIAGRAM_OFFLOADED) -> str:
    s = Schedule(model_layers=model_layers, num_layers=num_layers)
    steps = [("F", j) for j in range(model_layers)] + [("B", j) for j in reversed(range(model_layers))]
    width = 5
    head = "step        " + "".join(f"{p}{j}".ljust(width) for p, j in steps)
    rows = [head]
    for layer in range(num_layers):
        cells = []
        for phase, at in steps:
            if phase == "F":
                mark = "save" if at == layer else ("drop" if at == s.release_at(layer) else "")
                mark = mark or ("=" if layer < at < s.release_at(layer) else ("." if at > layer else ""))
            else:
                mark = "load" if at == s.reload_at(layer) else ("use" if at == layer else "")
                mark = mark or ("=" if layer < at < s.reload_at(layer) else ("." if at > layer else ""))
            cells.append(mark.ljust(width))
        rows.append((f"layer {layer}     " + "".join(cells)).rstrip())
    resident = []
    for phase, at in steps:
        count = sum(_on_device(s, layer, phase, at) for layer in range(model_layers))
        assert count <= model_layers - num_layers, (phase, at, count)  # the residency invariant
        resident.append(str(count).ljust(width))
    rows.append(("on device   " + "".join(resident)).rstrip())
    rows[0] = rows[0].rstrip()
    legend = [
        f"L = {model_layers} layers, k = {num_layers} offloaded (layers 0 … {num_layers - 1}); F = forward, "
        "B = backward (from the last layer down).",
        "",
        "- `save`: the layer runs forward; its activations are saved and their copy to the host starts at once.",
        "- `=`: on the device (copy in flight, or reloaded and waiting); `.`: on the host only.",
        "- `drop`: the device copy of layer i is released at the forward of layer L − k + i.",
        "- `load`: its reload starts at the backward of layer L − 1 − k + i, early enough that backward need not wait.",
        "- `use`: its own backward reads the reloaded tensors; afterwards they are freed.",
        f"- `on device`: layers whose offloadable activations are on the device during that step, offloaded or "
        f"not; never more than L − k = {model_layers - num_layers}.",
    ]
    return "```text\n" + "\n".join(rows) + "\n```\n\n" + "\n".join(legend)
