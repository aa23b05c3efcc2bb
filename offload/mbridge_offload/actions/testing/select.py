"""What a test run runs: the checked inputs (``-k``, ``path``, a Bridge checkout) and the offload suite.

The offload suite is the test files marked ``cpu_offload`` (module ``pytestmark``), which the upstream skill's
``-k cpu_offload`` selects by marker name; their files are found by reading them (no import, no collection of the
rest) and run with ``-m cpu_offload``.
"""

from __future__ import annotations

import collections
import os
import re
from pathlib import Path

from mbridge_offload.actions.testing.result import TestRunResult, TestSuiteError
from mbridge_offload.actions.testing.run import PROJECT_ROOT

OFFLOAD_MARKER = "cpu_offload"
_MARKED = re.compile(r"^pytestmark\s*=.*\bpytest\.mark\.cpu_offload\b", re.M)

# Megatron Bridge test files that hold offload-related tests (found by reading its tests/unit_tests tree). The
# skill's pair (test_gpt_full_te_layer_autocast_spec.py, peft/test_utils.py) has none; test_optim.py and
# test_config.py do.
BRIDGE_TEST_FILES = (
    "tests/unit_tests/training/test_optim.py",
    "tests/unit_tests/training/test_config.py",
    "tests/unit_tests/models/test_gpt_full_te_layer_autocast_spec.py",
    "tests/unit_tests/peft/test_utils.py",
)
BRIDGE_SELECTOR = "cpu_offload or offload or HybridDevice"

# The upstream skill's selector: for our own suite it runs the offload suite (the tests marked cpu_offload).
OFFLOAD_SUITE_ALIASES = ("cpu_offload",)
# A -k selection that leaves out more than this share of the suite gets a note with both counts.
FEW_SELECTED_SHARE = 0.5

_K_ALLOWED = re.compile(r"^[A-Za-z0-9_ .\-\[\]()/:]+$")


def check_expression(expr: str) -> str:
    """A pytest ``-k`` expression, stripped; TestSuiteError for shell characters, a leading ``-``, or a parse error."""
    expr = expr.strip()
    if not expr:
        raise TestSuiteError("the -k expression is empty; pass names such as 'apply or diagnose', or omit it")
    if len(expr) > 300:
        raise TestSuiteError("the -k expression is longer than 300 characters; select by a few names")
    if expr.startswith("-"):
        raise TestSuiteError(f"-k expression {expr!r} starts with '-', which pytest would read as an option")
    if not _K_ALLOWED.match(expr):
        bad = sorted({c for c in expr if not re.match(r"[A-Za-z0-9_ .\-\[\]()/:]", c)})
        raise TestSuiteError(
            f"-k expression {expr!r} contains {', '.join(repr(c) for c in bad)}: only names, spaces, "
            "'and'/'or'/'not', parentheses, '[]', '.', '-', '/' and ':' are allowed"
        )
    try:
        from _pytest.mark.expression import Expression

        Expression.compile(expr)
    except ImportError:  # pragma: no cover - pytest is a test dependency
        pass
    except Exception as exc:  # ParseError
        raise TestSuiteError(f"-k expression {expr!r} does not parse: {exc}") from None
    return expr


def bridge_files(repo: str | os.PathLike[str]) -> list[str]:
    """The offload-related test files that exist in a Megatron Bridge checkout (TestSuiteError: none)."""
    root = Path(repo).expanduser()
    if not root.is_dir():
        raise TestSuiteError(
            f"bridge_repo {str(repo)!r} is not a directory; pass the root of a Megatron Bridge "
            "checkout (the folder with src/megatron/bridge and tests/unit_tests)"
        )
    found = [f for f in BRIDGE_TEST_FILES if (root / f).is_file()]
    if not found:
        raise TestSuiteError(
            f"bridge_repo {str(repo)!r} has none of {', '.join(BRIDGE_TEST_FILES)}; is it a Megatron Bridge checkout?"
        )
    return found


def check_test_path(path: str) -> str:
    """A test file, folder or node id under this project's ``tests/``, relative to its root (else TestSuiteError)."""
    tests_dir = (PROJECT_ROOT / "tests").resolve()
    node, sep, rest = path.partition("::")
    target = (PROJECT_ROOT / node).resolve()
    if not (target == tests_dir or target.is_relative_to(tests_dir)):
        raise TestSuiteError(
            f"path {path!r} is outside this project's tests/ folder; pass e.g. tests/actions/test_apply.py"
        )
    if not target.exists():
        raise TestSuiteError(f"path {path!r} does not exist; test files are tests/test_*.py")
    if sep and not re.match(r"^[\w\[\]\-.:]+$", rest):
        raise TestSuiteError(f"path {path!r}: the node id part {rest!r} may hold only names, '::', '[]', '-' and '.'")
    return str(target.relative_to(PROJECT_ROOT)) + (sep + rest if sep else "")


# ---------------------------------------------------------------------------------------------- the offload suite


def test_files(root: Path = PROJECT_ROOT) -> list[Path]:
    """Every ``test_*.py`` file under ``root/tests``, sorted."""
    return sorted((root / "tests").rglob("test_*.py"))


def offload_suite_files(root: Path = PROJECT_ROOT) -> list[str]:
    """The test files marked ``cpu_offload``, relative to ``root``, sorted (TestSuiteError: none is marked)."""
    found = [
        str(f.relative_to(root))
        for f in test_files(root)
        if _MARKED.search(f.read_text(encoding="utf-8", errors="replace"))
    ]
    if not found:
        raise TestSuiteError(
            f"no test file under {root / 'tests'} is marked {OFFLOAD_MARKER}; run the whole suite with --all "
            "(MCP: suite='full')"
        )
    return found


def _summary(path: str, root: Path) -> str:
    """A test file's docstring, first sentence, without the module name it often starts with."""
    text = (root / path).read_text(encoding="utf-8", errors="replace")
    doc = re.match(r'\s*(?:"""|\'\'\')(.*?)(?:"""|\'\'\'|\n\n)', text, re.S)
    first = (doc.group(1) if doc else "").strip().split("\n\n")[0].replace("\n", " ")
    return first.split(". ")[0].rstrip(".")


def _counts(result: TestRunResult) -> str:
    return (
        f"{result.selected if result.selected is not None else len(result.tests)} tests "
        f"({result.passed} passed, {result.failed} failed, {result.skipped} skipped, {result.errors} errors)"
    )


def _left_out(files: list[str], root: Path) -> str:
    """The test files a run did not include, counted per folder (``tests/tools: 11``)."""
    rest = [os.path.dirname(r) for f in test_files(root) if (r := str(f.relative_to(root))) not in files]
    per_folder = sorted(collections.Counter(rest).items())
    return f"{len(rest)} other test files ({', '.join(f'{k}: {v}' for k, v in per_folder)})"


def offload_coverage(result: TestRunResult, files: list[str], root: Path = PROJECT_ROOT) -> str:
    """One paragraph for ``coverage``: the offload suite's files and what each covers, counts, what was left out."""
    parts = "; ".join(f"{f} ({_summary(f, root)})" for f in files)
    return (
        f"Ran the offload suite (pytest marker {OFFLOAD_MARKER}): {_counts(result)} in {len(files)} files: {parts}. "
        f"Not run: the {_left_out(files, root)}; run everything with --all (MCP: suite='full'). Plain "
        f"`pytest -k {OFFLOAD_MARKER} tests` selects the same marked tests plus any test elsewhere whose name "
        f"contains {OFFLOAD_MARKER}."
    )


def plain_coverage(result: TestRunResult, files: list[str], selection: str | None) -> str:
    """``coverage`` for a run of paths (the whole ``tests`` folder, a file, a node id) with an optional selection
    (``-k 'apply'``, ``-m cpu_offload``)."""
    where = "the whole suite (tests/)" if files == ["tests"] else ", ".join(files)
    text = f"Ran {where}{f' selected by {selection}' if selection else ''}: {_counts(result)}"
    if result.deselected:
        text += f"; {result.deselected} more tests were collected and deselected"
    if files != ["tests"]:
        text += "; the rest of the suite did not run (--all runs everything)"
    return text + "."
