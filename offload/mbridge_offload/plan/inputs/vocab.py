"""The vocabulary a Hugging Face tokenizer decides, from a table shipped with the package (``data/hf_vocab.yaml``).

A Bridge config whose ``model.vocab_size`` is null takes the tokenizer's vocabulary at start-up (Bridge's
``training/setup.py``), so the file alone does not say it; for the tokenizers of the models Bridge's recipes train,
the table does, offline. Never imports torch.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Any, NamedTuple

from ruamel.yaml import YAML


class TokenizerVocab(NamedTuple):
    vocab_size: int
    basis: str  # "tokenizer" (its own length) or "config" (the model's embedding rows)
    source: str


@functools.cache
def _table() -> tuple[tuple[re.Pattern[str], TokenizerVocab], ...]:
    text = resources.files("mbridge_offload.plan").joinpath("data/hf_vocab.yaml").read_text(encoding="utf-8")
    rows = YAML(typ="safe").load(text)
    return tuple(
        (re.compile(r["match"], re.I), TokenizerVocab(int(r["vocab_size"]), str(r["basis"]), str(r["source"])))
        for r in rows
    )


def tokenizer_vocab(tokenizer: dict[str, Any]) -> tuple[str, TokenizerVocab] | None:
    """The tokenizer's name and vocabulary when ``tokenizer`` (a Bridge ``TokenizerConfig`` section) names a
    Hugging Face tokenizer the table knows; None otherwise."""
    name = tokenizer.get("tokenizer_model")
    if not isinstance(name, str) or tokenizer.get("tokenizer_type") not in (None, "HuggingFaceTokenizer"):
        return None
    for pattern, vocab in _table():
        if pattern.search(name):
            return name, vocab
    return None
