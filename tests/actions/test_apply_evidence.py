"""apply (mode recommended) sizes the run it writes, not the run a measured log came from: a report taken at the
config as written (micro-batch 1) and a ``--set`` to micro-batch 2 make the planner predict micro-batch 2 from it."""

from __future__ import annotations

from pathlib import Path

from mbridge_offload.actions.apply.apply import apply_offload
from mbridge_offload.config import sources
from mbridge_offload.plan.service import plan
from tests.support.configs import LLAMA3_8B, bridge_yaml

CONFIG = bridge_yaml(
    ("model", {**LLAMA3_8B, "seq_length": 8192, "tensor_model_parallel_size": 2, "sequence_parallel": True}),
    ("train", {"micro_batch_size": 1, "global_batch_size": 64}),
)
HARDWARE = {"gpu": "h100-80gb", "num_gpus": 8}


def test_apply_with_a_set_predicts_the_asked_run_from_the_measured_one(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    loaded = sources.load(str(path))
    at1 = plan("estimate", HARDWARE, loaded.config, loaded.raw, loaded.source).memory_gib.total
    mib = (at1 + 20.0) * 1024  # measured at micro-batch 1: MBS 2 then needs ~80 GiB, more than the budget
    log = f"[Rank 0] (after 10 iterations) memory (MB) | allocated: {mib / 2:.1f} | max allocated: {mib:.1f} | x"
    result = apply_offload(
        str(path), "recommended", overrides=["train.micro_batch_size=2"], planner={**HARDWARE, "measured_log": log}
    )
    assert result.mode != "none"  # anchored at the asked run, the 64 GiB report would say MBS 2 fits as it is
    assert any(c.key == "train.micro_batch_size" and c.new == 2 for c in result.changes)
    assert result.written is None and path.read_text() == CONFIG
