"""``python -m tools.gendocs``: regenerate the generated docs from their single sources of truth.

A small registry: each entry maps a file (relative to the repository root) to a function returning its full
text. Add an entry to generate another file. ``--check`` writes nothing and exits 1 when a file is stale.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rules() -> str:
    from offload.rules import render_rules_markdown

    return render_rules_markdown()


def _marked(rel: str) -> Callable[[], str]:
    """A file whose generated sections sit between marker comments (tools/skilldocs.py); the rest is hand-written."""

    def generate() -> str:
        from tools.skilldocs import render_file

        return render_file(rel, (ROOT / rel).read_text(encoding="utf-8"))

    return generate


def _card() -> str:
    from tools.doc_card import render_card

    return render_card((ROOT / "card.yaml").read_text(encoding="utf-8"))


GENERATORS: dict[str, Callable[[], str]] = {
    "docs/rules.md": _rules,
    "SKILL.md": _marked("SKILL.md"),
    "docs/parameters.md": _marked("docs/parameters.md"),
    "docs/benchmarks.md": _marked("docs/benchmarks.md"),
    "docs/cpu-offloading.md": _marked("docs/cpu-offloading.md"),
    "card.yaml": _card,
}


def stale(root: Path = ROOT) -> list[str]:
    """The registered files whose content differs from what their generator produces."""
    out = []
    for rel, generate in GENERATORS.items():
        path = root / rel
        if not path.exists() or path.read_text(encoding="utf-8") != generate():
            out.append(rel)
    return out


def regenerate(root: Path = ROOT) -> list[str]:
    """Write every registered file that is stale; returns the paths written."""
    written = []
    for rel in stale(root):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(GENERATORS[rel](), encoding="utf-8")
        written.append(rel)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gendocs", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file is stale; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        out = stale()
        for rel in out:
            print(f"stale: {rel} (run python -m tools.gendocs)")
        return 1 if out else 0
    for rel in regenerate():
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
