"""Megatron-LM command lines (``--num-layers 4 --bf16 …``) → a raw config, read with Megatron-LM's own parser.

The parser is Megatron-LM 0.19.2's full argument set (:mod:`mbridge_offload.config.megatron_lm.flags`, generated from
the real
``add_megatron_arguments`` of the wheel: 807 arguments, types, choices, ``store_true``/``store_false`` and defaults).
Only the flags given on the command line are taken (with the few Megatron-LM CLI defaults that differ from the
dataclass defaults); an unknown flag is never dropped silently: it is kept in ``unknown_arguments`` and
``validate`` warns about it (``CFG-UNKNOWN-ARGUMENT``). No torch.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from mbridge_offload.config.errors import InputError
from mbridge_offload.config.megatron_lm import flags as table
from mbridge_offload.config.schema import SECTIONS

# Megatron-LM's CLI defaults where they differ from the dataclass (arguments.py) and matter to a rule.
MLM_CLI_DEFAULTS: dict[str, Any] = {"optimizer.optimizer_offload_fraction": 1.0, "optimizer.fp8_recipe": "delayed"}
# TransformerConfig fields that some rule reads from the model section's extras.
_MODEL_EXTRAS = {
    "moe_flex_dispatcher_backend",
    "moe_token_dispatcher_type",
    "cuda_graph_modules",
    "moe_expert_capacity_factor",
    "moe_pad_expert_input_to_capacity",
    "fp8_recipe",
    "fp4",
    "tp_comm_overlap",  # a TransformerConfig field Megatron-LM copies from its args (ModelParallelConfig)
}
_TYPES = {"int": int, "float": float, "str": str}
# Arguments that core_transformer_config_from_args (training/argument_utils.py, 0.19.2) passes to TransformerConfig
# under another name.
RENAMED: dict[str, str] = {
    "num_experts": "num_moe_experts",
    "decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
    "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
    "fp8_param_gather": "fp8_param",
    "fp4_param_gather": "fp4_param",
}


class ArgvError(InputError):
    """Megatron-LM's own parser refuses the command line (bad value, invalid choice)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print and exit
        raise ArgvError(message)


@functools.cache
def parser() -> argparse.ArgumentParser:
    """Megatron-LM's argument parser, rebuilt from the generated table; only given flags land in the namespace."""
    p = _Parser(add_help=False, allow_abbrev=False, argument_default=argparse.SUPPRESS)
    for options, dest, kind, nargs, const, _default, type_name, choices in table.arguments():
        kw: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS}
        if kind in ("store_true", "store_false", "store_const"):
            kw.update(action="store_const", const={"store_true": True, "store_false": False}.get(kind, const))
        elif kind == "boolean_optional":
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw.update(action="append" if kind == "append" else "store", nargs=nargs, choices=choices)
            if type_name in _TYPES:
                kw["type"] = _TYPES[type_name]
        p.add_argument(*options, **kw)
    return p


def _place(raw: dict[str, Any], dest: str, value: Any) -> None:
    """Put one Megatron-LM argument into the config sections that read it (Megatron-LM passes the same namespace to
    TransformerConfig, OptimizerConfig and the DDP config)."""
    placed = False
    for section, cls in SECTIONS.items():
        if dest in cls.model_fields:
            raw.setdefault(section, {})[dest] = value
            placed = True
    if dest in RENAMED:
        raw.setdefault("model", {})[RENAMED[dest]] = value
        placed = True
    elif dest in _MODEL_EXTRAS or dest in table.transformer_fields():
        # Every argument named like a TransformerConfig field reaches megatron-core (--moe-* among them).
        raw.setdefault("model", {})[dest] = value
        placed = True
    if not placed:
        raw.setdefault("megatron_lm", {})[dest] = value


def _derive(raw: dict[str, Any], given: dict[str, Any]) -> None:
    """Megatron-LM's validate_args derivations that change what megatron-core sees (arguments.py, 0.19.2)."""
    model = raw.setdefault("model", {})
    if given.get("recompute_activations"):
        model["recompute_granularity"] = "selective"
    if (model.get("cpu_offloading_num_layers") or 0) > 0:
        model["cpu_offloading"] = True
    if given.get("use_distributed_optimizer"):
        raw.setdefault("ddp", {})["use_distributed_optimizer"] = True
    if "fp8_recipe" in given:
        model["fp8_recipe"] = given["fp8_recipe"]
    if "fp8_format" in given:
        model["fp8"] = given["fp8_format"]
    # gpt_builders: share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights
    model["share_embeddings_and_output_weights"] = not given.get("untie_embeddings_and_output_weights", False)
    if not given.get("group_query_attention"):
        model.pop("num_query_groups", None)  # used only with --group-query-attention
    vp_layers = given.get("num_layers_per_virtual_pipeline_stage")
    if vp_layers and model.get("num_layers") and model.get("pipeline_model_parallel_size", 1) > 1:
        model["virtual_pipeline_model_parallel_size"] = model["num_layers"] // (
            model["pipeline_model_parallel_size"] * vp_layers
        )
    _derive_moe(model)
    for key, default in MLM_CLI_DEFAULTS.items():
        section, _, name = key.partition(".")
        if name not in given:
            raw.setdefault(section, {})[name] = default


def _derive_moe(model: dict[str, Any]) -> None:
    """validate_args' MoE derivations (arguments.py "MoE Spec check" / "MoE router check", 0.19.2) and the
    ``moe_freq_type`` conversion its parser applies to ``--moe-layer-freq``."""
    if model.get("num_moe_experts") == 0:
        model["num_moe_experts"] = None
    experts = model.get("num_moe_experts") is not None
    if experts and model.get("moe_ffn_hidden_size") is None and model.get("ffn_hidden_size") is not None:
        model["moe_ffn_hidden_size"] = model["ffn_hidden_size"]
    for key in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        if isinstance(model.get(key), list) and len(model[key]) == 1:
            model[key] = model[key][0]
    freq = model.get("moe_layer_freq")
    if isinstance(freq, str):
        try:
            model["moe_layer_freq"] = layer_pattern(freq) if "[" in freq else int(freq)
        except (ValueError, TypeError, SyntaxError) as exc:
            raise ArgvError(f"argument --moe-layer-freq: invalid moe_freq_type value: {freq!r}") from exc


def layer_pattern(text: str) -> list[int]:
    """A layer pattern as ``moe_freq_type`` evaluates it (``"([0]+[1]*3)*2"`` → ``[0, 1, 1, 1, 0, 1, 1, 1]``), read
    without ``eval`` (ValueError for anything but int lists joined by ``+`` and repeated by ``*``).
    """
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Mult: operator.mul}

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not a layer pattern: {text!r}")

    result = value(ast.parse(text.strip(), mode="eval").body)
    if not isinstance(result, list):
        raise ValueError(f"not a layer pattern: {text!r}")
    return result


def parse_argv(argv: list[str]) -> dict[str, Any]:
    """Megatron-LM flags → a raw config dict with ``frontend: megatron-lm``; other given args go under ``megatron_lm``,
    unknown ones under ``unknown_arguments``. ArgvError where Megatron-LM's parser refuses a value.
    """
    namespace, unknown = parser().parse_known_args([a for a in argv if a])
    given = vars(namespace)
    raw: dict[str, Any] = {}
    for dest, value in given.items():
        _place(raw, dest, value)
    _derive(raw, given)
    # Values that are not flags (a script path, `torchrun` options before it) are not arguments of Megatron-LM.
    flags = [a for a in unknown if a.startswith("-")]
    if flags:
        raw["unknown_arguments"] = flags
    raw["megatron_lm_version"] = table.version()
    raw["frontend"] = "megatron-lm"
    return raw


def flags_by_key() -> dict[str, str]:
    """dotted config key → the Megatron-LM flag that sets it (for the parameter docs)."""
    flags: dict[str, str] = {}
    for options, dest, *_ in table.arguments():
        for section, cls in SECTIONS.items():
            if dest in cls.model_fields:
                flags.setdefault(f"{section}.{dest}", options[0])
    return flags
