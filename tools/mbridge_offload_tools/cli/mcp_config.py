"""``mbridge-offload mcp-config``: the project-scope MCP entry that starts this checkout's server from a user's project.

A host starts the servers of the ``.mcp.json`` of the project it opens, so from any project but this one the entry
must name this checkout's launcher by its absolute path. Without ``--project`` the entry is printed; with it
``DIR/.mcp.json`` is written: created, or changed only with ``--force`` (other servers kept, a backup, atomically).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from mbridge_offload.actions.safe_write import atomic_write, check_replaceable, make_backup
from mbridge_offload_tools.cli.common import EXIT_OK, UsageError, emit

SERVER_NAME = "mbridge-offload"
ROOT = Path(__file__).resolve().parents[3]


def launcher() -> Path:
    """The command a project's entry runs: this checkout's ``scripts/mcp-server`` (it sets itself up on its first
    start), else the installed ``mbridge-offload-mcp`` script."""
    script = ROOT / "scripts" / "mcp-server"
    if script.is_file():
        return script
    beside = Path(sys.executable).parent / "mbridge-offload-mcp"
    found = beside if beside.is_file() else shutil.which("mbridge-offload-mcp")
    if found is None:
        raise UsageError(
            f"no MCP server launcher here: {script} is missing and no mbridge-offload-mcp console script is installed",
            "run mcp-config from the skill folder's own CLI (scripts/mbridge-offload mcp-config …)",
        )
    return Path(found).resolve()


def entry() -> dict[str, Any]:
    """This checkout's server entry: ``{"command": <absolute launcher>, "args": []}``."""
    return {"command": str(launcher()), "args": []}


def _read_existing(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(
            f"{path}: cannot be read as JSON ({exc}); nothing written", "fix or remove it, then run again"
        ) from None
    servers = data.get("mcpServers", {}) if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise UsageError(
            f"{path}: not an MCP config (an object whose mcpServers is an object); nothing written",
            "fix or remove it, then run again",
        )
    return data


def write_project_entry(project: Path, force: bool = False) -> dict[str, Any]:
    """Put this checkout's entry into ``project/.mcp.json``: ``{"ok", "entry", "project", "written", "backup",
    "changed"}`` (``written`` None when it already held the same entry)."""
    if not project.is_dir():
        raise UsageError(f"--project {project}: not a directory", "pass the folder your MCP host opens as the project")
    path = project / ".mcp.json"
    ours = entry()
    data: dict[str, Any] = {"mcpServers": {}}
    exists = path.exists() or path.is_symlink()
    if exists:
        data = _read_existing(path)
        data.setdefault("mcpServers", {})
        if data["mcpServers"].get(SERVER_NAME) == ours:
            return _answer(ours, project, None, None, changed=False)
    if exists and not force:
        raise UsageError(
            f"{path}: exists; nothing written; it would get the server entry {json.dumps({SERVER_NAME: ours})}",
            "pass --force to add it (the file's other servers are kept, a backup is written), or add it by hand",
        )
    check_replaceable(path.resolve(), overwrite=True)  # a read-only file or a non-file is never replaced
    backup = make_backup(path.resolve()) if exists else None
    data["mcpServers"][SERVER_NAME] = ours
    written = atomic_write(path, json.dumps(data, indent=2) + "\n")
    return _answer(ours, project, written, backup, changed=True)


def _answer(ours: dict[str, Any], project: Path | None, written: Path | None, backup: Path | None, changed: bool):
    return {
        "ok": True,
        "entry": {"mcpServers": {SERVER_NAME: ours}},
        "project": None if project is None else str(project.resolve()),
        "written": None if written is None else str(written),
        "backup": None if backup is None else str(backup),
        "changed": changed,
    }


# ---------------------------------------------------------------------------------------------- CLI


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "mcp-config",
        help="print or write the project-scope .mcp.json entry that starts this server from your project",
        description="The MCP server entry for a project's .mcp.json (Claude Code's project scope; Cursor reads the "
        "same shape from .cursor/mcp.json) with the absolute path of this checkout's launcher, which works from any "
        "project. Prints it; with --project DIR writes DIR/.mcp.json (an existing file only with --force: its other "
        "servers are kept and a backup is written).",
    )
    p.add_argument("--project", metavar="DIR", help="the project folder whose .mcp.json gets the entry")
    p.add_argument(
        "--force", action="store_true", help="change an existing .mcp.json (other servers kept, a backup written)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_mcp_config)


def _human(d: dict[str, Any]) -> str:
    lines = [json.dumps(d["entry"], indent=2)]
    if d["project"] is None:
        lines.append("(printed only: pass --project DIR to write it into DIR/.mcp.json)")
    elif d["changed"]:
        lines.append(f"wrote {d['written']}" + (f" (backup: {d['backup']})" if d["backup"] else ""))
    else:
        lines.append(f"{Path(d['project']) / '.mcp.json'} already has this entry; nothing written")
    return "\n".join(lines)


def cmd_mcp_config(args: argparse.Namespace) -> int:
    if args.project is None:
        if args.force:
            raise UsageError("--force needs --project DIR (without it nothing is written)")
        answer = _answer(entry(), None, None, None, changed=False)
    else:
        answer = write_project_entry(Path(args.project).expanduser(), force=args.force)
    emit(answer, args.json, _human)
    return EXIT_OK
