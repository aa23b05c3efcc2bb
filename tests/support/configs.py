"""Bridge config texts the tests share: one model's shape written once, each test's run around it.

The text is built in the order given, one ``key: value`` per line, so a test can still edit it line by line
(``text.replace("seq_length: 16384", ...)``) or append keys to its last section.
"""

from __future__ import annotations

from typing import Any

# Llama 3 / 3.1 8B's shape (the model card's config.json): the run most offload questions are asked about.
LLAMA3_8B: dict[str, Any] = {
    "num_layers": 32,
    "hidden_size": 4096,
    "ffn_hidden_size": 14336,
    "num_attention_heads": 32,
    "num_query_groups": 8,
    "kv_channels": 128,
    "vocab_size": 128256,
}


def _value(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def bridge_yaml(*sections: tuple[str, dict[str, Any]], comment: str | None = None) -> str:
    """The YAML text of ``sections`` (``(name, keys)`` pairs, in order), under an optional ``# comment`` line."""
    lines = [f"# {comment}"] if comment else []
    for name, keys in sections:
        lines.append(f"{name}:")
        lines += [f"  {k}: {_value(v)}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"
