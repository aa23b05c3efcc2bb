"""Edit a user's config to switch an offload mode on or off, the way a careful human would.

The file is edited as written (ruamel.yaml round-trip keeps comments, order and quoting), each conflict the mode
implies is resolved with its why (activation offload needs recompute and per-layer CUDA graphs off; optimizer
offload needs an explicit fraction, since Bridge's default 0.0 offloads nothing), and a result the validator
rejects is never written. Writing is opt-in, atomic, backed up in place, idempotent, and confined to allowed roots.
No torch.
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

__all__ = ["apply_offload"]


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
    from mbridge_offload.config.validate import validate

    new_raw, _ = parse_text(new_text, where)
    edited = build_config(new_raw, where)
    edited.env.update(env)
    report = validate(edited, new_raw)
    lines = text.splitlines(keepends=True), new_text.splitlines(keepends=True)
    diff = "".join(difflib.unified_diff(*lines, fromfile=f"a/{label}", tofile=f"b/{label}"))
    findings = list(report.to_dict().get("findings", []))
    return ApplyResult(
        ok=bool(report.ok), findings=findings, diff=diff, text=new_text, effective=dict(report.effective),
        env=dict(report.env), **fields,
    )  # fmt: skip


def _configs(
    raw: dict[str, Any], overrides: list[str] | None, where: str, tree: Any, env: dict[str, str]
) -> tuple[OffloadConfig, OffloadConfig, dict[str, Any]]:
    """The config as read, the config with the caller's overrides, and the latter's raw dict; both carry the
    caller's environment facts (``env``: the TE release the edits and the verdict follow)."""
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

    Writes go to ``output`` (an existing file only with ``overwrite``, backed up) or, with ``in_place``, over
    ``source`` (keeping a ``.bak``), inside the input's directory, the cwd, ``allowed_root`` or exactly
    ``write_roots`` (an MCP server's roots). ``planner`` and ``option`` serve ``mode="recommended"``; ``modules``
    serves ``mode="fine-grained"``; ``env`` holds the facts ``validate`` takes (``te_version``).

    Raises:
        ApplyError: the edit cannot be made as asked. ConfigError: the input cannot be read. ParallelSizeError: a
        parallel size of 0 or below. WriteError: the write is refused or failed; nothing is written then.
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
