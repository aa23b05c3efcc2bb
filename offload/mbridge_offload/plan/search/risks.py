"""What each option risks beyond its memory and step time, as one number the ranking grows the step time by.

The step-time model is first-order (``plan/time``), so two options a few per cent apart are a near-tie; the option
that risks less should then lead. ``risk`` adds, as a share of the step time:

- ``HOST_WEIGHT`` x the share of the host RAM cap its pinned buffers take (0 to 1: ``anchor.Plan.host_budget_gb``):
  a node near its cap swaps, or the data loader and checkpoint staging run out;
- ``CHANGE_WEIGHT`` per override beyond the first: every key is one more thing to get wrong in a launcher, and one
  more difference from the run the user measured;
- ``THIN_WEIGHT`` when less than the headroom stays free (``comfortable`` false): a predicted peak is a prediction;
- per lever, the known upstream problems below (``LEVER_RISKS``).

So an option with 8 overrides, a large host share, a thin margin and HDO's resume bugs is ranked behind a one-change
option unless it is predicted more than about 7 % faster. The weights are a judgement (stated in every answer's
``ranking``), not fitted. Never imports torch.
"""

from __future__ import annotations

HOST_WEIGHT = 0.03
CHANGE_WEIGHT = 0.005
THIN_WEIGHT = 0.01
FORMULA = (
    f"{HOST_WEIGHT:g} x host RAM share of the cap + {CHANGE_WEIGHT:g} per override beyond the first + "
    f"{THIN_WEIGHT:g} if less than the headroom stays free + each lever's known upstream risk"
)

RANKING_WORDS = (
    "allowed levers before alternatives; options that fit (with the margin) before those that do not; among those "
    "that fit, predicted step time x (1 + risk), risk = " + FORMULA + ", then fewer changes; among those that "
    "do not fit, the lowest peak first (option 0 is the recommendation: mode and overrides describe it)"
)

# lever -> (share of the step, why), the problems a user meets with it in the releases we follow.
LEVER_RISKS: dict[str, tuple[float, str]] = {
    "optimizer": (
        0.02,
        "HybridDeviceOptimizer resume bugs upstream: fp32 master copies not re-synced after a checkpoint load before "
        "Megatron Bridge 0.6.2 (Megatron-Bridge#3949, fixed by PR #4082), the step counter with the precision-aware "
        "optimizer (Megatron-LM#1842), a stale 'step' in DP-reshardable loads (Megatron-LM PR #5929)",
    ),
    "fine-grained": (
        0.01,
        "needs NVTE_CPU_OFFLOAD_V1=1 in the environment before Transformer Engine is imported (Bridge's env_vars do "
        "it; another launcher must export it)",
    ),
    "grad-reduce": (
        0.01,
        "changes numerics: each partial sum of the gradient reduction is rounded to bf16, which grows with the DP "
        "size (why Bridge recipes keep ddp.grad_reduce_in_fp32=True)",
    ),
    "ce-fusion": (
        0.005,
        "needs Transformer Engine's parallel cross entropy at run time (megatron-core raises 'Trying to use a TE "
        "block when it's not present' without it), and TE >= 2.7 under full-iteration CUDA graphs "
        "(LanguageModule.compute_language_model_loss, 0.16)",
    ),
    "expandable-segments": (
        0.01,
        "its gain is an assumption (no published run measures it); older NCCL/PyTorch pairs refused expandable "
        "segments with NCCL user-buffer registration",
    ),
    "vpp": (0.01, "changes the pipeline schedule and the checkpoint layout (a resume needs the same VPP or a reshard)"),
    "tp": (0.01, "changes the parallel layout: checkpoints reshard, throughput changes"),
    "cp": (0.01, "changes the parallel layout: checkpoints reshard, throughput changes"),
    "mbs": (0.01, "changes the micro-batch: the same global batch in more micro-batches"),
}


def risk(levers: list[str], n_overrides: int, host_share: float, comfortable: bool) -> tuple[float, list[str]]:
    """The option's risk as a share of its step time, and each part in words.

    Args:
        levers: the levers it pulls (``levers.used``).
        n_overrides: the overrides it writes.
        host_share: its host memory per GPU over the cap per GPU (0 = none).
        comfortable: at least the headroom stays free.

    Returns:
        (risk, reasons): ``step_time_s * (1 + risk)`` is what the ranking compares.
    """
    score, why = 0.0, []
    if host_share > 0:
        score += HOST_WEIGHT * min(host_share, 1.0)
        why.append(f"takes {host_share:.0%} of the host RAM cap")
    if n_overrides > 1:
        score += CHANGE_WEIGHT * (n_overrides - 1)
        why.append(f"{n_overrides} overrides")
    if not comfortable:
        score += THIN_WEIGHT
        why.append("less than the headroom stays free")
    for lever in levers:
        if lever in LEVER_RISKS:
            weight, text = LEVER_RISKS[lever]
            score += weight
            why.append(f"{lever}: {text}")
    return score, why


def render_table() -> str:
    """The levers, what each writes, whether the default allows it, and its known risk (docs/planner.md)."""
    from mbridge_offload.plan.inputs.fields import DEFAULT_LEVERS, LEVERS
    from mbridge_offload.plan.search.levers import WRITES

    rows = [
        "| lever | default | writes | known risk (ranking weight) |",
        "|---|---|---|---|",
    ]
    for lever in LEVERS:
        weight, why = LEVER_RISKS.get(lever, (0.0, "none known"))
        rows.append(
            f"| `{lever}` | {'yes' if lever in DEFAULT_LEVERS else 'alternative'} | {WRITES[lever]} | "
            f"{why} ({weight:g}) |"
        )
    return "\n".join(rows) + f"\n\nRanking: {RANKING_WORDS}.\n"
