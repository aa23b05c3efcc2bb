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
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mbridge_offload.config.rules.activation import activation_mode_edits
from mbridge_offload.config.schema import OffloadConfig, get_value
from mbridge_offload.config.sources import ConfigError, apply_overrides, build_config, parse_text, read_source

MODES = ("optimizer", "activation", "both", "none", "recommended")
# At or above this fraction the CPU Adam step dominates and overlapping D2H/H2D pays (~7 % at 100 %, upstream card).
OVERLAP_FROM_FRACTION = 0.5
DEFAULT_FRACTION = 0.5  # the card's "0.5 for balanced"


class ApplyError(ConfigError):
    """The requested edit cannot be made as asked; the message says what to change instead."""


@dataclass
class Change:
    key: str
    old: Any
    new: Any
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "old": self.old, "new": self.new, "why": self.why}


@dataclass
class ApplyResult:
    ok: bool
    mode: str
    changes: list[Change]
    findings: list[dict[str, Any]]
    overrides: list[str]
    diff: str
    text: str
    written: str | None = None
    backup: str | None = None
    refused: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "mode": self.mode,
            "changes": [c.to_dict() for c in self.changes],
            "findings": self.findings,
            "written": self.written,
            "backup": self.backup,
            "diff": self.diff,
            "overrides": self.overrides,
            "why": [f"{c.key}: {c.why}" for c in self.changes],
            "refused": self.refused,
            "notes": self.notes,
        }


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
    data = rec.to_json()
    return str(data["mode"]), list(data.get("overrides") or [])


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
    if fraction is not None and mode in ("activation", "none"):
        raise ApplyError(
            f"fraction applies to optimizer offloading; mode={mode} does not use it (use mode=optimizer or mode=both)"
        )
    if num_layers is not None and mode in ("optimizer", "none"):
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
        _, edits = plan_edits(cfg, raw, chosen, fraction=fraction, num_layers=num_layers)
        for key, value in from_planner.items():
            edits.setdefault(key, (value, "recommended by the planner"))
        return chosen, edits
    if mode in ("optimizer", "both"):
        _optimizer_edits(cfg, fraction, edits)
    if mode in ("activation", "both"):
        _activation_edits(cfg, num_layers, edits)
    if mode == "none":
        _want(edits, "optimizer.optimizer_cpu_offload", False, "switch optimizer offloading off")
        _want(edits, "model.cpu_offloading", False, "switch activation offloading off")
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
    yaml.dump(tree, out)
    return out.getvalue()


# ---------------------------------------------------------------------------------------------- writing


def _allowed_roots(source_path: Path | None, allowed_root: str | os.PathLike[str] | None) -> list[Path]:
    roots = [Path.cwd().resolve()]
    if source_path is not None:
        roots.append(source_path.resolve().parent)
    if allowed_root is not None:
        roots.append(Path(allowed_root).resolve())
    return roots


def _check_contained(target: Path, roots: list[Path]) -> None:
    resolved = target.resolve()
    if not any(resolved == root or resolved.is_relative_to(root) for root in roots):
        raise ApplyError(
            f"refusing to write {target}: it is outside the input's directory and the working directory "
            f"({', '.join(str(r) for r in roots)}); write there, or pass an explicit allowed root"
        )


def _backup_path(path: Path) -> Path:
    candidate = path.with_name(path.name + ".bak")
    n = 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}.bak.{n}")
        n += 1
    return candidate


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        if path.exists():
            shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------- entry point


def _validate(config: OffloadConfig, raw: dict[str, Any]) -> tuple[bool, list[dict[str, Any]]]:
    from mbridge_offload.config.validate import validate

    report = validate(config, raw)
    data = report.to_dict()
    return bool(report.ok), list(data.get("findings", []))


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
    allowed_root: str | os.PathLike[str] | None = None,
    planner: dict[str, Any] | None = None,
) -> ApplyResult:
    """Switch an offload mode on (or off) in a config, resolve the conflicts it implies, and optionally write it.

    Args:
        source: a YAML/JSON path or inline YAML/JSON text.
        mode: ``optimizer``, ``activation``, ``both``, ``none`` or ``recommended`` (ask the planner).
        fraction: ``optimizer_offload_fraction`` for optimizer modes, in (0, 1].
        num_layers: ``cpu_offloading_num_layers`` for activation modes.
        overrides: Hydra-style ``KEY=VALUE`` overrides (``section.key``) applied before the mode and written with it.
        output: write the result to this new path.
        in_place: overwrite ``source`` (a file), keeping ``<name>.bak`` of the original.
        output_format: ``yaml`` writes the edited config; ``overrides`` writes the override list, one per line.
        allowed_root: an extra directory writes may go to.
        planner: keyword arguments for the planner (``gpu``, ``num_gpus``, ...) when ``mode="recommended"``.

    Returns:
        ApplyResult with ``changes`` (each with a why), the unified ``diff``, the ``overrides`` that make the same
        edit on a command line, the validator's ``findings`` on the result, and ``written`` (None on a dry run).

    Raises:
        ApplyError: the edit cannot be made as asked (PP>1 for activation offload, bad fraction, a write outside the
            allowed roots, ``in_place`` on inline text, ...).
        ConfigError: the input cannot be read or parsed.
    """
    if output is not None and in_place:
        raise ApplyError("pass either output or in_place, not both")
    if planner and mode != "recommended":
        raise ApplyError(f"GPU/planner settings ({', '.join(planner)}) only apply to mode=recommended")
    if output_format not in ("yaml", "overrides"):
        raise ApplyError(f"format {output_format!r} is not one of yaml, overrides")
    text, where = read_source(source)
    source_path = Path(where) if where not in ("<text>", "<stdin>") else None
    if in_place and source_path is None:
        raise ApplyError("in_place needs a config file path; inline text has no file to edit (pass output=PATH)")
    raw, tree = parse_text(text, where)
    is_json = tree is None
    base_cfg = build_config(json.loads(json.dumps(raw)), where, tree)
    effective_raw = json.loads(json.dumps(raw))
    apply_overrides(effective_raw, list(overrides or []))
    cfg = build_config(effective_raw, where, tree if not overrides else None)

    notes: list[str] = []
    resolved_mode, wanted = plan_edits(
        cfg, effective_raw, mode, fraction=fraction, num_layers=num_layers, planner=planner, notes=notes
    )
    # The caller's own overrides are edits too: written with the mode, so the file validates on its own.
    for key, value in _requested_edits(overrides or [], effective_raw).items():
        if key in wanted and wanted[key][0] != value:
            notes.append(
                f"override {key}={format_value(value)} conflicts with mode={resolved_mode}, which needs "
                f"{key}={format_value(wanted[key][0])}: the mode's value is written"
            )
        wanted.setdefault(key, (value, "requested override"))
    changes = [
        Change(key, get_value(base_cfg, key), value, why)
        for key, (value, why) in wanted.items()
        if get_value(base_cfg, key) != value or (value is None and get_value(base_cfg, key) is not None)
    ]
    new_text = _render(text, tree, changes, is_json, json.loads(json.dumps(raw))) if changes else text
    override_list = [f"{c.key}={format_value(c.new)}" for c in changes]

    new_raw, _ = parse_text(new_text, where)
    new_cfg = build_config(new_raw, where)
    ok, findings = _validate(new_cfg, new_raw)

    label = source_path.name if source_path else "config.yaml"
    diff = "".join(
        difflib.unified_diff(
            text.splitlines(keepends=True),
            new_text.splitlines(keepends=True),
            fromfile=f"a/{label}",
            tofile=f"b/{label}",
        )
    )
    result = ApplyResult(
        ok=ok,
        mode=resolved_mode,
        changes=changes,
        findings=findings,
        overrides=override_list,
        diff=diff,
        text=new_text,
        notes=notes,
    )
    if not changes:
        notes.append(f"nothing to change: the config already has mode={resolved_mode}")
    if not (output or in_place):
        return result
    if not ok:
        errors = [f["rule"] for f in findings if f.get("severity") == "error"]
        result.refused = (
            f"not written: the result still has errors ({', '.join(errors)}); fix them (see findings) and run again"
        )
        return result

    roots = _allowed_roots(source_path, allowed_root)
    target = Path(output) if output is not None else source_path
    assert target is not None
    _check_contained(target, roots)
    payload = new_text if output_format == "yaml" else "".join(line + "\n" for line in override_list)
    if in_place:
        if not changes and output_format == "yaml":
            return result  # idempotent: the file already says this; do not touch it or make another backup
        if output_format == "overrides":
            raise ApplyError(
                "in_place with format=overrides would replace the config by an override list; pass output=PATH instead"
            )
        backup = _backup_path(target)
        shutil.copy2(target, backup)
        result.backup = str(backup)
    atomic_write(target, payload)
    result.written = str(target)
    return result
