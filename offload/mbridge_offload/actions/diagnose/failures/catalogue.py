"""The catalogue of known offload failure modes that ``mbridge_offload.actions.diagnose.diagnose`` matches logs against.

Each :class:`FailureMode` is data: the patterns that recognise it in an error or log, the cause, how to confirm
it, and the fix as overrides (or a function of the config that computes them), plus other actions and the
upstream issues that report it. Sources: the upstream skill's failure table and the user problems collected in
``docs/cpu-offloading.md``. The upstream error *messages* are matched from the rule catalogue (``config/rules/``);
the entries here that also explain one of those say which in :data:`EXPLAINS_RULES`.

Plain Python: no torch.
"""

from __future__ import annotations

from mbridge_offload.actions.diagnose.failures.activation import ACTIVATION
from mbridge_offload.actions.diagnose.failures.base import FailureMode
from mbridge_offload.actions.diagnose.failures.checkpoint import CHECKPOINT
from mbridge_offload.actions.diagnose.failures.memory import MEMORY
from mbridge_offload.actions.diagnose.failures.optimizer import OPTIMIZER

# Every known failure mode, family by family (the order diagnose lists equally good matches in).
KNOWN: tuple[FailureMode, ...] = (*ACTIVATION, *OPTIMIZER, *MEMORY, *CHECKPOINT)


# Known entries that explain a catalogue rule's message (with a confirm step the rule does not have).
EXPLAINS_RULES: dict[str, tuple[str, ...]] = {
    "pp_constraint": ("ACT-PP",),
    "recompute_constraint": ("ACT-RECOMPUTE",),
    "fine_grained_constraint": ("ACT-FINE-GRAINED",),
    "cuda_graph_constraint": ("ACT-CUDA-GRAPH", "ACT-BRIDGE-CUDAGRAPH-ASSERT"),
    "layer_range": ("ACT-NUM-LAYERS",),
    "te_nothing_to_offload": ("ACT-NOTHING-TO-OFFLOAD",),
    "decoupled_weight_decay": ("OPT-DECOUPLED-WD",),
    "precision_aware_required": ("OPT-MLM-PRECISION-AWARE",),
    "mfsdp_v2": ("OPT-MFSDP-V2", "OPT-BRIDGE-MFSDP-V2"),
    "skip_megatron_wrapping": ("OPT-SKIP-WRAPPING",),
}
