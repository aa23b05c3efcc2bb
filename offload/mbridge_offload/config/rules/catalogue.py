"""The rule catalogue: every rule of every group, looked up by id, and rendered as ``docs/rules.md``."""

from __future__ import annotations

import functools

from mbridge_offload.config.rules.activation import cuda_graphs, layer_reach, recompute
from mbridge_offload.config.rules.activation import fine_grained as offload_extras
from mbridge_offload.config.rules.activation.build import BUILD_RULES
from mbridge_offload.config.rules.activation.layer_offload import ACTIVATION_RULES
from mbridge_offload.config.rules.base import DEFAULT_TARGET, STAGE_OPTIMIZER_CONFIG, TARGETS, Rule, spec_contains
from mbridge_offload.config.rules.input import container, hygiene
from mbridge_offload.config.rules.input import megatron_lm as megatron_lm_args
from mbridge_offload.config.rules.input.bridge import BRIDGE_RULES
from mbridge_offload.config.rules.input.empty import INPUT_RULES
from mbridge_offload.config.rules.megatron import parallelism
from mbridge_offload.config.rules.optimizer.offload import CONFIG_RULES, OPTIMIZER_RULES

# The TransformerConfig stage's files besides activation.py; the order of this list does not matter (merge_stage).
# megatron-core's checks that do not concern offloading (FP8/FP4, MoE, uneven pipeline stages and layouts, model
# init, OptimizerConfig's dtypes) are no rules: validate runs megatron-core itself for them (the upstream run,
# mbridge_offload_tools.exact), and an answer without it names them in coverage.not_run. parallelism stays: the
# planner's layout levers ask it without torch (config.validate.model_errors).
TRANSFORMER_CONFIG_FILES = (parallelism, recompute, offload_extras, cuda_graphs)


def merge_stage(backbone: tuple[Rule, ...], groups: tuple[tuple[Rule, ...], ...]) -> tuple[Rule, ...]:
    """One stage in upstream's check order: ``backbone`` with each group's rules placed from their ``follows``.

    A rule with ``follows`` starts a run right after that check, continued by the rules after it in its group; a
    group's leading rules without ``follows`` open the stage. RuntimeError when a ``follows`` names no rule of the
    stage, or two runs claim the same place.
    """
    runs: dict[str | None, list[Rule]] = {}
    for group in groups:
        anchor: str | None = None
        run: list[Rule] = []
        for rule in group:
            if rule.follows is not None:
                _add_run(runs, anchor, run)
                anchor, run = rule.follows, []
            run.append(rule)
        _add_run(runs, anchor, run)
    out: list[Rule] = []

    def emit(rule: Rule) -> None:
        out.append(rule)
        for after in runs.pop(rule.id, []):
            emit(after)

    for rule in (*runs.pop(None, []), *backbone):
        emit(rule)
    if runs:
        raise RuntimeError(f"rules follow checks that are not in their stage: {sorted(str(a) for a in runs)}")
    return tuple(out)


def _add_run(runs: dict[str | None, list[Rule]], anchor: str | None, run: list[Rule]) -> None:
    if not run:
        return
    if anchor in runs:
        raise RuntimeError(f"two groups of rules both follow {anchor or 'the start of the stage'}")
    runs[anchor] = run


@functools.cache
def all_rules() -> tuple[Rule, ...]:
    """Every rule, each stage in upstream code order: config hygiene, Megatron-LM's own checks, TransformerConfig
    (``activation/layer_offload.py`` in upstream order, the other files placed by their ``follows``), build-time (TE,
    Bridge, Megatron-LM, advisory), Bridge's ConfigContainer.validate() (``input/container.py``),
    what megatron-core accepts and then ignores per model class (``layer_reach``), OptimizerConfig, the optimizer
    factory and the rest."""
    transformer = merge_stage(ACTIVATION_RULES, tuple(f.RULES for f in TRANSFORMER_CONFIG_FILES))
    optimizer_stage = tuple(r for r in OPTIMIZER_RULES if r.stage == STAGE_OPTIMIZER_CONFIG)
    rest = tuple(r for r in OPTIMIZER_RULES if r.stage != STAGE_OPTIMIZER_CONFIG)
    rules = (
        *INPUT_RULES,
        *BRIDGE_RULES,
        *CONFIG_RULES,
        *hygiene.RULES,
        *megatron_lm_args.RULES,
        *transformer,
        *BUILD_RULES,
        *container.RULES,
        *layer_reach.RULES,
        *optimizer_stage,
        *rest,
    )
    ids = [r.id for r in rules]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        raise RuntimeError(f"duplicate rule ids: {sorted(duplicates)}")
    return rules


def get_rule(rule_id: str) -> Rule:
    for rule in all_rules():
        if rule.id == rule_id:
            return rule
    raise KeyError(rule_id)


def versions_text(spec: str) -> str:
    """Human wording of ``applies_to`` for docs."""
    if not spec:
        return "all supported"
    covered = [t.label for t in TARGETS.values() if spec_contains(spec, t.version)]
    return f"`{spec}` ({', '.join(covered) or 'none of the supported targets'})"


def render_rules_markdown() -> str:
    """``docs/rules.md``: the catalogue as a reference page (``python -m mbridge_offload_tools.docgen``)."""
    lines = [
        "# Rule catalogue",
        "",
        "<!-- Generated by `python -m mbridge_offload_tools.docgen` from offload/mbridge_offload/config/rules/. "
        "Do not edit by hand. -->",
        "",
        "Every check `mbridge-offload validate` runs. **error** = upstream refuses or crashes; **warning** = runs",
        "but silently does nothing or something surprising; **info** = worth knowing. **origin** says who enforces",
        "it: `mcore` (Megatron Core), `te` (Transformer Engine), `bridge` (Megatron Bridge), `megatron-lm`",
        "(Megatron-LM `validate_args`, only for Megatron-LM command lines), or `advisory` (not enforced upstream;",
        "our own advice). Where upstream raises, the message is upstream's text, verbatim.",
        "",
        "megatron-core's other checks are no rules: `validate` runs megatron-core itself (its config classes and a",
        "meta-device model build) and reports them with its own message; without megatron-core, `coverage.not_run`",
        "names them. The `MC-*` rules left here concern offloading, or are what the planner vets its candidates",
        "with (no torch), or are checked upstream only where validate's run does not reach (first step, optimizer).",
        "",
        "How validate is checked: `tests/config/test_differential.py` generates several hundred seeded configs",
        "and constructs the real `TransformerConfig`, `OptimizerConfig` and the optimizer factory's offload asserts",
        "(`_get_megatron_optimizer_based_on_param_groups`, with only the CUDA-needing `HybridDeviceOptimizer`",
        "constructor replaced by a sentinel) under megatron-core 0.16.1 and 0.19.2; for each stage validate's first",
        "error (these rules with megatron-core's run) must equal upstream's (verdict, exception type, message).",
        "Generated configs always set `pipeline_dtype` when PP > 1: real MCore otherwise first raises `When using",
        "pipeline parallelism, pipeline_dtype must be specified`, which Bridge's mixed-precision setup prevents,",
        "so no rule covers it.",
        "TE, Bridge and Megatron-LM rules are taken from their source code, not run here.",
        "",
        "Targets: "
        + ", ".join(f"`megatron-core=={t.label}` ({t.bridge})" for t in TARGETS.values())
        + f". Default: `{DEFAULT_TARGET}`.",
        "",
        "| id | severity | origin | versions | summary |",
        "|---|---|---|---|---|",
    ]
    for rule in all_rules():
        lines.append(
            f"| [`{rule.id}`](#{rule.id.lower()}) | {rule.severity} | {rule.origin} | "
            f"{versions_text(rule.applies_to)} | {rule.summary} |"
        )
    for rule in all_rules():
        lines += ["", f"## {rule.id}", "", rule.summary, ""]
        lines.append(
            f"- **severity**: {rule.severity} · **origin**: {rule.origin} · "
            f"**versions**: {versions_text(rule.applies_to)}"
        )
        lines.append(f"- **enforced in**: {rule.stage}" + (f" (`{rule.exception}`)" if rule.exception else ""))
        lines.append("- **keys**: " + ", ".join(f"`{k}`" for k in rule.keys))
        label = "upstream message" if rule.upstream else "message (ours)"
        lines.append(f"- **{label}**: `{rule.message}`")
        if rule.upstream_text is not None and rule.upstream_text != rule.message:
            lines.append(f"- **exact upstream text**: `{rule.upstream_text or '(empty)'}`")
        lines.append("- **fix**: " + (", ".join(f"`{f}`" for f in rule.fix) if rule.fix else "none (see why)"))
        if rule.shadowed_by:
            lines.append(
                "- **hidden when**: "
                + ", ".join(f"`{s}`" for s in rule.shadowed_by)
                + " fires (upstream stops there first)"
            )
        lines += ["", f"Why: {rule.why}"]
    return "\n".join(lines) + "\n"
