"""mbridge_offload.actions.apply.yaml_edit: only the changed keys' lines change; unusual layouts are left to the
fallback."""

from __future__ import annotations

import pytest

from mbridge_offload.actions.apply.yaml_edit import line_edit, scalar
from mbridge_offload.config.sources import parse_text


def _parse(text: str) -> dict:
    return parse_text(text, "<edit>")[0]


def _edit(text: str, changes, neighbours=None):
    return line_edit(text, changes, neighbours or {}, _parse)


def test_a_new_key_goes_after_its_neighbour_and_its_nested_list() -> None:
    text = "model:\n  a: 1\n  mods:\n  - x\n  - y\n\n  # note\n  b: 2\noptimizer:\n  lr: 1\n"
    out = _edit(text, [("model.k", 2), ("model.z", True)], {"model.z": "mods"})
    assert out == "model:\n  a: 1\n  mods:\n  - x\n  - y\n  z: true\n\n  # note\n  b: 2\n  k: 2\noptimizer:\n  lr: 1\n"


def test_a_changed_value_keeps_its_comment_and_the_other_lines_their_bytes() -> None:
    text = "model:\n  flag: False\n  empty:\n  impl: 'local'   # why\n  n: 4\n"
    out = _edit(text, [("model.impl", "none"), ("model.n", 8)])
    assert out == "model:\n  flag: False\n  empty:\n  impl: none   # why\n  n: 8\n"


def test_crlf_empty_and_comment_only_files() -> None:
    assert _edit("model:\r\n  n: 4\r\n", [("model.m", 1)]) == "model:\r\n  n: 4\r\n  m: 1\r\n"
    assert _edit("", [("optimizer.x", 0.5)]) == "optimizer:\n  x: 0.5\n"
    assert _edit("# hi", [("model.x", None)]) == "# hi\nmodel:\n  x: null\n"
    assert _edit("model:\n", [("model.x", 1)]) == "model:\n  x: 1\n"


@pytest.mark.parametrize(
    "text",
    [
        "model: {n: 4}\n",  # flow section
        "model:\n  n: 4\nmodel:\n  m: 1\n",  # duplicated section (the parser refuses it too)
        "model:\n  n: &a 4\n",  # an anchor on the value
        "model:\n  n:\n    deep: 1\n",  # a nested block where a scalar goes
    ],
)
def test_layouts_it_cannot_edit_line_by_line_return_none(text: str) -> None:
    assert _edit(text, [("model.n", 8)]) is None


@pytest.mark.parametrize("value", [None, True, False, 0, 0.5, 1e-5, "none", "full", "null", "yes", "a b", "1.0", ""])
def test_scalars_read_back_as_the_same_value(value) -> None:
    assert _parse(f"model:\n  k: {scalar(value)}\n")["model"]["k"] == value
