"""Edit a user's config to switch an offload mode on or off, the way a careful human would.

``apply_offload(source, mode)`` works on the file as written, not on a re-serialised dict: ruamel.yaml's
round-trip mode keeps comments, key order, quoting and every value it does not touch. It also resolves the
conflicts the mode implies (activation offload needs ``recompute_granularity: null`` and
``cuda_graph_impl: none``; optimizer offload needs an explicit ``optimizer_offload_fraction`` because Bridge's
default 0.0 offloads nothing), says why for each change, then validates the result with the project's own
validator and refuses to write a config that validator rejects.

Writing is opt-in (``output=`` or ``in_place=True``), atomic (temp file in the target directory +
``os.replace``), keeps a backup when in place, is idempotent (a second run finds nothing to change), and never
leaves the input's directory or the working directory unless the caller names another allowed root.

Example:
    >>> result = apply_offload("examples/qwen3_30b_a3b_pretrain.yaml", "optimizer", fraction=0.75)
    >>> print(result.diff)            # unified diff; nothing written
    >>> result.overrides              # ['optimizer.optimizer_offload_fraction=0.75']

This module never imports torch.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

from mbridge_offload.actions.apply import fine_grained as fge
from mbridge_offload.actions.apply.plan import plan_edits, requested_edits
from mbridge_offload.actions.apply.result import ApplyError, ApplyResult, Change
from mbridge_offload.actions.apply.write import default_roots, write_requested
from mbridge_offload.actions.apply.yaml_render import render
from mbridge_offload.config import parallel_sizes
from mbridge_offload.config.overrides import format_override, format_value
from mbridge_offload.config.schema import OffloadConfig, get_value
from mbridge_offload.config.sources import apply_overrides, build_config, parse_text, read_source

# The public names of ``apply`` (its parts live in apply_plan, apply_result, apply_write and yaml_render).
__all__ = [
    "apply_offload",
]

# ---------------------------------------------------------------------------------------------- entry point


def _validate(
    config: OffloadConfig, raw: dict[str, Any]
) -> tuple[bool, list[dict[str, Any]], dict[str, Any], dict[str, str]]:
    """The verdict on the edited config, its findings, its one effective config (``config.effective``) and the
    environment facts the verdict assumed (validate's ``env``: the TE version and where it came from)."""
    from mbridge_offload.config.validate import validate

    report = validate(config, raw)
    data = report.to_dict()
    return bool(report.ok), list(data.get("findings", [])), dict(report.effective), dict(report.env)


def _copy(raw: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(raw))


_REQUESTED = "requested override"


def _changes(
    base_cfg: OffloadConfig,
    base_raw: dict[str, Any],
    wanted: dict[str, tuple[Any, str]],
    overrides: list[str],
    effective_raw: dict[str, Any],
    mode: str,
) -> tuple[list[Change], list[str]]:
    """The caller's overrides join the mode's edits (written with it, so the file validates on its own)."""
    notes: list[str] = []
    for key, value in requested_edits(overrides, effective_raw).items():
        if key in wanted and wanted[key][0] != value:
            notes.append(
                f"override {key}={format_value(value)} conflicts with mode={mode}, which needs "
                f"{key}={format_value(wanted[key][0])}: the mode's value is written"
            )
        wanted.setdefault(key, (value, _REQUESTED))
    # A key the caller asked for is written even when it equals the schema default: a Bridge YAML layered on a
    # recipe needs it spelled out (the recipe may set another value). Unless the file already says so.
    requested = {key for key, (_, why) in wanted.items() if why == _REQUESTED}
    changes = [
        Change(key=key, old=get_value(base_cfg, key), new=value, why=why)
        for key, (value, why) in wanted.items()
        if get_value(base_cfg, key) != value
        or (value is None and get_value(base_cfg, key) is not None)
        or (key in requested and not _written(base_raw, key, value))
    ]
    if any(c.key == fge.NVTE_KEY for c in changes):  # TE reads it at import: say what another launcher must do
        notes.append(fge.NVTE_EXPORT_NOTE)
    return changes, notes


def _written(raw: dict[str, Any], key: str, value: Any) -> bool:
    """The file itself sets ``key`` to ``value`` (not just the schema default)."""
    section, _, leaf = key.partition(".")
    block = raw.get(section)
    return isinstance(block, dict) and leaf in block and block[leaf] == value


def _result(text: str, where: str, label: str, new_text: str, env: dict[str, str], **fields: Any) -> ApplyResult:
    """Validate the edited text (in the caller's environment: ``env``) and build the result with its diff."""
    new_raw, _ = parse_text(new_text, where)
    edited = build_config(new_raw, where)
    edited.env.update(env)
    ok, findings, effective, facts = _validate(edited, new_raw)
    diff = "".join(
        difflib.unified_diff(
            text.splitlines(keepends=True),
            new_text.splitlines(keepends=True),
            fromfile=f"a/{label}",
            tofile=f"b/{label}",
        )
    )
    return ApplyResult(ok=ok, findings=findings, diff=diff, text=new_text, effective=effective, env=facts, **fields)


def _configs(
    raw: dict[str, Any], overrides: list[str] | None, where: str, tree: Any, env: dict[str, str]
) -> tuple[OffloadConfig, OffloadConfig, dict[str, Any]]:
    """The config as read, the config with the caller's overrides, and the latter's raw dict; both typed configs
    carry the caller's environment facts (``env``: the TE release the edits and the verdict follow).

    Raises:
        ConfigError: a value that does not type-check; ParallelSizeError: a parallel size of 0 or below.
    """
    written = _copy(raw)
    base_cfg = build_config(written, where, tree)
    effective_raw = apply_overrides(_copy(raw), list(overrides or []))
    cfg = build_config(effective_raw, where, tree if not overrides else None)
    if overrides:  # a measured log belongs to the config as written (plan/evidence/runs.py)
        cfg._written = (base_cfg, written)
    parallel_sizes.check(effective_raw)  # no edit of a run that cannot start (0 or negative TP, PP, CP, EP...)
    for typed in (base_cfg, cfg):
        typed.env.update(env)
    return base_cfg, cfg, effective_raw


def _check_arguments(output: Any, in_place: bool, planner: dict[str, Any] | None, mode: str, fmt: str) -> None:
    if output is not None and in_place:
        raise ApplyError("pass either output or in_place, not both")
    if planner and mode != "recommended":
        raise ApplyError(f"GPU/planner settings ({', '.join(planner)}) only apply to mode=recommended")
    if fmt not in ("yaml", "overrides"):
        raise ApplyError(f"format {fmt!r} is not one of yaml, overrides")


def apply_offload(
    source: str,
    mode: str,
    *,
    fraction: float | None = None,
    num_layers: int | None = None,
    overrides: list[str] | None = None,
    output: str | os.PathLike[str] | None = None,
    in_place: bool = False,
    output_format: str = "yaml",
    overwrite: bool = False,
    allowed_root: str | os.PathLike[str] | None = None,
    write_roots: list[Path] | None = None,
    planner: dict[str, Any] | None = None,
    modules: str | list[str] | None = None,
    option: int | None = None,
    env: dict[str, str] | None = None,
) -> ApplyResult:
    """Switch an offload mode on (or off) in a config, resolve the conflicts it implies, and optionally write it.

    Args:
        source: a YAML/JSON path or inline YAML/JSON text.
        mode: ``optimizer``, ``activation``, ``both``, ``none``, ``fine-grained`` or ``recommended`` (the planner).
        fraction: ``optimizer_offload_fraction`` for optimizer modes, in (0, 1].
        num_layers: ``cpu_offloading_num_layers`` for activation modes.
        overrides: Hydra-style ``KEY=VALUE`` overrides (``section.key``) applied before the mode and written with it.
        output: write the result here; an existing file only with ``overwrite`` (backed up); the input's = in place.
        in_place: overwrite ``source`` (a file), keeping a unique ``<name>.bak[.N]`` of the original.
        output_format: ``yaml`` writes the edited config; ``overrides`` writes the override list, one per line.
        overwrite: allow ``output`` to replace an existing file (CLI ``--force``, MCP ``overwrite=true``).
        allowed_root: an extra directory writes may go to (besides the input's directory and the cwd).
        write_roots: the exact directories writes may go to (an MCP server's roots); overrides the default.
        planner: keyword arguments for the planner (``gpu``, ``num_gpus``, ...) when ``mode="recommended"``.
        modules: ``model.offload_modules`` for ``mode="fine-grained"`` (a list or ``"expert_fc1,attn_proj"``).
        option: ``mode="recommended"`` only: write recommend's ``options[N]`` instead of its recommendation.
        env: the training environment's facts as ``validate`` takes them (``te_version``): edits and verdict follow it.

    Returns:
        ApplyResult with ``changes`` (each with a why), the unified ``diff``, the ``overrides`` that make the same
        edit on a command line, the validator's ``findings`` on the result, ``written`` (None on a dry run) and
        ``backup`` (the copy of a replaced file).

    Raises:
        ApplyError: the edit cannot be made as asked (PP>1 for activation offload, bad fraction, a write outside the
            allowed roots, ``in_place`` on inline text, ...).
        ConfigError: the input cannot be read or parsed. ParallelSizeError: a parallel size of 0 or below.
        WriteError: the write is refused (an existing file without ``overwrite``, read-only) or failed; none made.
    """
    _check_arguments(output, in_place, planner, mode, output_format)
    text, where, source_path = _read(source, in_place)
    raw, tree = parse_text(text, where)
    base_cfg, cfg, effective_raw = _configs(raw, overrides, where, tree, env or {})
    notes: list[str] = []
    assumptions: list[dict[str, Any]] = []
    resolved_mode, wanted = plan_edits(
        cfg, effective_raw, mode, fraction=fraction, num_layers=num_layers, planner=planner, notes=notes,
        modules=fge.parse_modules(modules), option=option, assumptions=assumptions,
    )  # fmt: skip
    changes, conflicts = _changes(base_cfg, raw, wanted, list(overrides or []), effective_raw, resolved_mode)
    is_json = text.lstrip().startswith("{")
    new_text = render(text, tree, changes, is_json, _copy(raw)) if changes else text
    nothing = [] if changes else [f"nothing to change: the config already has mode={resolved_mode}"]
    result = _result(
        text,
        where,
        source_path.name if source_path else "config.yaml",
        new_text,
        mode=resolved_mode,
        changes=changes,
        overrides=[format_override(c.key, c.new) for c in changes],
        notes=notes + conflicts + nothing,
        assumptions=assumptions,
        env=dict(env or {}),
    )
    return _write_asked(result, source_path, output, in_place, overwrite, output_format, write_roots, allowed_root)


def _write_asked(
    result: ApplyResult,
    source_path: Path | None,
    output: str | os.PathLike[str] | None,
    in_place: bool,
    overwrite: bool,
    output_format: str,
    write_roots: list[Path] | None,
    allowed_root: str | os.PathLike[str] | None,
) -> ApplyResult:
    """``result``, written to ``output`` (or over the source, ``in_place``) when either is asked for."""
    if output or in_place:
        target = Path(output) if output is not None else source_path
        assert target is not None
        roots = write_roots if write_roots is not None else default_roots(source_path, allowed_root)
        write_requested(result, target, source_path, in_place or overwrite, output_format, roots)
    return result


def _read(source: str, in_place: bool) -> tuple[str, str, Path | None]:
    """The config's text, where it came from, and its file (None for inline text or stdin)."""
    text, where = read_source(source)
    source_path = Path(where) if where not in ("<text>", "<stdin>") else None
    if in_place and source_path is None:
        raise ApplyError("in_place needs a config file path; inline text has no file to edit (pass output=PATH)")
    return text, where, source_path
