"""Which micro-batches a pipeline rank holds activations for, model chunk by model chunk, at each peak moment.

Read from megatron-core 0.16.1 and 0.19.2 ``pipeline_parallel/schedules.py`` (identical there):

- ``get_pp_rank_microbatches``: rank ``r`` of ``PP`` runs ``PP − r − 1`` warm-up forwards without interleaving;
  with ``VPP`` model chunks ``2·(PP − r − 1) + (VPP − 1)·g`` (``g`` = ``microbatch_group_size_per_vp_stage``, which
  ``ModelParallelConfig`` sets to PP when unset), capped by the step's ``M·VPP`` chunk forwards.
- ``get_schedule_table``: forwards run in groups of ``g`` micro-batches, chunk by chunk inside a group (the last
  group takes every micro-batch left, so it can hold up to ``2g − 1``).
- ``forward_backward_pipelining_with_interleaving``: backward number ``j`` runs chunk ``VPP − 1 − chunk(j)``, and
  each steady 1F1B step runs forward ``k + warm-up`` before backward ``k``; a chunk's micro-batches are released
  in order. So the peak moments are just after each steady forward: forwards ``0..f`` done, backwards ``0..f − W − 1``
  done. With every forward in the warm-up (``M·VPP ≤ W``) all of them are in flight before the first backward.
- ``forward_backward_no_pipelining`` (PP = 1): one micro-batch at a time.

``inflight_vectors`` returns the distinct per-chunk counts over those moments; a stage's saved activations peak at
the largest ``Σ count[c] · bytes[c]``. Not modelled: ``overlap_moe_expert_parallel_comm`` (one more warm-up forward)
and a ``microbatch_group_size_per_vp_stage`` other than PP. Never imports torch.
"""

from __future__ import annotations

import functools

__all__ = ["inflight_vectors", "warmup_microbatches"]


def warmup_microbatches(pp: int, vpp: int | None, rank: int, microbatches: int, group: int | None = None) -> int:
    """megatron-core's warm-up count for ``rank`` (chunk forwards before the first backward), capped at the total."""
    chunks = vpp or 1
    total = microbatches * chunks
    if pp == 1:
        return 0
    # Interleaved: every rank runs (VPP − 1)·g chunk forwards, then more the earlier it sits in the pipeline.
    warmup = pp - rank - 1 if vpp is None else 2 * (pp - rank - 1) + (chunks - 1) * (group or pp)
    return min(warmup, total)


def _last_group(microbatches: int, group: int) -> tuple[int, int]:
    """(first micro-batch, size) of the schedule table's last group: every group before it holds ``g``, the last
    one takes all that is left once fewer than ``2g`` remain (``get_schedule_table``)."""
    start = max(0, -(-(microbatches - group) // group)) * group  # the first multiple of g with start + g >= M
    return start, microbatches - start


def _prefix(microbatches: int, group: int, chunks: int, n: int) -> list[int]:
    """Per chunk, how many of the schedule table's first ``n`` entries run it."""
    last_start, last_size = _last_group(microbatches, group)
    full = min(n // (group * chunks), last_start // group)
    n -= full * group * chunks
    size = group if full < last_start // group else last_size
    return [full * group + min(size, max(0, n - c * size)) for c in range(chunks)]


@functools.lru_cache(maxsize=4096)
def inflight_vectors(
    pp: int, vpp: int | None, microbatches: int | None, rank: int, group: int | None = None
) -> tuple[tuple[int, ...], ...]:
    """The distinct per-chunk counts of micro-batches whose activations pipeline rank ``rank`` holds at each moment
    its saved activations can peak (see the module docstring).

    Args:
        pp, vpp: pipeline size and model chunks per rank (None: no interleaving).
        microbatches: micro-batches per step per data-parallel rank; None: a long step (the steady state).
        rank: the pipeline rank.
        group: ``microbatch_group_size_per_vp_stage`` (None: PP, megatron-core's default).

    Returns:
        Tuples of length ``vpp or 1``: entry ``c`` is the number of micro-batches in flight through chunk ``c``.

    Example:
        >>> inflight_vectors(4, None, 8, 0)  # 1F1B, first stage: PP micro-batches
        ((4,),)
        >>> inflight_vectors(2, 2, 8, 0)  # interleaved: 2·(PP−1) + (VPP−1)·PP + 1 = 5 chunk forwards
        ((4, 1), (3, 2))
    """
    chunks, g = vpp or 1, group or pp
    if pp == 1:
        return ((1,) * chunks,)
    if microbatches is None:
        # A step long enough for every steady-state moment to occur (two full schedule periods after warm-up).
        microbatches = g * (chunks + 3)
    total = microbatches * chunks
    warmup = warmup_microbatches(pp, vpp, rank, microbatches, g)
    if warmup >= total:
        return ((microbatches,) * chunks,)
    if vpp is None:
        return ((warmup + 1,),)
    steady = total - warmup
    last_base = _last_group(microbatches, g)[0] * chunks
    # Inside the full groups the counts repeat every g·VPP steps; the last (larger) group is walked in full.
    moments = set(range(min(steady, g * chunks))) | set(range(max(0, last_base - warmup), steady))
    seen: set[tuple[int, ...]] = set()
    for b in sorted(moments):
        forwards = _prefix(microbatches, g, chunks, b + warmup + 1)
        backwards = _prefix(microbatches, g, chunks, b)
        seen.add(tuple(forwards[c] - backwards[chunks - 1 - c] for c in range(chunks)))
    return tuple(sorted(seen, reverse=True))
