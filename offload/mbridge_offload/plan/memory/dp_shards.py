"""The distributed optimizer's shards, rank by rank, as megatron-core lays them out (0.16.1 and 0.19.2).

HybridDeviceOptimizer offloads whole tensors, greedily, in its parameter-group order (``stage.greedy_offload``).
Under the distributed optimizer the tensors it is given are one rank's shards of the DDP buffers, not every
parameter split evenly: a rank may own a slice of one large tensor (an output layer) where another owns forty small
ones, and the split's granularity, hence what stays on each GPU, differs from rank to rank. So the planner lays the
buffers out as megatron-core does and answers for the GPU that keeps the most:

- **Buffers** (``param_and_grad_buffer.py`` in 0.16.1, ``DistributedOptimizer._compute_per_buffer_param_layout`` in
  0.19.2): each model chunk has its own DDP and a buffer for its dense and one for its expert parameters. Parameters
  go in reverse ``named_parameters`` order; each starts at a multiple of 64 elements; a bucket closes once it holds
  ``bucket_size`` elements, and a shared embedding (tied weights with PP > 1: ``shared_embedding``) gets a bucket of
  its own; each bucket's end is padded to a multiple of ``lcm(DP, 128)``.
- **Bucket size** (``distributed_data_parallel.py``): ``max(4e7, 1e6·DP·CP)`` elements with ``overlap_grad_reduce``,
  but one bucket on every pipeline stage after the first and on every model chunk after the first (Bridge and
  Megatron-LM pass ``disable_bucketing`` for them), and one bucket without ``overlap_grad_reduce``.
- **Ownership** (``_build_gbuf_range_map``): rank ``r`` of the group owns ``[start + r·n/DP, start + (r+1)·n/DP)`` of
  each bucket of ``n`` elements; its shard of a parameter is the overlap.
- **Order** (``_get_param_groups``, ``_build_optimizer_group_ranges``): the parameter groups are sorted with the
  default group (weight decay) first and the no-decay overrides (biases and 1-D parameters) after; within a group
  the shards come chunk by chunk in buffer order.
- **Which GPU**: GPU ``i`` of a pipeline stage (TP fastest, then CP, then DP: megatron-core's default rank order) is
  rank ``i // TP`` of the dense DP·CP group and rank ``i // (ETP·EP)`` of the expert data-parallel group.

Never imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mbridge_offload.plan.model.params import Tensor

PARAM_ALIGN = 64  # elements: 128-byte aligned starts for 16-bit parameters
BUCKET_ALIGN = 128  # elements: 256-byte aligned bucket ends, times DP


def bucket_size(dp_cp: int, overlap_grad_reduce: bool, stage: int, chunk: int) -> int | None:
    """Elements per bucket of one model chunk's buffers; None for one bucket (module docstring)."""
    if not overlap_grad_reduce or stage > 0 or chunk > 0:
        return None
    return max(40_000_000, 1_000_000 * dp_cp)


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def layout(numels: Sequence[int], dp: int, size: int | None, shared: Sequence[bool]) -> tuple[list[int], list[int]]:
    """Each parameter's start in the buffer (indexed in model order) and the bucket boundaries ``[0, e1, e2, ...]``."""
    divisor = math.lcm(dp, BUCKET_ALIGN)
    starts = [0] * len(numels)
    bounds = [0]
    start = end = 0
    open_params = 0
    for i in reversed(range(len(numels))):
        start = _pad(start, PARAM_ALIGN)
        if shared[i] and open_params:  # a shared embedding opens a bucket of its own
            bounds.append(_pad(start, divisor))
            start, open_params = bounds[-1], 0
        starts[i], end = start, start + numels[i]
        open_params += 1
        if (size is not None and end - bounds[-1] >= size) or shared[i]:
            bounds.append(_pad(end, divisor))
            start, open_params = bounds[-1], 0
        else:
            start = end
    if open_params:
        bounds.append(_pad(end, divisor))
    return starts, bounds


def owned(numels: Sequence[int], starts: Sequence[int], bounds: Sequence[int], dp: int) -> list[dict[int, int]]:
    """For each rank of the group: parameter index (model order) → elements of it the rank owns, in buffer order.
    Each parameter visits only the ranks its range crosses (buffers of large models hold tens of thousands)."""
    out: list[dict[int, int]] = [{} for _ in range(dp)]
    b = 0
    for i in sorted(range(len(numels)), key=starts.__getitem__):
        lo, hi = starts[i], starts[i] + numels[i]
        while bounds[b + 1] <= lo:
            b += 1
        part = (bounds[b + 1] - bounds[b]) // dp
        for r in range((lo - bounds[b]) // part, (hi - 1 - bounds[b]) // part + 1):
            first = bounds[b] + r * part
            out[r][i] = min(hi, first + part) - max(lo, first)
    return out


def rank_shards(
    chunks: Sequence[Sequence[Tensor]],
    expert: bool,
    dp: int,
    sizes: Sequence[int | None],
    shared: Sequence[Sequence[bool]],
) -> list[list[int]]:
    """For each rank of the group that shards ``expert`` (or dense) parameters: the elements of each of its shards, in
    HybridDeviceOptimizer's order (module docstring). ``sizes``: each chunk's bucket size; ``shared``: which of each
    chunk's parameters is a shared embedding."""
    # owned() lists each rank's shards in buffer order: appended chunk by chunk into the two groups, they are in
    # HDO's order without a sort
    decay: list[list[int]] = [[] for _ in range(dp)]
    no_decay: list[list[int]] = [[] for _ in range(dp)]
    for params, size, flags in zip(chunks, sizes, shared, strict=True):
        picked = [(t, f) for t, f in zip(params, flags, strict=True) if t.expert == expert]
        if not picked:
            continue
        numels = [t.numel for t, _ in picked]
        starts, bounds = layout(numels, dp, size, [f for _, f in picked])
        for r, shards in enumerate(owned(numels, starts, bounds, dp)):
            for j, n in shards.items():
                (decay if picked[j][0].decay else no_decay)[r].append(n)
    return [d + n for d, n in zip(decay, no_decay, strict=True)]


def gpu_ranks(tp: int, cp: int, dp: int, ep: int, etp: int) -> list[tuple[int, int]]:
    """(dense DP·CP rank, expert DP rank) of each GPU of a pipeline stage, in rank order (module docstring)."""
    return [(i // tp, i // (etp * ep)) for i in range(tp * cp * dp)]
