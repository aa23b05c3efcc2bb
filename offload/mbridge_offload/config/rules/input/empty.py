"""Rules about the input itself (not about an upstream check): an empty config is said to be empty.

Megatron Bridge reads an empty YAML as "no overrides": the recipe's defaults run, with offloading off. That is
valid, so it is not an error; but "ok, no finding" would read as "your offload settings are fine" when nothing
was checked at all, so validate says so with a warning.
"""

from __future__ import annotations

from mbridge_offload.config.rules.base import Context, Rule, advisory
from mbridge_offload.config.schema import SECTIONS


def _empty(ctx: Context) -> bool:
    return not any(isinstance(ctx.raw.get(name), dict) and ctx.raw[name] for name in SECTIONS)


INPUT_RULES: tuple[Rule, ...] = (
    advisory(
        id="CFG-EMPTY",
        severity="warning",
        summary="The config sets no model/optimizer/ddp/train/dataset key: nothing offload-related was checked.",
        keys=tuple(SECTIONS),
        message="the config is empty (no model, optimizer, ddp, train or dataset keys): nothing was checked; "
        "Bridge would run "
        "its recipe defaults with CPU offloading off",
        why="An empty file, a comment-only file, or only unknown sections. Upstream accepts it (every default "
        "applies), so this is a warning, not an error; pass the config you train with (ConfigContainer.to_yaml()).",
        check=_empty,
    ),
)
