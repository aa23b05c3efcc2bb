"""The activation offload mechanisms in the trace: TE's layer-level offload (the stand-in, against TE's source and on
fake tensors) and megatron-core's own fine-grained manager (its patched spots, against both releases' source), then
both traced with real megatron-core (the venv's 0.16.1 and .mcore/0.19.2): the offload frees what it moves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mbridge_offload.config.errors import InputError
from mbridge_offload.plan.inputs.resolve import resolve
from mbridge_offload_runtime.upstream import te_min_offload_numel
from mbridge_offload_tools.exact.run import installs
from mbridge_offload_tools.trace import spec as specs
from mbridge_offload_tools.trace.run import spawn_batch

TRACE = Path(__file__).resolve().parents[2] / "tools" / "mbridge_offload_tools" / "trace"
sys.path.insert(0, str(TRACE))  # the child's modules import each other by name, as in the child
from activation_offload import te_layers  # noqa: E402

TE_SRC = os.environ.get("MBRIDGE_OFFLOAD_TE_SRC")
RELEASES = {i.version: i for i in installs() if i.version in ("0.16.1", "0.19.2")}
MANAGER = "megatron/core/pipeline_parallel/fine_grained_activation_offload.py"
SMALL = {
    "num_layers": 4,
    "hidden_size": 1024,
    "ffn_hidden_size": 4096,
    "num_attention_heads": 8,
    "num_query_groups": 4,
    "kv_channels": 128,
    "vocab_size": 1024,
    "seq_length": 2048,
    "num_gpus": 8,
}


# ------------------------------------------------------------------------------------------ TE's layer offload


@pytest.mark.skipif(TE_SRC is None, reason="set MBRIDGE_OFFLOAD_TE_SRC to a TransformerEngine checkout with tags")
@pytest.mark.parametrize("tag", sorted(te_layers.TE_FACTS))
def test_te_offloads_as_the_stand_in_says(tag: str) -> None:
    assert TE_SRC is not None
    text = subprocess.run(
        ["git", "-C", TE_SRC, "show", f"{tag}:transformer_engine/pytorch/cpu_offload.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert all(line in text for line in te_layers.TE_FACTS[tag]), tag
    # the size floor is the release's: none on v2.10, 256 Ki elements from v2.12
    release = tuple(int(x) for x in tag[1:].split("."))
    assert ("if t.numel() < 256 * 1024:" in text) == (te_layers.min_numel(release) == 256 * 1024)


@pytest.mark.parametrize("release", [(2, 10), (2, 11), (2, 12), (2, 17), (2, 18)])
def test_the_size_floor_is_the_runtimes(release: tuple[int, int]) -> None:
    assert te_layers.min_numel(release) == te_min_offload_numel(".".join(map(str, release)))


def _stack(layers: int, k: int, te: tuple[int, int] = (2, 18), numel: int = 512 * 1024) -> dict[str, int]:
    """``layers`` SiLU layers (each saves its input: ``numel`` fp32 elements) in the stand-in's context on fake
    tensors under the trace's tracker, ``k`` offloaded; GPU and host bytes at the end of forward and after backward."""
    import patches
    import standins
    import torch
    from tracker import Tracker

    tracker = Tracker()
    patches.MODE_TRACKER[:] = [tracker]
    standins.TE_VERSION = te
    out: dict[str, int] = {}
    with tracker, patches.CpuForCuda(tracker):
        leaf = torch.empty(numel, requires_grad=True)
        context, sync = te_layers.get_cpu_offload_context(True, k, layers, True, False, False)
        x = leaf.clone()
        for _ in range(layers):
            with context:
                x = torch.nn.functional.silu(x)
            x = sync(x)
        out["forward_gpu"], out["forward_host"] = tracker.total, tracker.host_bytes
        x.sum().backward()
        del x
        out["after_gpu"], out["after_host"] = tracker.total - leaf.grad.nbytes, tracker.host_bytes
        out["leaf"] = leaf.nbytes
    patches.MODE_TRACKER[:] = []
    return out


def test_offloaded_layers_leave_the_gpu_for_pinned_host_memory_until_backward() -> None:
    plain, two = _stack(4, 0), _stack(4, 2)
    layer = 4 * 512 * 1024
    assert plain["forward_host"] == 0 and two["forward_host"] == 2 * layer
    assert plain["forward_gpu"] - two["forward_gpu"] == 2 * layer  # every offloaded byte left the GPU
    # backward reloads them and releases everything: only the leaf stays, no host buffer
    assert two["after_gpu"] == plain["after_gpu"] == two["leaf"]
    assert two["after_host"] == 0


def test_small_tensors_stay_from_te_2_12() -> None:
    small = 1024
    assert _stack(3, 1, (2, 11), small)["forward_host"] == 4 * small
    assert _stack(3, 1, (2, 18), small)["forward_host"] == 0


def test_te_refuses_what_it_refuses() -> None:
    with pytest.raises(ValueError, match="Cannot offload all layers"):
        te_layers.get_cpu_offload_context(True, 4, 4, True, False, False)
    with pytest.raises(ValueError, match="what to offload"):
        te_layers.get_cpu_offload_context(True, 1, 4, False, False, False)
    with pytest.warns(DeprecationWarning):
        _context, sync = te_layers.get_cpu_offload_context(True, 1, 4, False, True, False)
    assert sync(3) == 3  # weights only: a null context since v2


# ------------------------------------------------------------------------------------ megatron-core's manager


def _manager_source(release: str) -> str:
    return (Path(RELEASES[release].pythonpath or "") / MANAGER).read_text()


@pytest.mark.skipif("0.16.1" not in RELEASES, reason="megatron-core 0.16.1 is not installed")
def test_0_16_tensor_push_is_upstreams_without_its_stray_tensor_assert() -> None:
    text = _manager_source("0.16.1")
    body = text[text.index("    def tensor_push(self, tensor):") : text.index("    def tensor_pop(self, tensor_tag):")]
    assert 'assert not torch_stray_tensor, "Stray tensor should not be offloaded"' in body
    for line in (
        "tensor_tag = (self._offloaded_group_index, self._tensor_count_current_group)",
        "self._tensor_count_current_group += 1",
        "self.offload_groups[self._offloaded_group_index - 1].push_tensor(tensor_tag, tensor)",
        "return tensor_tag",
    ):
        assert line in body


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_the_patched_spots_are_upstreams(release: str) -> None:
    text = _manager_source(release)
    # the manager refuses without TE's offload module and only sets its v1 flag; nvtx and the summary print
    assert 'raise RuntimeError("TE CPU offload is not available")' in text
    assert "cpu_offload.CPUOffloadEnabled = True" in text
    assert "def print_offload_summary_table(" in text and "def reload(self, state, non_blocking=None):" in text
    if release == "0.19.2":
        assert 'and tensor.device.type == "cuda"' in text and "and not torch_stray_tensor" in text


# ------------------------------------------------------------------------------------------ the spec (no torch)


def test_the_trace_builds_offload_runs_and_refuses_what_it_cannot() -> None:
    layer = specs.build(resolve({**SMALL, "activation_offload_layers": 2}), 0)["transformer"]
    assert layer["cpu_offloading"] and layer["cpu_offloading_num_layers"] == 2 and not layer["cpu_offloading_weights"]
    fine = specs.build(resolve({**SMALL, "offload_modules": ["core_attn", "attn_proj"]}), 0)["transformer"]
    assert fine["fine_grained_activation_offloading"] and fine["offload_modules"] == ["core_attn", "attn_proj"]
    assert "activation_offload_fraction" not in fine  # a 0.19 field, passed only when set
    with pytest.raises(InputError, match="v1 offload path"):
        specs.build(resolve({**SMALL, "activation_offload_layers": 2, "te_version": "2.9"}), 0)


# ------------------------------------------------------------------------------------------ traced, both releases


def _traced(release: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    got = spawn_batch(release, [specs.build(resolve({**SMALL, **c}), 0) for c in cases], deadline_s=600)
    assert not [g["error"] for g in got if "error" in g]
    return got


def _peak(got: dict[str, Any]) -> int:
    return max(int(p["total"]) for p in got["phases"].values())


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.parametrize("release", sorted(RELEASES))
def test_offload_frees_the_gpu_bytes_it_moves(release: str) -> None:
    floor = {"min_offloaded_tensor_size": 1024}  # small widths: let megatron-core move them
    norms = {"offload_modules": ["attn_norm", "mlp_norm"], **floor}
    plain, layer, qkv, fused = _traced(
        release, [{}, {"activation_offload_layers": 1}, {"offload_modules": ["qkv_linear"], **floor}, norms]
    )
    # TE's layer offload: one layer's eligible tensors are on the host at the peak, and off the GPU
    assert layer["host_peak_bytes"] > 0.05 * _peak(plain)
    assert _peak(plain) - _peak(layer) >= 0.98 * layer["host_peak_bytes"]
    # megatron-core's manager: one qkv_linear group per layer is copied (the host pool holds them all, 4 layers);
    # the last layer's stays on the GPU (the offload margin), the other three leave it
    assert qkv["host_peak_bytes"] > 0
    assert _peak(plain) - _peak(qkv) >= 0.98 * qkv["host_peak_bytes"] * 3 / 4
    # TE's layout: the norms of a dense layer are fused into the next linear, so upstream offloads nothing for them
    # (the same bytes up to the DDP buckets' alignment padding: the norm weight sits elsewhere in the parameter order)
    assert fused["host_peak_bytes"] == 0 and _peak(fused) == pytest.approx(_peak(plain), abs=1024)


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.skipif("0.19.2" not in RELEASES, reason="activation_offload_fraction is a megatron-core 0.19 field")
def test_the_offload_fraction_saves_what_the_planner_says() -> None:
    from mbridge_offload.plan.memory.stage import estimate_memory

    runs = [{"num_layers": 8}] + [
        {"num_layers": 8, "offload_modules": ["qkv_linear"], "min_offloaded_tensor_size": 1024, **f}
        for f in ({}, {"activation_offload_fraction": 0.5})
    ]
    traced = _traced("0.19.2", runs)
    planned = [estimate_memory(r.model, r.setup).worst.total for r in (resolve({**SMALL, **c}) for c in runs)]
    # 8 groups: the margin keeps one on the GPU, then upstream disables int(7 * 0.5) = 3 of the 7 left, not 4 of 8
    for i in (1, 2):
        saved, plan = _peak(traced[0]) - _peak(traced[i]), planned[0] - planned[i]
        assert saved > 0 and plan == pytest.approx(saved, rel=0.02)
    assert (_peak(traced[0]) - _peak(traced[2])) / (_peak(traced[0]) - _peak(traced[1])) == pytest.approx(4 / 7)
