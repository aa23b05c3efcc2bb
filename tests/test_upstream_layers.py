"""The table of what each offload and recompute setting does per model class, checked against megatron-core itself.

Three layers of checks, each on both installed releases (0.16.1 in the venv, 0.19.2 in ``.mcore/0.19.2``):

- every cited line: the file exists, the line holds the quoted text, it lies inside the named class or function,
  and a "no effect" that rests on what a class never does finds none of those texts in the class's source;
- the decisive facts, read from the AST and compared with the verdicts: ``TransformerBlock`` calls
  ``get_cpu_offload_context`` and enters the context, the hybrid stacks never do; ``HybridStack`` checkpoints under
  full recompute, ``MambaStack`` never does; ``MambaModel`` never opens a fine-grained chunk, ``HybridModel`` and
  ``GPTModel`` do; an MTP layer never enters its offload context; the modules upstream accepts are the table's rows;
- a differential run of real megatron-core on CPU (``tests/support/mcore_layer_reach.py``): the block and the hybrid
  stack built from the same layers, with our offload runtime in Transformer Engine's place.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mbridge_offload import upstream_layers as ul
from mbridge_offload import upstream_sites as us
from tests.support import tree
from tests.support.tree import ROOT

VENV_MCORE = Path(importlib.metadata.distribution("megatron-core").locate_file(""))
NEW = ROOT / ".mcore" / "0.19.2"
ROOTS = {"0.16.1": VENV_MCORE, "0.19.2": NEW}
RELEASES = [
    pytest.param("0.16.1", id="0.16.1"),
    pytest.param(
        "0.19.2", id="0.19.2", marks=pytest.mark.skipif(not (NEW / "megatron/core").is_dir(), reason="make setup")
    ),
]


@functools.cache
def _tree(release: str, path: str) -> tuple[ast.Module, list[str]]:
    text = (ROOTS[release] / path).read_text(encoding="utf-8")
    return ast.parse(text), text.splitlines()


def _symbol(release: str, path: str, dotted: str) -> ast.AST:
    """The class, function, method or module-level assignment ``dotted`` names in ``path``."""
    node: ast.AST = _tree(release, path)[0]
    for part in dotted.split("."):
        found = None
        for child in ast.iter_child_nodes(node):
            named = isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and child.name == part
            assigned = isinstance(child, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == part for t in child.targets
            )
            if named or assigned:
                found = child
        assert found is not None, f"megatron-core {release} {path}: no {dotted}"
        node = found
    return node


def _source(release: str, path: str, node: ast.AST) -> str:
    lines = _tree(release, path)[1]
    return "\n".join(lines[node.lineno - 1 : node.end_lineno])  # type: ignore[attr-defined]


def _all_sites() -> list[us.Site]:
    evidence = {id(c.evidence): c.evidence for c in ul.CELLS}
    return sorted({s for e in evidence.values() for s in e.sites}, key=lambda s: (s.release, s.path, s.line))


# ---------------------------------------------------------------------------------------------- the table's shape


def test_every_setting_has_one_cell_per_layer_and_release():
    keys = [(c.setting, c.layer, c.release) for c in ul.CELLS]
    assert len(keys) == len(set(keys)) == len(ul.SETTINGS) * len(ul.LAYERS) * len(us.RELEASES)
    assert {c.verdict for c in ul.CELLS} == set(ul.VERDICTS)


def test_every_cell_cites_a_line_of_its_own_release():
    for c in ul.CELLS:
        assert c.site.release == c.release, (c.setting, c.layer, c.release)


# ---------------------------------------------------------------------------------------------- every cited line


@pytest.mark.parametrize("release", RELEASES)
def test_every_cited_line_holds_its_text_inside_its_symbol(release):
    sites = [s for s in _all_sites() if s.release == release]
    assert len(sites) > 40
    wrong = []
    for s in sites:
        node = _symbol(release, s.path, s.symbol)
        lines = _tree(release, s.path)[1]
        if s.needle not in lines[s.line - 1]:
            wrong.append(f"{s.where}: lacks {s.needle!r}")
        if not node.lineno <= s.line <= node.end_lineno:  # type: ignore[attr-defined]
            wrong.append(f"{s.where}: outside {s.symbol}")
        source = _source(release, s.path, node)
        wrong += [f"{s.where}: {s.symbol} contains {a!r}" for a in s.absent if a in source]
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------------------------------------- decisive facts


def _calls(node: ast.AST) -> set[str]:
    """Names of everything ``node`` calls (``f(...)`` and ``x.f(...)`` both give ``f``)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            out.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return out


def _entered(node: ast.AST) -> set[str]:
    """Attribute names ``node`` enters with ``with self.<name>``."""
    return {
        item.context_expr.attr
        for n in ast.walk(node)
        if isinstance(n, ast.With)
        for item in n.items
        if isinstance(item.context_expr, ast.Attribute)
    }


def _stack(release: str) -> ast.AST:
    name, path = us.STACK_CLASS[release]
    return _symbol(release, path, name)


@pytest.mark.parametrize("release", RELEASES)
def test_only_the_transformer_block_opens_the_layer_level_offload_context(release):
    block_init = _symbol(release, us.BLOCK, "TransformerBlock.__init__")
    block_forward = _symbol(release, us.BLOCK, "TransformerBlock.forward")
    assert "get_cpu_offload_context" in _calls(block_init) and "offload_context" in _entered(block_forward)
    assert ul.applies("cpu_offloading", "block", release)
    stack = _stack(release)
    opens = "get_cpu_offload_context" in _calls(stack) or "offload_context" in _entered(stack)
    assert not opens
    assert ul.cell("cpu_offloading", "hybrid", release).verdict == "no effect"
    assert ul.cell("cpu_offloading", "mamba", release).verdict == "no effect"
    mtp = _symbol(release, us.MTP, "MultiTokenPredictionLayer")
    assert "offload_context" not in _entered(mtp) and "get_cpu_offload_context" not in _calls(mtp)
    assert ul.cell("cpu_offloading", "mtp", release).verdict == "no effect"


@pytest.mark.parametrize("release", RELEASES)
def test_full_recompute_reaches_the_hybrid_stack_only_where_it_checkpoints(release):
    stack = _stack(release)
    checkpoints = bool({"checkpointed_forward", "checkpoint", "_checkpointed_forward"} & _calls(stack))
    for method in ("uniform", "block"):
        assert ul.applies(f"recompute:full-{method}", "hybrid", release) is checkpoints
        assert ul.applies(f"recompute:full-{method}", "mamba", release) is checkpoints
        assert ul.applies(f"recompute:full-{method}", "block", release)
    assert checkpoints is (release == "0.19.2")


@pytest.mark.parametrize("release", RELEASES)
def test_fine_grained_offload_reaches_a_model_only_where_it_opens_a_chunk(release):
    gpt = _symbol(release, us.GPT_MODEL, "GPTModel")
    assert "init_chunk_handler" in _calls(gpt) and ul.applies("offload_modules:core_attn", "block", release)
    path, name = (us.MAMBA_MODEL, "MambaModel") if release == "0.16.1" else (us.HYBRID_MODEL, "HybridModel")
    opens = "init_chunk_handler" in _calls(_symbol(release, path, name))
    for module in ("qkv_linear", "core_attn", "attn_proj", "expert_fc1", "moe_act", "mlp_norm", "attn_norm"):
        assert ul.applies(f"offload_modules:{module}", "hybrid", release) is opens
    assert opens is (release == "0.19.2")


def _allowed(release: str, flag: str) -> set[str]:
    """The ``allowed_modules`` set that ``TransformerConfig.__post_init__`` checks under the innermost ``if`` on
    ``flag`` (``fine_grained_activation_offloading`` or ``recompute_granularity``)."""
    post_init = _symbol(release, us.CONFIG, "TransformerConfig.__post_init__")
    found = [
        (n.end_lineno - n.lineno, a)  # type: ignore[operator]
        for n in ast.walk(post_init)
        if isinstance(n, ast.If) and flag in ast.unparse(n.test)
        for a in ast.walk(n)
        if isinstance(a, ast.Assign) and ast.unparse(a.targets[0]) == "allowed_modules"
    ]
    assert found, f"no allowed_modules under a check of {flag}"
    return {e.value for e in min(found, key=lambda f: f[0])[1].value.elts}  # type: ignore[attr-defined]


@pytest.mark.parametrize("release", RELEASES)
def test_the_rows_are_the_modules_upstream_accepts(release):
    rows = {s.key for s in ul.SETTINGS}
    offload = _allowed(release, "fine_grained_activation_offloading")
    assert {f"offload_modules:{m}" for m in offload} <= rows
    for key in (r for r in rows if r.startswith("offload_modules:")):
        refused = key.split(":")[1] not in offload
        assert all((ul.cell(key, lay.key, release).verdict == "refused") is refused for lay in ul.LAYERS), key
    recompute = _allowed(release, "recompute_granularity")
    # gdn_norm_out (0.19.2) is read only by the gated-delta-net layer, which is no column of the table.
    assert {f"recompute_modules:{m}" for m in recompute - {"gdn_norm_out"}} == {
        r for r in rows if r.startswith("recompute_modules:")
    }


@pytest.mark.parametrize("release", RELEASES)
def test_the_mamba_mixer_reads_no_offload_or_recompute_module(release):
    for path, name in ((us._C + "ssm/mamba_mixer.py", "MambaMixer"), (us._C + "ssm/mamba_layer.py", "MambaLayer")):
        source = _source(release, path, _symbol(release, path, name))
        assert "offload_modules" not in source and "recompute_modules" not in source
    module_rows = [s.key for s in ul.SETTINGS if s.key.startswith(("offload_modules:", "recompute_modules:"))]
    assert all(ul.cell(k, "mamba", release).verdict != "applies" for k in module_rows)


# ---------------------------------------------------------------------------------------------- real megatron-core


def _reach(release: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree.pythonpath())
    if release == "0.19.2":
        env["PYTHONPATH"] = os.pathsep.join([str(NEW), env["PYTHONPATH"]])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests/support/mcore_layer_reach.py")],
        capture_output=True, text=True, timeout=400, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.parametrize("release", RELEASES)
def test_real_megatron_core_does_what_the_table_says(release):
    """The block and the hybrid stack, built from the same layers: offload and full recompute as the table says."""
    got = _reach(release)
    assert got["version"].startswith(release)
    for layer in ("block", "hybrid"):
        offloads = got[layer]["offload"]["calls"] > 0 and got[layer]["offload"]["bytes"] > 0
        assert offloads is ul.applies("cpu_offloading", layer, release), (layer, got[layer])
        for method, n in got[layer]["full_checkpoints"].items():
            assert (n > 0) is ul.applies(f"recompute:full-{method}", layer, release), (layer, method, n)
    assert got["hybrid"]["offload"]["calls"] == 0  # the stack never even asks for a context
