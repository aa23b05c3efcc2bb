"""Where a picture goes: its format from the file's extension, the checks made before anything is computed, the write.

The write is apply's (``actions.safe_write``): a file replaced only with consent and backed up, atomically, inside
the CLI's directories (as apply's) or the MCP server's roots.
"""

from __future__ import annotations

import os
from pathlib import Path

from mbridge_offload.actions import safe_write
from mbridge_offload.config.errors import InputError

EXTENSIONS = {".svg": "svg", ".png": "png"}


def choose_format(output: str | None, fmt: str | None, default: str) -> str:
    """``svg`` or ``png``: the output's extension decides; ``fmt`` must agree with it; else ``fmt`` or ``default``."""
    if output is None:
        return fmt or default
    ext = Path(output).suffix.lower()
    by_ext = EXTENSIONS.get(ext)
    if by_ext is None:
        raise InputError(
            f"--output {output}: the picture's format comes from the file's extension, and "
            f"{ext or 'no extension'} is neither .svg nor .png; nothing written",
            "name the file FILE.svg (the default format) or FILE.png",
        )
    if fmt is not None and fmt != by_ext:
        raise InputError(f"--format {fmt} contradicts --output {output} ({by_ext})", f"name the file FILE.{fmt}")
    return by_ext


def default_name(kind: str, sweep_key: str | None, fmt: str) -> str:
    """The CLI's file when no ``--output`` is given, in the working directory."""
    return f"mbridge-offload-{kind}{f'-{sweep_key}' if sweep_key else ''}.{fmt}"


def check_target(output: str, roots: list[Path], consent: bool) -> Path:
    """``output`` as a path a picture may be written to, checked before any point is computed."""
    target = Path(output).expanduser()
    real = safe_write.resolve_target(target)  # a symlink is judged by where the write lands
    if not any(real == root or real.is_relative_to(root) for root in (r.resolve() for r in roots)):
        raise InputError(
            f"--output {output}: outside the directories a picture may be written to "
            f"({', '.join(str(r) for r in roots)}); nothing written",
            "write inside them (CLI: --allowed-root DIR adds one; MCP: the server's roots)",
        )
    if not real.parent.is_dir():
        raise InputError(
            f"--output {output}: the directory {real.parent} does not exist; nothing written",
            "create it first, or choose another path",
        )
    if not os.access(real.parent, os.W_OK):
        raise InputError(f"--output {output}: cannot write in {real.parent}; nothing written", "choose another path")
    safe_write.check_replaceable(real, overwrite=consent, what="--output")
    return target


def write(target: Path, data: bytes, consent: bool) -> tuple[str, str | None, bool]:
    """Write ``data`` to ``target`` under the safety rules (the same bytes already there: left alone); returns
    (written, backup, rewritten)."""
    real = safe_write.resolve_target(target)
    if consent and real.is_file() and real.read_bytes() == data:
        return str(target), None, False
    exists = safe_write.check_replaceable(real, overwrite=consent, what="--output")
    backup = safe_write.make_backup(real) if exists else None
    try:
        safe_write.atomic_write(target, data)
    except BaseException:
        if backup is not None:  # nothing changed: no backup of an untouched file is left behind
            backup.unlink(missing_ok=True)
        raise
    return str(target), str(backup) if backup else None, True
