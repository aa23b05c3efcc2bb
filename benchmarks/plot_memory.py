"""Draw the planner's pictures under ``docs/img/`` (no GPU needed: the measurements are published runs by others,
tools/mbridge_offload_tools/evidence/data/published.yaml).

The doc generators own the pictures, ``docs/img/memory_vs_offload.png``, ``docs/img/predicted_vs_measured.png``
and one of each kind ``mbridge-offload plot`` draws, ``docs/img/plot_sweep.png``, ``docs/img/plot_phases.png`` and
``docs/img/plot_options.png`` (``mbridge_offload_tools.docgen.docs.plots``: what each shows, and the committed numbers
they are drawn from, ``docs/img/plots.json``); ``python -m mbridge_offload_tools.docgen`` redraws them when the
model moves. This script draws them again on demand, into ``--output-dir`` (default ``docs/img``).

Run: ``python benchmarks/plot_memory.py [--output-dir DIR]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "offload"), str(ROOT / "tools")]

from mbridge_offload_tools.docgen.docs import plots  # noqa: E402


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default=str(ROOT / "docs/img"))
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    values = plots.plot_values()
    paths = []
    for name in plots.IMAGES:
        paths.append(out / f"{name}.png")
        plots.draw(name, values[name], paths[-1])
        print(paths[-1])
    return paths


if __name__ == "__main__":
    main()
