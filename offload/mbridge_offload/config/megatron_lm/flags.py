"""Megatron-LM's full argument table (``megatron/training/arguments.py`` of the megatron-core wheel it names).

The table is data, ``data/arguments.txt``, written by ``tests/support/gen_mlm_flags.py`` from the real parser
(``add_megatron_arguments``): one Python literal per line, ``(option strings, dest, kind, nargs, const, default, type
name or None, choices or None)``. Read on first use (about 15 ms), so a config that is no Megatron-LM command line
never pays for it; never imports torch or megatron.
"""

from __future__ import annotations

import ast
import functools
from importlib import resources

DATA = "data/arguments.txt"


@functools.cache
def _table() -> tuple[str, tuple[tuple, ...], frozenset[str]]:
    text = resources.files(__package__).joinpath(DATA).read_text(encoding="utf-8")
    version, rows, fields = "", [], frozenset[str]()
    for line in text.splitlines():
        if line.startswith("# version: "):
            version = line.removeprefix("# version: ").strip()
        elif line.startswith("# transformer_fields: "):
            fields = frozenset(line.removeprefix("# transformer_fields: ").split())
        elif line and not line.startswith("#"):
            rows.append(ast.literal_eval(line))
    return version, tuple(rows), fields


def arguments() -> tuple[tuple, ...]:
    """Every argument of the table, in the parser's order."""
    return _table()[1]


def transformer_fields() -> frozenset[str]:
    """The fields of the release's ``TransformerConfig`` / ``MLATransformerConfig``: Megatron-LM's
    ``core_transformer_config_from_args`` copies every argument of one of these names into the model's config."""
    return _table()[2]


def version() -> str:
    """The megatron-core release whose Megatron-LM parser the table was read from."""
    return _table()[0]
