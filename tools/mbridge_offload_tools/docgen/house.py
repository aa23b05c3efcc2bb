"""The house as the code has it: modules by room, who imports whom, and the functions that grew too long.

Read with ``ast`` (nothing imported), so ``tests/test_house.py`` and ``docs/architecture.md`` see the same facts:
every import counts, at module level, inside a function or under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# import name → its folder: the folder path is the import path (pyproject.toml finds packages under these roots)
PACKAGES = {
    "mbridge_offload": "offload/mbridge_offload",
    "mbridge_offload_runtime": "offload/mbridge_offload_runtime",
    "mbridge_offload_tools": "tools/mbridge_offload_tools",
}
MAX_FUNCTION_LINES = 80

# The rooms, and which other rooms each may import. ``tools → actions → plan → config``; the runtime, a package of
# its own (``mbridge_offload_runtime``, installable alone), serves the actions (parity check) and imports no agent
# code; the upstream facts that the planner and the runtime share live in a room of their own inside it
# (``mbridge_offload_runtime/upstream.py``) that imports nothing of ours and no torch.
# ``upstream``, ``config`` and ``plan`` never import torch.
UPSTREAM = "mbridge_offload_runtime.upstream"
# What each setting reaches, layer class by layer class (the table), and the megatron-core lines behind it: plain
# data beside the upstream facts, read by the rules, the planner and the docs.
UPSTREAM_SITES = "mbridge_offload.upstream_sites"
UPSTREAM_LAYERS = "mbridge_offload.upstream_layers"
_TABLE = (UPSTREAM_LAYERS, UPSTREAM_SITES)
ROOMS: dict[str, tuple[str, ...]] = {
    UPSTREAM: (),
    UPSTREAM_SITES: (),
    UPSTREAM_LAYERS: (UPSTREAM_SITES,),
    "mbridge_offload.config": (UPSTREAM, *_TABLE),
    "mbridge_offload.plan": ("mbridge_offload.config", UPSTREAM, *_TABLE),
    "mbridge_offload_runtime": (UPSTREAM,),
    "mbridge_offload.actions": (
        "mbridge_offload.plan",
        "mbridge_offload.config",
        "mbridge_offload_runtime",
        UPSTREAM,
        *_TABLE,
    ),
    "mbridge_offload_tools": (
        "mbridge_offload.actions",
        "mbridge_offload.plan",
        "mbridge_offload.config",
        "mbridge_offload_runtime",
        UPSTREAM,
        *_TABLE,
    ),
}
TORCH_FREE_ROOMS = (UPSTREAM, *_TABLE, "mbridge_offload.config", "mbridge_offload.plan")


@dataclass(frozen=True)
class Module:
    name: str  # dotted import name
    path: Path
    doc: str  # first line of the module docstring
    imports: frozenset[str]  # project modules (and ``torch``) this one imports, anywhere in it
    torch_at_top: bool  # imports torch at module level (not lazily inside a function)


def _module_name(path: Path) -> str:
    for name, folder in PACKAGES.items():
        if path.is_relative_to(ROOT / folder):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(path)


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest known module that ``name`` (``pkg.mod`` or ``pkg.mod.attr``) refers to."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def modules(root: Path = ROOT) -> dict[str, Module]:
    paths = sorted(p for folder in PACKAGES.values() for p in (root / folder).rglob("*.py"))
    known = {_module_name(p) for p in paths}
    out: dict[str, Module] = {}
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found: set[str] = set()
        torch_top = False
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            for n in names:
                if n.split(".")[0] == "torch":
                    found.add("torch")
                    torch_top = torch_top or node in tree.body
                elif (target := _resolve(n, known)) is not None:
                    found.add(target)
        name = _module_name(path)
        found.discard(name)
        doc = (ast.get_docstring(tree) or "").strip().splitlines()
        out[name] = Module(name, path, doc[0] if doc else "", frozenset(found), torch_top)
    return out


def _drop_parents(mods: dict[str, Module]) -> dict[str, set[str]]:
    """Edges without ``pkg/__init__`` re-export links (a package importing its own children is not a circle)."""
    edges: dict[str, set[str]] = {}
    for m in mods.values():
        edges[m.name] = {t for t in m.imports if t != "torch" and not t.startswith(m.name + ".")}
        # importing ``pkg.child`` also runs ``pkg``; count it only when ``pkg`` is not an ancestor of the importer
        edges[m.name] -= {t for t in edges[m.name] if m.name.startswith(t + ".")}
    return edges


def import_cycles(mods: dict[str, Module] | None = None) -> list[list[str]]:
    """A circle of imports as a sorted list (graphlib finds one at a time), or none."""
    from graphlib import CycleError, TopologicalSorter

    try:
        TopologicalSorter(_drop_parents(mods or modules())).prepare()
    except CycleError as exc:
        return [sorted(set(exc.args[1]))]
    return []


def room_of(name: str) -> str | None:
    for room in sorted(ROOMS, key=len, reverse=True):
        if name == room or name.startswith(room + "."):
            return room
    return None


def wrong_arrows(mods: dict[str, Module] | None = None) -> list[str]:
    """``a → b`` for every import that points against the rooms' direction, or torch in a torch-free room."""
    bad = []
    for m in (mods or modules()).values():
        here = room_of(m.name)
        if here is None:
            continue
        for target in sorted(m.imports):
            if target == "torch":
                if here in TORCH_FREE_ROOMS:
                    bad.append(f"{m.name} → torch (the {here} room never imports torch)")
                continue
            there = room_of(target)
            if there not in (None, here) and there not in ROOMS[here]:
                bad.append(f"{m.name} → {target}")
    return bad


def long_functions(limit: int = MAX_FUNCTION_LINES, root: Path = ROOT) -> list[str]:
    """``path:line name (N lines)`` for every function or method longer than ``limit`` lines."""
    out = []
    for folder in (*PACKAGES.values(), "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    n = (node.end_lineno or node.lineno) - node.lineno + 1
                    if n > limit:
                        out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return out


def render_rooms() -> str:
    """The module map of docs/architecture.md: every module by room, with its docstring's first line."""
    mods = modules()
    lines = ["| module | what it is |", "|---|---|"]
    for name in sorted(mods, key=lambda n: (mods[n].path.parts, n)):
        m = mods[name]
        if m.path.name == "__init__.py" and not m.doc:
            continue
        rel = m.path.relative_to(ROOT).as_posix()
        doc = m.doc.replace("|", r"\|")
        lines.append(f"| `{rel}` | {doc} |")
    return "\n".join(lines) + "\n"


def render_arrows() -> str:
    """Which room imports which, counted from the code."""
    mods = modules()
    counts: dict[tuple[str, str], int] = {}
    for m in mods.values():
        here = room_of(m.name)
        for t in m.imports:
            there = "torch" if t == "torch" else room_of(t)
            if here and there and there != here:
                counts[(here, there)] = counts.get((here, there), 0) + 1
    lines = ["| from room | imports | import statements |", "|---|---|---|"]
    lines += [f"| `{a}` | `{b}` | {n} |" for (a, b), n in sorted(counts.items())]
    return "\n".join(lines) + "\n"


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a module defines itself (functions, classes, assignments), one level into ``if``/``try`` blocks."""
    names: set[str] = set()
    body = list(tree.body)
    for node in tree.body:
        if isinstance(node, ast.If | ast.Try):
            body += node.body + node.orelse
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def reexports(mods: dict[str, Module] | None = None, extra: tuple[Path, ...] = ()) -> list[str]:
    """``importer: name from module`` for every import of a name from a module that does not define it (it only
    imported it): one import path per name. A package's ``__init__`` may gather its public API; ``extra`` files
    (tests, benchmarks) are checked as importers too."""
    mods = mods or modules()
    defined = {name: _top_level_names(ast.parse(m.path.read_text(encoding="utf-8"))) for name, m in mods.items()}
    importers = [(name, m.path) for name, m in mods.items() if m.path.name != "__init__.py"]
    importers += [(str(p.relative_to(ROOT)), p) for p in extra]
    bad = []
    for importer, path in importers:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in mods):
                continue
            if mods[node.module].path.name == "__init__.py":
                continue
            for alias in node.names:
                if f"{node.module}.{alias.name}" not in mods and alias.name not in defined[node.module]:
                    bad.append(f"{importer}: {alias.name} from {node.module}")
    return bad
