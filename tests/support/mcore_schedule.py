"""megatron-core's pipeline schedule on CPU: warm-up counts and the micro-batches in flight per model chunk.

``python tests/support/mcore_schedule.py CASES_JSON`` with ``PYTHONPATH`` pointing at the megatron-core to test (the
venv's 0.16.1, or ``.mcore/0.19.2``) prints one JSON object: the version and, per case ``[pp, vpp, microbatches,
rank]``, megatron-core's own ``get_pp_rank_microbatches`` (pipeline sizes set through ``parallel_state``'s own
setters, no process group needed) and the distinct per-chunk in-flight counts at each steady 1F1B moment, walked over
megatron-core's ``get_schedule_table`` with the two conventions of ``forward_backward_pipelining_with_interleaving``
(backward ``j`` runs chunk ``VPP − 1 − chunk(j)``; step ``k`` runs forward ``k + warm-up`` before backward ``k``).
"""

from __future__ import annotations

import json
import sys
import warnings


def _case(pp: int, vpp: int | None, microbatches: int, rank: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

    chunks = vpp or 1
    parallel_state.set_pipeline_model_parallel_world_size(pp)
    parallel_state.set_pipeline_model_parallel_rank(rank)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp)
    total, all_warmup, warmup, remaining = get_pp_rank_microbatches(microbatches, chunks, pp)
    table = get_schedule_table(microbatches, chunks, pp) if vpp else [(m, 0) for m in range(microbatches)]
    if all_warmup:
        vectors = {tuple([microbatches] * chunks)}
    else:
        vectors = set()
        live = [0] * chunks
        for k in range(warmup):
            live[table[k][1]] += 1
        for k in range(remaining):
            live[table[k + warmup][1]] += 1  # the steady step's forward
            vectors.add(tuple(live))
            live[chunks - 1 - table[k][1]] -= 1  # then its backward
    return {
        "case": [pp, vpp, microbatches, rank],
        "total": total,
        "warmup": warmup,
        "remaining": remaining,
        "vectors": sorted(vectors, reverse=True),
    }


def main() -> None:
    cases = json.loads(sys.argv[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core

        results = [_case(*case) for case in cases]
    print(json.dumps({"version": megatron.core.__version__, "results": results}))


if __name__ == "__main__":
    main()
