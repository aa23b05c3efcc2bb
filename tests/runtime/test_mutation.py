"""The mutation check in CI: every stream/event wait and record of the runtime is seen by a test.

``tests/support/mutation.py`` finds each ordering statement by AST in ``runtime/activation/``,
``runtime/optimizer/buckets.py`` and ``runtime/optimizer/hybrid.py``, replaces it with ``pass`` in a copy of the
package and runs ``tests/runtime/test_ordering.py`` against the copy (one subprocess per mutant, ``-x``, with a
timeout). About a minute on two cores.
"""

from __future__ import annotations

import ast

import pytest

from tests.support import mutation

pytestmark = [pytest.mark.slow, pytest.mark.ordering, pytest.mark.long]


def test_sites_are_found_by_ast_and_mutated_in_place() -> None:
    sites = mutation.find_sites()
    files = {s.path for s in sites}
    assert {"runtime/activation/passes.py", "runtime/optimizer/buckets.py", "runtime/optimizer/hybrid.py"} <= files
    assert any("wait_event" in s.text for s in sites) and any("record_stream" in s.text for s in sites)
    site = next(s for s in sites if s.path.endswith("passes.py"))
    source = (mutation.PACKAGE_DIR / site.path).read_text()
    mutated = mutation.mutate(source, site)
    ast.parse(mutated)
    assert mutated.count("\n") == source.count("\n")
    assert site.text not in " ".join(mutated.split())
    stale = mutation.stale_equivalents(sites)
    assert stale == [], f"EQUIVALENT in tests/support/mutation.py names statements that no longer exist: {stale}"


def test_a_multi_line_statement_is_replaced_whole() -> None:
    source = "def f(s):\n    x = 1\n    s.wait_event(\n        e\n    )\n    return x\n"
    finder = mutation._Finder("m.py", source)
    finder.visit(ast.parse(source))
    (site,) = finder.sites
    mutated = mutation.mutate(source, site)
    assert mutated == "def f(s):\n    x = 1\n    pass\n\n\n    return x\n"


def test_every_mutant_is_killed() -> None:
    outcomes = mutation.run_all(workers=2)
    survivors = [f"{o.site.path}:{o.site.line} {o.site.text}: {o.detail}" for o in outcomes if o.survived]
    assert not survivors, "mutants no ordering test kills:\n" + "\n".join(survivors)
    killed = [o for o in outcomes if o.killed]
    assert len(killed) >= 14, [o.site.text for o in outcomes]
