"""What a model's family decides when a config does not say it: whether the embedding and output layer are tied.

``model.share_embeddings_and_output_weights`` changes the answer by a whole vocabulary × hidden matrix (Llama 3.1
405B at TP 8: 0.26 G parameters per GPU, with its gradient and optimizer state about 1.8 GiB at DP 8; at PP > 1
megatron-core keeps a copy of a tied embedding on the last stage, so there it changes the DP traffic, not the
memory), and a partial config (the sizes pasted from a model card) rarely writes it. Where it comes from, in order:

1. the input: the config's key, ``--share-embeddings-and-output-weights`` (a flag beats the config), a Megatron-LM
   command line (tied unless ``--untie-embeddings-and-output-weights``: ``config/megatron_lm/argv.py`` writes the
   key), or
   the ``--model`` preset;
2. the model's family, from a name the config carries (``model.hf_model_id``, the provider class in
   ``model._target_``, ``tokenizer.tokenizer_model``, ``checkpoint.pretrained_checkpoint``) matched against
   :data:`TYING`, or from its sizes when they are those of a preset;
3. the frontend's default, said to be assumed: Bridge's ``GPTModelProvider`` ties them
   (``share_embeddings_and_output_weights=True``); megatron-core's ``GPTModel``, which a caller with sizes only
   builds, does not.

Never imports torch.
"""

from __future__ import annotations

import re
from typing import Any

# (pattern on a model / tokenizer / provider name, tied, the published fact). First match wins: the small models
# of a family that tie come before the family.
TYING: tuple[tuple[str, bool, str], ...] = (
    (r"llama[-_ ]?3[._]?2\D*[13]b", True, "Llama 3.2 1B / 3B config.json: tie_word_embeddings true"),
    (r"llama[-_ ]?3", False, "Llama 3 / 3.1 / 3.3 (8B, 70B, 405B) config.json: tie_word_embeddings false"),
    (r"qwen[-_ ]?3\D*(0\.6|1\.7|4)b", True, "Qwen3 0.6B / 1.7B / 4B config.json: tie_word_embeddings true"),
    (r"qwen[-_ ]?3", False, "Qwen3 8B and larger, dense and MoE, config.json: tie_word_embeddings false"),
    (r"qwen[-_ ]?2\.?5\D*(0\.5|1\.5|3)b", True, "Qwen2.5 0.5B / 1.5B / 3B config.json: tie_word_embeddings true"),
    (r"qwen[-_ ]?2\.?5", False, "Qwen2.5 7B and larger config.json: tie_word_embeddings false"),
    (r"deepseek", False, "DeepSeek-V2 / V3 / R1 config.json: tie_word_embeddings false"),
    (r"gpt[-_]?oss", False, "openai gpt-oss-20b / 120b config.json: tie_word_embeddings false"),
    (r"kimi[-_]?k2|moonlight", False, "moonshotai Kimi-K2 / Moonlight config.json: tie_word_embeddings false"),
    (r"mixtral|mistral", False, "mistralai Mixtral / Mistral config.json: tie_word_embeddings false"),
    (r"nemotron", False, "Nemotron-H / Nemotron Nano 2 / Nemotron 3 config.json: tie_word_embeddings false"),
    (r"gemma", True, "Gemma 2 / 3 config.json: tie_word_embeddings true"),
)
_TYING = tuple((re.compile(p, re.I), tied, why) for p, tied, why in TYING)

# Where a Bridge config names its model.
NAME_KEYS = ("model.hf_model_id", "model._target_", "tokenizer.tokenizer_model", "checkpoint.pretrained_checkpoint")
# The sizes that identify a preset (all must match, each where the input has it).
SIZES = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "ffn_hidden_size", "num_query_groups")

KEY = "model.share_embeddings_and_output_weights"
BRIDGE_DEFAULT = (
    True,
    "assumed: Bridge's GPTModelProvider default (share_embeddings_and_output_weights=True); neither the config nor "
    "a known model family ({names}) says it",
)
MCORE_DEFAULT = (
    False,
    "assumed: megatron-core's GPTModel default (share_embeddings_and_output_weights=False); no config and no known "
    "model family",
)


def _name(raw: dict[str, Any], dotted: str) -> str | None:
    section, _, key = dotted.partition(".")
    body = raw.get(section)
    value = body.get(key) if isinstance(body, dict) else None
    return value if isinstance(value, str) and value.strip() else None


def by_name(raw: dict[str, Any] | None) -> tuple[bool, str] | None:
    """``(tied, note)`` from the first model name the config carries that a family of :data:`TYING` matches."""
    for dotted in NAME_KEYS:
        name = _name(raw or {}, dotted)
        if name is None:
            continue
        for pattern, tied, why in _TYING:
            if pattern.search(name):
                return tied, f"{dotted} {name[-80:]!r}: {why}"
    return None


def by_sizes(values: dict[str, Any]) -> tuple[bool, str] | None:
    """``(tied, note)`` when the sizes are those of a model preset (its published config.json)."""
    from mbridge_offload.plan.inputs.presets import MODEL_PRESETS

    for name, m in MODEL_PRESETS.items():
        given = {k: values.get(k) for k in SIZES if values.get(k) is not None}
        if {"num_layers", "hidden_size", "num_attention_heads", "vocab_size"} <= set(given) and all(
            getattr(m, k) == v for k, v in given.items()
        ):
            state = "tied" if m.tied_embeddings else "untied"
            return m.tied_embeddings, f"the sizes are those of the {name} preset, whose config.json has them {state}"
    return None


def tying(values: dict[str, Any], raw: dict[str, Any] | None, frontend: str | None) -> tuple[bool, str, str]:
    """``(tied, source, note)`` when no input decides it: the model's family, else the frontend's default.

    Args:
        values: the merged planner inputs (their sizes identify a preset).
        raw: the config as read (its names identify a family), None without one.
        frontend: ``bridge`` or ``megatron-lm`` (a config or a command line), None (planner inputs only).
    """
    found = by_name(raw) or by_sizes(values)
    if found is not None:
        return found[0], "model family", found[1]
    if frontend is None:
        return MCORE_DEFAULT[0], "default", MCORE_DEFAULT[1]
    return BRIDGE_DEFAULT[0], "default", BRIDGE_DEFAULT[1].format(names=", ".join(NAME_KEYS))


def output_layer_note(vocab: int, hidden: int, pp: int) -> str:
    """What the choice is worth, for the assumption's note: at PP 1 the output layer with its gradient and optimizer
    state; at PP > 1 megatron-core keeps a copy of a tied embedding on the last stage, so per-GPU memory is the same
    (the DP gradient all-reduce still differs)."""
    size = f"the output layer ({vocab * hidden / 1e6:,.0f} M parameters, with its gradient and optimizer state)"
    worth = (
        f"untied adds {size} to the one stage"
        if pp <= 1
        else f"at PP {pp} the last stage holds {size} either way (megatron-core keeps a copy of a tied embedding there)"
    )
    return f"{worth}; set {KEY} (or --[no-]share-embeddings-and-output-weights) to decide"
