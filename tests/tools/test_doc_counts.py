"""Counts that docs state in prose match the code: the MCP tools, the rules, the offload suite."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mbridge_offload_tools.docgen.skill.catalogue import server_tools
from mbridge_offload_tools.docgen.skill.references import _WORDS, number_word
from tests.support import tree

ROOT = tree.ROOT
DOCS = sorted(
    [ROOT / "README.md", ROOT / "SKILL.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "references").glob("*.md")]
)
_NUMBER = r"(\d+|" + "|".join(_WORDS[1:]) + r")"
_TOOLS_CLAIM = re.compile(rf"\b{_NUMBER} (?:MCP )?tools\b", re.I)
_RULES_CLAIM = re.compile(rf"\bAll {_NUMBER} rules\b")


def _value(word: str) -> int:
    return int(word) if word.isdigit() else _WORDS.index(word.lower())


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_count_of_tools_in_prose_is_the_servers(doc: Path) -> None:
    count = len(server_tools())
    claims = [m.group(0) for m in _TOOLS_CLAIM.finditer(doc.read_text(encoding="utf-8"))]
    assert all(_value(c.split()[0]) == count for c in claims), (claims, count)


def test_the_tools_reference_states_the_count_it_lists() -> None:
    text = (ROOT / "references" / "tools.md").read_text(encoding="utf-8")
    count = len(server_tools())
    assert f"The {number_word(count)} tools of the MCP server" in text
    assert len(re.findall(r"^## `\w+`$", text, re.M)) == count


def test_a_count_of_rules_in_prose_is_the_catalogues() -> None:
    from mbridge_offload.config.rules.catalogue import all_rules

    for doc in DOCS:
        for m in _RULES_CLAIM.finditer(doc.read_text(encoding="utf-8")):
            assert _value(m.group(1)) == len(all_rules()), (doc, m.group(0))


def test_the_claim_pattern_catches_a_wrong_count() -> None:
    assert [m.group(0) for m in _TOOLS_CLAIM.finditer("the five tools; 6 MCP tools")] == ["five tools", "6 MCP tools"]
