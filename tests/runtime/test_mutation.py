"""The mutation check in CI: every stream/event wait and record of the runtime is seen by a test.

``tests/support/mutation.py`` finds each sync statement (stream waits, event records and waits, synchronize,
query, record_stream) by AST in ``activation/``, ``optimizer/``, ``device.py`` and the CPU model of
streams ``ordering.py`` of ``mbridge_offload_runtime``, replaces it with ``pass`` in a copy of the package and runs
``tests/runtime/test_ordering.py`` (and ``test_device.py`` for the device layer) against the copy (one subprocess
per mutant, ``-x``, with a timeout). Every mutant must die: a sync no schedule needs is deleted, with a why-comment
at its place, rather than listed as equivalent. About two minutes on two cores.
"""

from __future__ import annotations

import ast

import pytest

from tests.support import mutation

pytestmark = [pytest.mark.slow, pytest.mark.ordering, pytest.mark.long]


def test_sites_are_found_by_ast_and_mutated_in_place() -> None:
    sites = mutation.find_sites()
    files = {s.path for s in sites}
    assert {
        "activation/passes.py",
        "optimizer/buckets.py",
        "optimizer/hybrid.py",
        "optimizer/grad_hooks.py",
        "device.py",
        "ordering.py",
    } <= files
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
    unkilled = [f"{o.site.path}:{o.site.line} {o.site.text}" for o in outcomes if not o.killed]
    assert not unkilled, "mutants that survive (equivalent or not):\n" + "\n".join(unkilled)
    assert len(outcomes) >= 26, [o.site.text for o in outcomes]
