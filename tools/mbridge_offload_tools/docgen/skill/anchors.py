"""Code anchors: where upstream implements each offload check, as file:line per released version.

Each line was read in the released package; ``tests/tools/test_docs.py`` re-reads it in whichever is installed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Anchor:
    """One line of upstream code."""

    what: str  # what the line does, in a few words
    package: str  # the distribution: megatron-core or megatron-bridge
    version: str  # the release the line number is for
    path: str  # the file inside the installed package
    line: int  # 1-based
    needle: str  # text on that line (the tests check it)


_CFG = "megatron/core/transformer/transformer_config.py"
_OPT_INIT = "megatron/core/optimizer/__init__.py"
_OPT_CFG = "megatron/core/optimizer/optimizer_config.py"
_TE = "megatron/core/extensions/transformer_engine.py"
_BLOCK = "megatron/core/transformer/transformer_block.py"
_HYBRID = "megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py"
_PEFT = "megatron/bridge/peft/utils.py"
_SPEC = "megatron/bridge/models/gpt_full_te_layer_autocast_spec.py"

_MC16, _MC19, _MB = ("megatron-core", "0.16.1"), ("megatron-core", "0.19.2"), ("megatron-bridge", "0.3.1")
_PP = "Currently there is no support for Pipeline parallelism with CPU offloading"
_RECOMPUTE = "CPU offloading does not work when activation recomputation is enabled"
_FINE = "fine_grained_activation_offloading cannot be enabled with cpu_offloading"
_GRAPHS = "CUDA graphs not supported with CPU offloading"

ANCHORS: tuple[Anchor, ...] = (
    # megatron-core 0.16.1
    Anchor("activation offload refuses PP > 1", *_MC16, _CFG, 1146, _PP),
    Anchor("activation offload refuses recompute", *_MC16, _CFG, 1151, _RECOMPUTE),
    Anchor("layer-level vs fine-grained offload", *_MC16, _CFG, 1271, _FINE),
    Anchor("activation offload refuses CUDA graphs", *_MC16, _CFG, 1723, _GRAPHS),
    Anchor("optimizer offload switch", *_MC16, _OPT_CFG, 304, "optimizer_cpu_offload: bool = False"),
    Anchor("offload fraction default 0.0", *_MC16, _OPT_CFG, 307, "optimizer_offload_fraction"),
    Anchor("HybridDeviceOptimizer built", *_MC16, _OPT_INIT, 336, "HybridDeviceOptimizer("),
    Anchor("HybridDeviceOptimizer class", *_MC16, _HYBRID, 14, "class HybridDeviceOptimizer"),
    Anchor("TE offload context wrapper", *_MC16, _TE, 2302, "def get_cpu_offload_context("),
    Anchor("offload context per block", *_MC16, _BLOCK, 305, "get_cpu_offload_context("),
    # megatron-core 0.19.2
    Anchor("activation offload refuses PP > 1", *_MC19, _CFG, 1716, _PP),
    Anchor("activation offload refuses recompute", *_MC19, _CFG, 1721, _RECOMPUTE),
    Anchor("layer-level vs fine-grained offload", *_MC19, _CFG, 1851, _FINE),
    Anchor("paged stash vs activation offload", *_MC19, _CFG, 1906, "moe_paged_stash cannot be"),
    Anchor(
        "CUDA graphs refused except full_iteration",
        *_MC19,
        _CFG,
        2467,
        'self.cpu_offloading and self.cuda_graph_impl != "full_iteration"',
    ),
    Anchor("optimizer offload switch", *_MC19, _OPT_CFG, 344, "optimizer_cpu_offload: bool = False"),
    Anchor("offload fraction default 0.0", *_MC19, _OPT_CFG, 347, "optimizer_offload_fraction"),
    Anchor("HybridDeviceOptimizer built", *_MC19, _OPT_INIT, 532, "HybridDeviceOptimizer("),
    Anchor("HybridDeviceOptimizer class", *_MC19, _HYBRID, 14, "class HybridDeviceOptimizer"),
    Anchor("TE offload context wrapper", *_MC19, _TE, 3331, "def get_cpu_offload_context("),
    Anchor("offload context per block", *_MC19, _BLOCK, 300, "get_cpu_offload_context("),
    # Megatron Bridge 0.3.1
    Anchor(
        "LoRA adapter marks its input for offload",
        *_MB,
        _PEFT,
        623,
        "self.config.cpu_offloading and self.config.cpu_offloading_activations",
    ),
    Anchor("LoRA adapter marks its hidden activation", *_MB, _PEFT, 630, "x.activation_offloading = True"),
    Anchor("local CUDA-graph layer asserts no offload", *_MB, _SPEC, 234, "assert not config.cpu_offloading"),
)


def render_anchors() -> str:
    """The anchor table of references/code-anchors.md, grouped by package and version."""
    lines = ["| package | version | file:line | what | text on the line |", "|---|---|---|---|---|"]
    for a in ANCHORS:
        needle = a.needle.replace("|", "\\|")
        lines.append(f"| {a.package} | {a.version} | `{a.path}:{a.line}` | {a.what} | `{needle}` |")
    return "\n".join(lines)
