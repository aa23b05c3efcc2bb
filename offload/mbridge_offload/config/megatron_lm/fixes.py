"""Fixes in Megatron-LM notation: ``model.cpu_offloading_num_layers=2`` → ``--cpu-offloading-num-layers 2``.

When the input was a Megatron-LM command line, a fix in Bridge notation is no use to the person who has to edit
that command line. :func:`megatron_lm_fixes` rewrites each finding's ``fix`` as the flags to add or change, puts
the flags to delete in ``fix_remove``, and keeps the Bridge notation in ``fix_overrides``. The mapping is
Megatron-LM's own parser table (:mod:`mbridge_offload.config.megatron_lm.flags`) plus the few keys that Megatron-LM
derives from other flags in ``validate_args``. No torch.
"""

from __future__ import annotations

from typing import Any

from mbridge_offload.config.megatron_lm.argv import RENAMED
from mbridge_offload.config.megatron_lm.flags import arguments, transformer_fields
from mbridge_offload.config.schema import SECTIONS

# Keys no flag sets directly: the flags Megatron-LM derives them from (arguments.py validate_args, 0.19.2).
# Setting one to null/false means deleting these flags; any other value sets the first one.
_DERIVED: dict[str, tuple[str, ...]] = {
    "model.cpu_offloading": ("--cpu-offloading-num-layers",),  # on when the count is > 0
    "model.recompute_granularity": ("--recompute-granularity", "--recompute-activations"),
    "model.virtual_pipeline_model_parallel_size": (
        "--num-layers-per-virtual-pipeline-stage",
        "--num-virtual-stages-per-pipeline-rank",
    ),
}
_EXTRA_MODEL = {"moe_token_dispatcher_type", "fp8_recipe", "cuda_graph_modules", "moe_flex_dispatcher_backend"}


def _rows(section: str, name: str) -> list[tuple]:
    """The parser rows whose dest is ``name`` and that Megatron-LM passes to ``section``'s config."""
    cls = SECTIONS.get(section)
    model_field = section == "model" and (name in _EXTRA_MODEL or name in transformer_fields())
    if not ((cls is not None and name in cls.model_fields) or model_field):
        return []
    # A TransformerConfig field that Megatron-LM fills from an argument of another name (--num-experts).
    dests = {dest for dest, field in RENAMED.items() if field == name} if section == "model" else set()
    return [row for row in arguments() if row[1] == name or row[1] in dests]


def _value(text: str) -> Any:
    """An override's value as YAML reads it (``true``, ``null``, ``2``, ``[a, b]``, ``bf16``)."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _render(value: Any) -> str:
    if isinstance(value, list | tuple):
        return " ".join(_render(v) for v in value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def flag_edit(override: str) -> tuple[list[str], list[str]] | None:
    """One Bridge override as Megatron-LM edits: ``(flags to add or set, flags to delete)``; None without a flag.

    Example:
        >>> flag_edit("model.cpu_offloading_num_layers=2")
        (['--cpu-offloading-num-layers 2'], [])
        >>> flag_edit("optimizer.use_precision_aware_optimizer=true")
        (['--use-precision-aware-optimizer'], [])
        >>> flag_edit("model.recompute_granularity=null")
        ([], ['--recompute-granularity', '--recompute-activations'])
    """
    key, sep, text = override.lstrip("+").partition("=")
    if not sep or "." not in key:
        return None
    section, _, name = key.partition(".")
    value = _value(text)
    if key in _DERIVED:
        flags = _DERIVED[key]
        if value is None or value is False:
            return [], list(flags)
        return ([] if value is True else [f"{flags[0]} {_render(value)}"]), []
    rows = _rows(section, name)
    if not rows:
        return None
    options, kind = rows[0][0], rows[0][2]
    if kind in ("store_true", "store_false"):
        wanted = kind == "store_true"  # the value the flag sets
        other = [
            r[0][0] for r in rows[1:] if r[2] in ("store_true", "store_false") and (r[2] == "store_true") != wanted
        ]
        if bool(value) == wanted:
            return [options[0]], []
        return ([other[0]], [options[0]]) if other else ([], [options[0]])
    if kind == "boolean_optional":
        return [options[0] if value else options[0].replace("--", "--no-", 1)], []
    if value is None or value == []:
        return [], [options[0]]
    return [f"{options[0]} {_render(value)}"], []


def megatron_lm_fixes(report: Any) -> Any:
    """Rewrite each finding's ``fix`` in Megatron-LM flags (for a report on a Megatron-LM command line).

    ``fix`` becomes the flags to add or change (``--cpu-offloading-num-layers 2``), ``fix_remove`` the flags to
    delete, ``fix_overrides`` the Bridge notation it came from. An override with no Megatron-LM flag stays in
    ``fix`` as it was (and is named in ``why``), never dropped.
    """
    for finding in report.findings:
        if not finding.fix:
            continue
        add: list[str] = []
        remove: list[str] = []
        unmapped: list[str] = []
        for override in finding.fix:
            edit = flag_edit(override)
            if edit is None:
                unmapped.append(override)
                continue
            add += [f for f in edit[0] if f not in add]
            remove += [f for f in edit[1] if f not in remove]
        finding.fix_overrides = list(finding.fix)
        finding.fix = add + unmapped
        finding.fix_remove = remove or None
        if unmapped:
            finding.why = f"{finding.why or ''} (No Megatron-LM flag sets {', '.join(unmapped)}.)".strip()
    report.fix_notation = "megatron-lm"
    return report
