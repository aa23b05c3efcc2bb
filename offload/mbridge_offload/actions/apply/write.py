"""Where ``apply`` may write, and the write: containment, refusal of an invalid result, the safe write.

Containment: only under the allowed roots (a symlink judged by where it lands). A result its validator rejects is
not written. The write itself is ``safe_write``'s: no silent overwrite, a backup, atomic replace. Never imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from mbridge_offload.actions import safe_write
from mbridge_offload.actions.apply.result import ApplyError, ApplyResult


def default_roots(source_path: Path | None, allowed_root: str | os.PathLike[str] | None) -> list[Path]:
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


def write_requested(
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
