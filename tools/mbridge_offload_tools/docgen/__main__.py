"""``python -m mbridge_offload_tools.docgen``: regenerate the generated docs (the registry is ``registry.py``).

``--check`` writes nothing and exits 1 when a file or section is stale.
"""

from __future__ import annotations

import argparse
import sys

from mbridge_offload_tools.docgen.registry import regenerate, stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mbridge_offload_tools.docgen", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file is stale; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        out = stale()
        for rel in out:
            print(f"stale: {rel} (run python -m mbridge_offload_tools.docgen)")
        return 1 if out else 0
    for rel in regenerate():
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
