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

import copy
import difflib
import io
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, computed_field

from mbridge_offload.actions import fine_grained_edit as fge
from mbridge_offload.actions import safe_write, yaml_edit
from mbridge_offload.config.rules.activation import activation_mode_edits
from mbridge_offload.config.schema import OffloadConfig, get_value
from mbridge_offload.config.sources import (
    ConfigError,
    apply_overrides,
    build_config,
    document_root,
    parse_text,
    read_source,
)

MODES = ("optimizer", "activation", "both", "none", "recommended", fge.MODE)
# At or above this fraction the CPU Adam step dominates and overlapping D2H/H2D pays (~7 % at 100 %, upstream card).
OVERLAP_FROM_FRACTION = 0.5
DEFAULT_FRACTION = 0.5  # the card's "0.5 for balanced"


class ApplyError(ConfigError):
    """The requested edit cannot be made as asked; the message says what to change instead."""


class Change(BaseModel):
    """One key edit, with the reason for it."""

    key: str = Field(description="dotted key, e.g. optimizer.optimizer_offload_fraction")
    old: Any = None
    new: Any = None
    why: str

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class ApplyResult(BaseModel):
    """The result of :func:`apply_offload`: the library's value, the CLI's ``--json`` and the MCP output."""

    ok: bool = Field(description="the edited config passes validation")
    mode: str = Field(description="the mode applied (the planner's choice for mode=recommended)")
    changes: list[Change]
    findings: list[dict[str, Any]] = Field(description="validator findings on the edited config")
    written: str | None = Field(None, description="the path written, or null for a dry run / refusal")
    backup: str | None = Field(None, description="the backup of the file replaced, if one was")
    diff: str = Field(description="unified diff of the config")
    overrides: list[str] = Field(description="the same edit as command-line overrides")
    refused: str | None = Field(None, description="why nothing was written although a write was asked for")
    notes: list[str] = Field(default_factory=list)
    text: str = Field("", exclude=True, description="the edited config text (library only)")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def why(self) -> list[str]:
        """``key: reason`` for each change."""
        return [f"{c.key}: {c.why}" for c in self.changes]

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# ---------------------------------------------------------------------------------------------- planning the edit


def format_value(value: Any) -> str:
    """A value as a Hydra override writes it: ``true``, ``null``, ``0.5``, ``none``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _want(edits: dict[str, tuple[Any, str]], key: str, value: Any, why: str) -> None:
    edits[key] = (value, why)


def _optimizer_edits(cfg: OffloadConfig, fraction: float | None, edits: dict[str, tuple[Any, str]]) -> None:
    opt = cfg.optimizer
    _want(edits, "optimizer.optimizer_cpu_offload", True, "master switch for HybridDeviceOptimizer")
    if fraction is None:
        fraction = opt.optimizer_offload_fraction if opt.optimizer_offload_fraction > 0 else DEFAULT_FRACTION
        why = (
            "kept the fraction already set"
            if opt.optimizer_offload_fraction > 0
            else f"Bridge's default 0.0 offloads nothing; {DEFAULT_FRACTION} is the balanced starting point "
            "(pass a fraction, or mode=recommended to size it)"
        )
    else:
        why = "the requested share of optimizer states on the CPU"
    _want(edits, "optimizer.optimizer_offload_fraction", float(fraction), why)
    if fraction >= OVERLAP_FROM_FRACTION and not opt.overlap_cpu_optimizer_d2h_h2d:
        _want(
            edits,
            "optimizer.overlap_cpu_optimizer_d2h_h2d",
            True,
            f"at fraction >= {OVERLAP_FROM_FRACTION} the CPU step dominates; overlapping D2H/H2D hides part of it",
        )
    if not opt.decoupled_weight_decay:
        _want(
            edits,
            "optimizer.decoupled_weight_decay",
            True,
            "Megatron Core asserts 'CPU offloading only supported with decoupled_weight_decay enabled (AdamW mode)'",
        )


def _activation_edits(cfg: OffloadConfig, num_layers: int | None, edits: dict[str, tuple[Any, str]]) -> None:
    model = cfg.model
    pp = model.pipeline_model_parallel_size
    if pp > 1:
        raise ApplyError(
            f"activation offloading needs model.pipeline_model_parallel_size=1, but it is {pp}; Megatron Core raises "
            "'Currently there is no support for Pipeline parallelism with CPU offloading'. Changing PP changes the "
            "per-GPU memory of everything else, so it is not done silently: use mode=optimizer (works with PP>1), "
            "or set model.pipeline_model_parallel_size=1 yourself and run again"
        )
    total = model.num_layers
    if num_layers is None:
        if model.cpu_offloading_num_layers > 0:
            num_layers, why = model.cpu_offloading_num_layers, "kept the layer count already set"
        elif total:
            num_layers = max(1, min(total - 1, total // 2))
            why = "half the layers as a starting point (pass num_layers, or mode=recommended to size it)"
        else:
            raise ApplyError(
                "activation offloading needs a layer count: pass num_layers (--num-layers K), "
                "or give model.num_layers in the config so a default can be chosen"
            )
    else:
        why = "the requested number of offloaded layers"
    if num_layers < 1:
        raise ApplyError(f"num_layers is {num_layers}: offloading 0 layers does nothing; pass at least 1")
    if total is not None and num_layers >= total:
        raise ApplyError(
            f"num_layers is {num_layers}, but model.num_layers is {total}: Megatron Core allows only "
            f"'layers less than {total}'; pass at most {total - 1}"
        )
    _want(edits, "model.cpu_offloading", True, "master switch for layer-level activation offloading")
    _want(edits, "model.cpu_offloading_num_layers", int(num_layers), why)
    # The conflict edits are defined once, beside the rules they resolve (validate's fixes use the same list).
    for key, value, reason in activation_mode_edits(model):
        _want(edits, key, value, reason)


def _recommended(cfg: OffloadConfig, raw: dict[str, Any], planner: dict[str, Any] | None) -> tuple[str, list[str]]:
    """Ask the planner for (mode, overrides) on this config."""
    try:
        from mbridge_offload.plan import planner as plan
    except ImportError as exc:  # pragma: no cover - the planner ships with the package
        raise ApplyError(
            f"mode=recommended needs mbridge_offload.plan.planner ({exc}); pick a mode explicitly"
        ) from None
    try:
        rec = plan.recommend_for_config(cfg, raw=raw, **(planner or {}))
    except (KeyError, ValueError, TypeError) as exc:  # no model sizes, unknown preset, a setup Megatron rejects
        raise ApplyError(f"mode=recommended: the planner cannot size this config: {str(exc).strip(chr(39))}") from None
    return str(rec.mode), list(rec.overrides)


def _requested_edits(overrides: list[str], effective_raw: dict[str, Any]) -> dict[str, Any]:
    """``{section.key: value}`` for the caller's overrides, read back from the overridden config.

    Raises:
        ApplyError: a deletion (``~key``) or a key deeper than ``section.key``: apply cannot write those.
    """
    from hydra.core.override_parser.types import OverrideType

    from mbridge_offload.config.sources import parse_overrides

    out: dict[str, Any] = {}
    for override in parse_overrides(list(overrides)):
        parts = override.key_or_group.split(".")
        if override.type == OverrideType.DEL or len(parts) != 2:
            raise ApplyError(
                f"override {override.input_line!r}: apply writes section.key=VALUE overrides into the file; "
                "remove or edit other keys by hand"
            )
        out[override.key_or_group] = effective_raw[parts[0]][parts[1]]
    return out


def plan_edits(
    cfg: OffloadConfig,
    raw: dict[str, Any],
    mode: str,
    *,
    fraction: float | None = None,
    num_layers: int | None = None,
    planner: dict[str, Any] | None = None,
    notes: list[str] | None = None,
    modules: list[str] | None = None,
) -> tuple[str, dict[str, tuple[Any, str]]]:
    """The key edits a mode implies: ``(resolved mode, {dotted key: (new value, why)})``.

    Raises:
        ApplyError: an unknown mode, a fraction/layer count that does not fit the mode, or activation offload
            on a config with PP > 1.
    """
    if mode not in MODES:
        raise ApplyError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise ApplyError(
            f"fraction is {fraction}: optimizer_offload_fraction must be in (0, 1]; 0 offloads nothing "
            "(use mode=none to switch offloading off)"
        )
    if fraction is not None and mode in ("activation", "none", fge.MODE):
        raise ApplyError(
            f"fraction applies to optimizer offloading; mode={mode} does not use it (use mode=optimizer or mode=both)"
        )
    if num_layers is not None and mode in ("optimizer", "none", fge.MODE):
        raise ApplyError(
            f"num_layers applies to activation offloading; mode={mode} does not use it (use "
            "mode=activation or mode=both)"
        )
    edits: dict[str, tuple[Any, str]] = {}
    if mode == "recommended":
        chosen, overrides = _recommended(cfg, raw, planner)
        if notes is not None:
            notes.append(f"the planner chose mode={chosen}")
        from_planner: dict[str, Any] = {}
        for text in overrides:
            key, _, value = text.lstrip("+").partition("=")
            probe: dict[str, Any] = {}
            apply_overrides(probe, [f"++{key}={value}"])
            section, _, leaf = key.partition(".")
            from_planner[key] = probe[section][leaf]
        if chosen in ("optimizer", "both") and fraction is None:
            fraction = from_planner.get("optimizer.optimizer_offload_fraction")
        if chosen in ("activation", "both") and num_layers is None:
            num_layers = from_planner.get("model.cpu_offloading_num_layers")
        if chosen.startswith(fge.MODE):  # fine-grained, fine-grained+optimizer
            fge.fine_grained_edits(cfg, modules or from_planner.get("model.offload_modules"), edits)
        rest = {fge.MODE: None, fge.MODE + "+optimizer": "optimizer"}.get(chosen, chosen)
        if rest is not None:
            edits.update(plan_edits(cfg, raw, rest, fraction=fraction, num_layers=num_layers)[1])
        for key, value in from_planner.items():
            edits.setdefault(key, (value, "recommended by the planner"))
        return chosen, edits
    if modules is not None and mode != fge.MODE:
        raise ApplyError(
            f"modules apply to fine-grained offloading; mode={mode} does not use them (use mode={fge.MODE})"
        )
    if mode == fge.MODE:
        fge.fine_grained_edits(cfg, modules, edits)
    if mode in ("optimizer", "both"):
        _optimizer_edits(cfg, fraction, edits)
    if mode in ("activation", "both"):
        _activation_edits(cfg, num_layers, edits)
    if mode == "none":
        _want(edits, "optimizer.optimizer_cpu_offload", False, "switch optimizer offloading off")
        _want(edits, "model.cpu_offloading", False, "switch activation offloading off")
        if cfg.model.fine_grained_activation_offloading:
            _want(edits, "model.fine_grained_activation_offloading", False, "switch fine-grained offloading off")
    return mode, edits


# ---------------------------------------------------------------------------------------------- round-trip edit


def _yaml():
    from ruamel.yaml import YAML

    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap long lines the user wrote
    # Bridge's to_yaml() writes `null`, not an empty value.
    yaml.representer.add_representer(
        type(None), lambda rep, _data: rep.represent_scalar("tag:yaml.org,2002:null", "null")
    )
    return yaml


def _detect_indent(text: str) -> tuple[int, int, int]:
    """(mapping, sequence, offset) indentation used by the file, so re-dumping does not re-indent it."""
    for line in text.splitlines():
        stripped = line.lstrip(" ")
        if stripped and not stripped.startswith("#") and line != stripped:
            width = len(line) - len(stripped)
            return width, width, 0
    return 2, 2, 0


def _set_in_tree(tree: Any, dotted: str, value: Any, related: str | None) -> None:
    from ruamel.yaml.comments import CommentedMap

    section_name, _, key = dotted.partition(".")
    section = tree.get(section_name)
    if section is None:
        section = CommentedMap()
        tree[section_name] = section
    if key in section:
        section[key] = value
        return
    keys = list(section.keys())
    position = keys.index(related) + 1 if related in keys else len(keys)
    if position == len(keys) and keys:
        # Comment lines between this section and the next are stored on the section's last key, after that key's
        # own end-of-line comment; move those lines to the new last key so they stay above the next section.
        last = keys[-1]
        entry = section.ca.items.get(last)
        token = entry[2] if entry and len(entry) > 2 else None
        section.insert(position, key, value)
        if token is not None:
            text = token.value
            if text.lstrip(" ").startswith("#"):  # the last key's own end-of-line comment comes first
                eol, _, rest = text.partition("\n")
                eol += "\n"
            else:
                eol, rest = "", text
            if rest:
                moved = copy.copy(token)
                moved.value = "\n" + rest if eol else rest
                section.ca.items[key] = [None, None, moved, None]
                if eol:
                    token.value = eol
                else:
                    entry[2] = None
        return
    section.insert(position, key, value)


_NEIGHBOURS = {
    "optimizer.optimizer_offload_fraction": "optimizer_cpu_offload",
    "optimizer.overlap_cpu_optimizer_d2h_h2d": "optimizer_offload_fraction",
    "model.cpu_offloading_num_layers": "cpu_offloading",
    "model.cpu_offloading_activations": "cpu_offloading_num_layers",
}


def _render(text: str, tree: Any, edits: list[Change], is_json: bool, plain: dict[str, Any]) -> str:
    """The edited text: JSON re-dumped; YAML edited line by line, else (unusual layouts) round-tripped."""
    if not is_json:
        edited = yaml_edit.line_edit(
            text, [(c.key, c.new) for c in edits], _NEIGHBOURS, lambda t: parse_text(t, "<edit>")[0]
        )
        if edited is not None:
            return edited
    if not is_json and tree is None:
        raise ApplyError("this YAML layout cannot be edited safely", "edit the keys by hand (see overrides)")
    if is_json:
        for change in edits:
            section, _, key = change.key.partition(".")
            plain.setdefault(section, {})[key] = change.new
        return json.dumps(plain, indent=2) + "\n"
    yaml = _yaml()
    mapping, sequence, offset = _detect_indent(text)
    yaml.indent(mapping=mapping, sequence=sequence, offset=offset)
    for change in edits:
        _set_in_tree(tree, change.key, change.new, _NEIGHBOURS.get(change.key))
    out = io.StringIO()
    yaml.dump(document_root(tree), out)  # a `ConfigContainer:` perf YAML keeps its wrapper
    return out.getvalue()


# ---------------------------------------------------------------------------------------------- writing


def _default_roots(source_path: Path | None, allowed_root: str | os.PathLike[str] | None) -> list[Path]:
    roots = [Path.cwd().resolve()]
    if source_path is not None:  # the directory that holds the input's name (a link's target may lie elsewhere)
        roots.append(source_path.absolute().parent.resolve())
    if allowed_root is not None:
        roots.append(Path(allowed_root).resolve())
    return roots


def _check_contained(target: Path, roots: list[Path]) -> None:
    resolved = safe_write.resolve_target(target)  # a symlink is judged by where the write really lands
    if not any(resolved == root or resolved.is_relative_to(root) for root in roots):
        raise ApplyError(
            f"refusing to write {target}: it is outside the directories writes may go to "
            f"({', '.join(str(r) for r in roots)})",
            "write there (CLI: --allowed-root DIR; MCP: the server's --root)",
        )


def _write(
    result: ApplyResult,
    target: Path,
    payload: str,
    *,
    consent: bool,
    roots: list[Path],
    unchanged: bool,
) -> None:
    """Write ``payload`` to ``target`` under the safety rules (safe_write.py); record written/backup."""
    _check_contained(target, roots)
    real = safe_write.resolve_target(target)
    if unchanged and real.is_file() and real.read_bytes() == payload.encode("utf-8"):
        result.notes.append(f"{target} already says this: not rewritten")
        return  # idempotent: do not touch the file or make another backup
    exists = safe_write.check_replaceable(real, overwrite=consent)
    backup = safe_write.make_backup(real) if exists else None
    try:
        safe_write.atomic_write(target, payload)
    except BaseException:
        if backup is not None:  # nothing changed: do not leave a backup of an untouched file behind
            backup.unlink(missing_ok=True)
        raise
    result.backup = str(backup) if backup else None
    result.written = str(target)


# ---------------------------------------------------------------------------------------------- entry point


def _validate(config: OffloadConfig, raw: dict[str, Any]) -> tuple[bool, list[dict[str, Any]]]:
    from mbridge_offload.config.validate import validate

    report = validate(config, raw)
    data = report.to_dict()
    return bool(report.ok), list(data.get("findings", []))


def _copy(raw: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(raw))


def _changes(
    base_cfg: OffloadConfig,
    wanted: dict[str, tuple[Any, str]],
    overrides: list[str],
    effective_raw: dict[str, Any],
    mode: str,
) -> tuple[list[Change], list[str]]:
    """The caller's overrides join the mode's edits (written with it, so the file validates on its own)."""
    notes: list[str] = []
    for key, value in _requested_edits(overrides, effective_raw).items():
        if key in wanted and wanted[key][0] != value:
            notes.append(
                f"override {key}={format_value(value)} conflicts with mode={mode}, which needs "
                f"{key}={format_value(wanted[key][0])}: the mode's value is written"
            )
        wanted.setdefault(key, (value, "requested override"))
    changes = [
        Change(key=key, old=get_value(base_cfg, key), new=value, why=why)
        for key, (value, why) in wanted.items()
        if get_value(base_cfg, key) != value or (value is None and get_value(base_cfg, key) is not None)
    ]
    return changes, notes


def _result(text: str, where: str, label: str, new_text: str, **fields: Any) -> ApplyResult:
    """Validate the edited text and build the result with its diff."""
    new_raw, _ = parse_text(new_text, where)
    ok, findings = _validate(build_config(new_raw, where), new_raw)
    diff = "".join(
        difflib.unified_diff(
            text.splitlines(keepends=True),
            new_text.splitlines(keepends=True),
            fromfile=f"a/{label}",
            tofile=f"b/{label}",
        )
    )
    return ApplyResult(ok=ok, findings=findings, diff=diff, text=new_text, **fields)


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
) -> ApplyResult:
    """Switch an offload mode on (or off) in a config, resolve the conflicts it implies, and optionally write it.

    Args:
        source: a YAML/JSON path or inline YAML/JSON text.
        mode: ``optimizer``, ``activation``, ``both``, ``none``, ``fine-grained`` or ``recommended`` (ask the
            planner).
        fraction: ``optimizer_offload_fraction`` for optimizer modes, in (0, 1].
        num_layers: ``cpu_offloading_num_layers`` for activation modes.
        overrides: Hydra-style ``KEY=VALUE`` overrides (``section.key``) applied before the mode and written with it.
        output: write the result to this path; an existing file only with ``overwrite`` (then backed up). The
            input's own path counts as in place.
        in_place: overwrite ``source`` (a file), keeping a unique ``<name>.bak[.N]`` of the original.
        output_format: ``yaml`` writes the edited config; ``overrides`` writes the override list, one per line.
        overwrite: allow ``output`` to replace an existing file (CLI ``--force``, MCP ``overwrite=true``).
        allowed_root: an extra directory writes may go to (besides the input's directory and the cwd).
        write_roots: the exact directories writes may go to (an MCP server's roots); overrides the default.
        planner: keyword arguments for the planner (``gpu``, ``num_gpus``, ...) when ``mode="recommended"``.
        modules: ``model.offload_modules`` for ``mode="fine-grained"`` (a list or ``"expert_fc1,attn_proj"``).

    Returns:
        ApplyResult with ``changes`` (each with a why), the unified ``diff``, the ``overrides`` that make the same
        edit on a command line, the validator's ``findings`` on the result, ``written`` (None on a dry run) and
        ``backup`` (the copy of a replaced file).

    Raises:
        ApplyError: the edit cannot be made as asked (PP>1 for activation offload, bad fraction, a write outside the
            allowed roots, ``in_place`` on inline text, ...).
        ConfigError: the input cannot be read or parsed.
        WriteError: the write is refused (an existing file without ``overwrite``, a read-only file) or failed;
            nothing was changed.
    """
    _check_arguments(output, in_place, planner, mode, output_format)
    text, where = read_source(source)
    source_path = Path(where) if where not in ("<text>", "<stdin>") else None
    if in_place and source_path is None:
        raise ApplyError("in_place needs a config file path; inline text has no file to edit (pass output=PATH)")
    raw, tree = parse_text(text, where)
    base_cfg = build_config(_copy(raw), where, tree)
    effective_raw = apply_overrides(_copy(raw), list(overrides or []))
    cfg = build_config(effective_raw, where, tree if not overrides else None)
    notes: list[str] = []
    resolved_mode, wanted = plan_edits(
        cfg,
        effective_raw,
        mode,
        fraction=fraction,
        num_layers=num_layers,
        planner=planner,
        notes=notes,
        modules=fge.parse_modules(modules),
    )
    changes, conflicts = _changes(base_cfg, wanted, list(overrides or []), effective_raw, resolved_mode)
    is_json = text.lstrip().startswith("{")
    new_text = _render(text, tree, changes, is_json, _copy(raw)) if changes else text
    nothing = [] if changes else [f"nothing to change: the config already has mode={resolved_mode}"]
    result = _result(
        text,
        where,
        source_path.name if source_path else "config.yaml",
        new_text,
        mode=resolved_mode,
        changes=changes,
        overrides=[f"{c.key}={format_value(c.new)}" for c in changes],
        notes=notes + conflicts + nothing,
    )
    if output or in_place:
        target = Path(output) if output is not None else source_path
        assert target is not None
        roots = write_roots if write_roots is not None else _default_roots(source_path, allowed_root)
        _write_requested(result, target, source_path, in_place or overwrite, output_format, roots)
    return result


def _write_requested(
    result: ApplyResult,
    target: Path,
    source_path: Path | None,
    consent: bool,
    output_format: str,
    roots: list[Path],
) -> None:
    """The write half of apply_offload: refuse an invalid result, then write under the safety rules."""
    if not result.ok:
        errors = [f["rule"] for f in result.findings if f.get("severity") == "error"]
        result.refused = (
            f"not written: the result still has errors ({', '.join(errors)}); fix them (see findings) and run again"
        )
        return
    same = source_path is not None and safe_write.resolve_target(target) == safe_write.resolve_target(source_path)
    if same and output_format == "overrides":
        raise ApplyError(
            "writing format=overrides over the config would replace it by an override list", "pass output=PATH"
        )
    payload = result.text if output_format == "yaml" else "".join(line + "\n" for line in result.overrides)
    resolved = [Path(r).resolve() for r in roots]
    _write(result, target, payload, consent=consent, roots=resolved, unchanged=not result.changes)
