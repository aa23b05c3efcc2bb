"""The known offload failure modes diagnose matches logs against, from the upstream skill's failure table and
``docs/cpu-offloading.md``. Upstream error *messages* are matched from the rule catalogue; an entry that also
explains one says which in :data:`EXPLAINS_RULES`.
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
