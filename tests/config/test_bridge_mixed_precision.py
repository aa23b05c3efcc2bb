"""Bridge's ``mixed_precision`` as exact mode applies it, against Megatron Bridge 0.6.2's own source.

Differential, read from ``.bridge/0.6.2/megatron/bridge/training/mixed_precision.py`` (``make bridge-env``) without
importing it (Bridge needs torch, megatron-core 0.19.2 and a TE stub to import; the source's literals are enough):
the ``MixedPrecisionConfig`` fields and their defaults, and every registered recipe's values, are ours exactly.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from mbridge_offload.config import bridge

SOURCE = Path(__file__).resolve().parents[2] / ".bridge/0.6.2/megatron/bridge/training/mixed_precision.py"
pytestmark = pytest.mark.skipif(not SOURCE.is_file(), reason="make bridge-env installs Megatron Bridge 0.6.2")
_DTYPES = {"bfloat16": "torch.bfloat16", "half": "torch.float16", "float16": "torch.float16"}


def _literal(node: ast.expr) -> Any:
    """A default or recipe value: torch dtypes in the YAML form Bridge's to_yaml writes, else the Python literal."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
        return {"_target_": _DTYPES[node.attr], "_call_": False}
    return ast.literal_eval(node)


def _upstream() -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    tree = ast.parse(SOURCE.read_text())
    defaults: dict[str, Any] = {}
    recipes: dict[str, dict[str, Any]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "MixedPrecisionConfig":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
                    defaults[item.target.id] = _literal(item.value)
        registered = isinstance(node, ast.FunctionDef) and any(
            isinstance(d, ast.Name) and d.id == "register" for d in node.decorator_list
        )
        if registered and isinstance(node, ast.FunctionDef):
            recipes[node.name] = _recipe(node, recipes)
    return defaults, recipes


def _recipe(fn: ast.FunctionDef, known: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The fields a recipe sets: ``return MixedPrecisionConfig(k=v, ...)``, or ``cfg = other(); cfg.k = v; ...``."""
    values: dict[str, Any] = {}
    for stmt in fn.body:
        if isinstance(stmt, ast.Return) and isinstance(stmt.value, ast.Call) and stmt.value.keywords:
            values.update({k.arg: _literal(k.value) for k in stmt.value.keywords if k.arg})
        elif isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call):
            base = stmt.value.func
            assert isinstance(base, ast.Name) and base.id in known, ast.dump(stmt)
            values.update(known[base.id])
        elif isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Attribute):
            values[stmt.targets[0].attr] = _literal(stmt.value)
    return values


def _resolved(values: dict[str, Any]) -> dict[str, Any]:
    return {**bridge.MIXED_PRECISION_DEFAULTS, **values}


def test_the_fields_and_defaults_are_bridges():
    defaults, _ = _upstream()
    assert len(defaults) > 25
    assert defaults == bridge.MIXED_PRECISION_DEFAULTS


def test_every_registered_recipe_sets_what_bridges_sets():
    defaults, recipes = _upstream()
    assert len(recipes) >= 15 and set(bridge.MIXED_PRECISION_RECIPES) == set(recipes)
    for name, values in recipes.items():
        # Compared resolved over the defaults: a recipe that sets a field to its default value is the same recipe.
        assert _resolved(bridge.MIXED_PRECISION_RECIPES[name]) == {**defaults, **values}, name
