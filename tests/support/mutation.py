"""Mutation check for stream ordering: remove each wait/record of the runtime, require a failing test for each.

Every statement in the target files that calls a stream/event ordering method (``wait_event``, ``wait_stream``,
``record_event``, ``record``, ``synchronize``, ``query``, ``record_stream``) is found by walking the AST (never by
line number, so edits elsewhere do not break it). For each one, a temporary copy of the package has that
statement replaced with ``pass``; the targeted ordering tests run against the copy in their own subprocess
(``-x``, with a timeout), and the mutant must make one of them fail. A mutant no test kills is a wait or record
the suite cannot see — either a missing test or a statement that orders nothing.

Run it alone::

    .venv/bin/python -m tests.support.mutation            # a table; exit 1 if a mutant survives
    .venv/bin/python -m tests.support.mutation --json

``tests/runtime/test_mutation.py`` runs it under ``make test``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "offload" / "mbridge_offload_runtime"  # the folder path is the import path
PACKAGE = "mbridge_offload_runtime"
ORDERING_METHODS = frozenset(
    {"wait_event", "wait_stream", "record_event", "record", "synchronize", "query", "record_stream"}
)
# The files whose ordering calls are mutated (globs under the runtime package), and the tests that must see each.
TARGETS: dict[str, list[str]] = {
    "activation/*.py": ["tests/runtime/test_ordering.py"],
    "optimizer/*.py": ["tests/runtime/test_ordering.py"],
    # The device layer and the CPU model of streams: their syncs are the ones the runtime's tests rely on.
    "device.py": ["tests/runtime/test_device.py", "tests/runtime/test_ordering.py"],
    "ordering.py": ["tests/runtime/test_device.py", "tests/runtime/test_ordering.py"],
}
TIMEOUT_S = 120
# Statements whose removal no schedule can observe, with the reason; they are still run and reported. Keyed by
# (file, function, statement) so edits elsewhere do not break it; a key that matches no statement is an error.
# Empty: a sync that orders nothing is deleted, and the code says at its place why none is needed (the step's
# H2D-stream wait and dummy_step's final synchronize in optimizer/hybrid.py went that way).
EQUIVALENT: dict[tuple[str, str, str], str] = {}


@dataclass(frozen=True)
class Site:
    """One statement that orders streams: where it is and what it says."""

    path: str  # relative to the runtime package
    function: str  # the enclosing function's qualified name
    line: int
    end_line: int
    col: int
    end_col: int
    text: str


@dataclass
class Outcome:
    """What happened to one mutant."""

    site: Site
    killed: bool
    returncode: int
    seconds: float
    detail: str
    equivalent: str = ""  # the reason, where the site is listed in EQUIVALENT

    @property
    def survived(self) -> bool:
        """A surviving mutant that is not a listed equivalent one: a wait or record no test can see."""
        return not self.killed and not self.equivalent


def stale_equivalents(sites: list[Site]) -> list[tuple[str, str, str]]:
    """Keys of :data:`EQUIVALENT` that match no statement any more (the list must follow the code)."""
    found = {(s.path, s.function, s.text) for s in sites}
    return [key for key in EQUIVALENT if key not in found]


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str, source: str) -> None:
        self.path, self.source = path, source
        self.scope: list[str] = []
        self.sites: list[Site] = []

    def _scoped(self, node: ast.AST) -> None:
        self.scope.append(node.name)  # type: ignore[attr-defined]
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, (ast.Expr, ast.Assign, ast.AnnAssign, ast.AugAssign)) and _orders(node):
            text = ast.get_source_segment(self.source, node) or ""
            self.sites.append(
                Site(self.path, ".".join(self.scope), node.lineno, node.end_lineno, node.col_offset,
                     node.end_col_offset, " ".join(text.split()))
            )  # fmt: skip
            return
        super().generic_visit(node)


def _orders(statement: ast.stmt) -> bool:
    """True if the statement calls an ordering method (directly, or as an argument or assigned value)."""
    for node in ast.walk(statement):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ORDERING_METHODS:
            return True
    return False


def find_sites(package_dir: Path = PACKAGE_DIR, targets: dict[str, list[str]] | None = None) -> list[Site]:
    """Every ordering statement in the target files, in file order.

    Args:
        package_dir: the runtime package folder to read.
        targets: glob → tests (default :data:`TARGETS`).

    Returns:
        The sites found (an empty list means the targets hold no ordering call).
    """
    sites: list[Site] = []
    for pattern in targets or TARGETS:
        for file in sorted(package_dir.glob(pattern)):
            source = file.read_text()
            finder = _Finder(str(file.relative_to(package_dir)), source)
            finder.visit(ast.parse(source))
            sites.extend(finder.sites)
    return sites


def mutate(source: str, site: Site) -> str:
    """``source`` with ``site``'s statement replaced by ``pass`` (line numbers kept)."""
    lines = source.splitlines(keepends=True)
    first, last = lines[site.line - 1], lines[site.end_line - 1]
    head, tail = first[: site.col], last[site.end_col :]
    blank = ["\n"] * (site.end_line - site.line)
    return "".join([*lines[: site.line - 1], head + "pass" + tail, *blank, *lines[site.end_line :]])


def tests_for(site: Site) -> list[str]:
    for pattern, tests in TARGETS.items():
        if Path(site.path).match(pattern):
            return tests
    raise KeyError(site.path)


def _copy_package(into: Path, site: Site | None) -> Path:
    """A copy of the runtime package under ``into`` (mutated at ``site`` if given)."""
    target = into / PACKAGE
    shutil.copytree(PACKAGE_DIR, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if site is not None:
        file = target / site.path
        file.write_text(mutate(file.read_text(), site))
    return into


def _env(pythonpath: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The copy comes first on sys.path; the editable install's finder is appended after the path finder.
    env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _pytest(pythonpath: Path, tests: list[str], timeout: float) -> tuple[int, str]:
    # pytest puts the ini's ``pythonpath`` (this tree's own roots) ahead of PYTHONPATH: point it at the copy instead.
    roots = f"pythonpath={pythonpath} {ROOT / 'offload'} {ROOT / 'tools'}"
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", "-W", "ignore"]
    cmd += ["-o", roots, *tests]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=_env(pythonpath), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout:.0f} s"
    lines = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR", "E "))]
    summary = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else [done.stderr.strip()[-300:]]
    return done.returncode, " | ".join((lines[:2] + summary)[:3])[:400]


def run_mutant(site: Site, timeout: float = TIMEOUT_S) -> Outcome:
    """Run the targeted tests against a copy of the package with ``site`` replaced by ``pass``.

    A mutant counts as killed when pytest reports a failing test (exit code 1) or the run times out (an
    ordering bug that deadlocks is still caught); a collection or usage error (exit 2–5) is not a kill.
    """
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        code, detail = _pytest(_copy_package(Path(tmp), site), tests_for(site), timeout)
    reason = EQUIVALENT.get((site.path, site.function, site.text), "")
    return Outcome(site, code in (1, -1), code, round(time.monotonic() - start, 1), detail, reason)


def check_baseline(timeout: float = TIMEOUT_S) -> None:
    """The unmutated copy must be what the subprocess imports, and its tests must pass.

    Raises:
        RuntimeError: the copy is not imported (the check would test the wrong code) or a test fails on it.
    """
    with tempfile.TemporaryDirectory(prefix="mutant-base-") as tmp:
        path = _copy_package(Path(tmp), None)
        probe = subprocess.run(
            [sys.executable, "-c", f"import {PACKAGE}; print({PACKAGE}.__file__)"],
            env=_env(path), capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        if not probe.stdout.strip().startswith(str(path)):
            raise RuntimeError(f"the package copy is not imported first: {probe.stdout or probe.stderr}")
        tests = sorted({t for ts in TARGETS.values() for t in ts})
        code, detail = _pytest(path, tests, timeout)
        if code != 0:
            raise RuntimeError(f"the ordering tests fail on the unmutated package: {detail}")


def run_all(sites: list[Site] | None = None, workers: int = 2, timeout: float = TIMEOUT_S) -> list[Outcome]:
    """Baseline, then every mutant (``workers`` at a time)."""
    sites = find_sites() if sites is None else sites
    check_baseline(timeout)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda s: run_mutant(s, timeout), sites))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the outcomes as JSON")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per mutant")
    args = parser.parse_args(argv)
    sites = find_sites()
    stale = stale_equivalents(sites)
    outcomes = run_all(sites, workers=args.workers, timeout=args.timeout)
    survivors = [o for o in outcomes if o.survived]
    if args.json:
        print(json.dumps([asdict(o) for o in outcomes], indent=2))
    else:
        for o in outcomes:
            status = "killed" if o.killed else ("equiv." if o.equivalent else "SURVIVED")
            print(f"{status:8} {o.site.path}:{o.site.line} {o.site.function}: {o.site.text}  ({o.seconds} s)")
        killed = sum(o.killed for o in outcomes)
        print(f"{killed}/{len(outcomes)} mutants killed, {len(survivors)} surviving, stale EQUIVALENT keys: {stale}")
    return 1 if survivors or stale or not outcomes else 0


if __name__ == "__main__":
    sys.exit(main())
