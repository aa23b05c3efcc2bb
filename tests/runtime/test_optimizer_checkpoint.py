"""Checkpoints: the saved form is independent of the split, resumes exactly and loads with weights_only=True."""

from __future__ import annotations

import pytest
import torch

from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer
from tests.runtime.test_optimizer import HYPER, groups_of, make_model, max_diff

# The offload suite (`mbridge-offload test -k cpu_offload`, `pytest -k cpu_offload`): see pyproject.toml.
pytestmark = pytest.mark.cpu_offload


def batches(n: int, seed: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 8, generator=gen) for _ in range(n)]


def run(model, opt, xs, sched=None) -> None:
    for x in xs:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


def build(model, fraction, **kw):
    opt = HybridDeviceOptimizer(groups_of(model, True), offload_fraction=fraction, bucket_size_numel=300, **HYPER, **kw)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)


@pytest.mark.parametrize("resume_fraction", [1.0, 0.0])
def test_save_at_half_resume_at_other_fraction_equals_uninterrupted(tmp_path, resume_fraction):
    xs = batches(10)
    full = make_model()
    opt, sched = build(full, 0.5)
    run(full, opt, xs, sched)

    first = make_model()
    opt1, sched1 = build(first, 0.5)
    run(first, opt1, xs[:5], sched1)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": first.state_dict(), "optim": opt1.state_dict(), "sched": sched1.state_dict()}, path)

    ckpt = torch.load(path, weights_only=True)
    resumed = make_model(seed=99)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(ckpt["model"])
    opt2, sched2 = build(resumed, resume_fraction, overlap_cpu_optimizer_d2h_h2d=False)
    opt2.load_state_dict(ckpt["optim"])
    sched2.load_state_dict(ckpt["sched"])
    run(resumed, opt2, xs[5:], sched2)

    assert max_diff(resumed, full) <= 1e-6
    assert all(float(s["step"]) == 10 for s in opt2.state_dict()["state"].values())


def test_saved_form_does_not_depend_on_fraction_overlap_or_buckets():
    dicts = []
    for fraction, overlap, bucket in [(0.0, False, 10), (0.5, True, 300), (1.0, True, 1 << 22), (0.3, False, 1)]:
        model = make_model()
        opt = HybridDeviceOptimizer(
            groups_of(model, True),
            offload_fraction=fraction,
            overlap_cpu_optimizer_d2h_h2d=overlap,
            bucket_size_numel=bucket,
            **HYPER,
        )
        run(model, opt, batches(3))
        dicts.append(opt.state_dict())
    ref = dicts[0]
    for other in dicts[1:]:
        assert other["param_groups"] == ref["param_groups"]
        assert other["state"].keys() == ref["state"].keys()
        for i, st in ref["state"].items():
            assert other["state"][i].keys() == st.keys()
            for k, v in st.items():
                torch.testing.assert_close(other["state"][i][k], v, atol=1e-6, rtol=0)


def test_state_dict_matches_torch_adamw_and_loads_from_it():
    ours, ref = make_model(), make_model()
    opt = HybridDeviceOptimizer(groups_of(ours, True), offload_fraction=0.5, **HYPER)
    ref_opt = torch.optim.AdamW(groups_of(ref, True), **HYPER)
    run(ours, opt, batches(3))
    run(ref, ref_opt, batches(3))
    mine, theirs = opt.state_dict(), ref_opt.state_dict()
    assert mine["state"].keys() == theirs["state"].keys()
    for i in theirs["state"]:
        assert mine["state"][i]["step"].dtype == theirs["state"][i]["step"].dtype
        for k, v in theirs["state"][i].items():
            torch.testing.assert_close(mine["state"][i][k], v, atol=1e-6, rtol=0)
    # and the other way: a plain torch checkpoint resumes in the hybrid optimizer
    fresh = HybridDeviceOptimizer(groups_of(ref, True), offload_fraction=1.0, **HYPER)
    fresh.load_state_dict(theirs)
    run(ref, fresh, batches(2, seed=4))
    run(ours, opt, batches(2, seed=4))
    assert max_diff(ours, ref) <= 1e-6


def test_saved_file_loads_with_weights_only_and_carries_full_hyperparameters_no_classes(tmp_path):
    model = make_model()
    opt = HybridDeviceOptimizer(
        model.parameters(),
        offload_fraction=0.5,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        lr=1e-3,
    )
    run(model, opt, batches(1))
    torch.save(opt.state_dict(), tmp_path / "o.pt")
    loaded = torch.load(tmp_path / "o.pt", weights_only=True)
    group = loaded["param_groups"][0]
    assert {"lr", "betas", "eps", "weight_decay", "amsgrad", "params"} <= group.keys()
    assert group["lr"] == 1e-3 and group["betas"] == (0.9, 0.999)  # torch's AdamW defaults, filled in
    assert not any(isinstance(v, type) for v in group.values())
    assert group["fused"] is True  # as torch saves it: a plain AdamW that loads it keeps the same kernel


def test_bf16_with_native_fp32_param_round_trip():
    model = make_model()
    model.to(torch.bfloat16)
    model[4].bias.data = model[4].bias.data.float()  # a native-fp32 param (kept in fp32, like mark_keep_in_fp32)
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, param_update_in_fp32=True, lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    assert "master_param" not in sd["state"][5]  # the fp32 param is its own master
    assert sd["state"][0]["master_param"].dtype == torch.float32
    masters = {i: s["master_param"].clone() for i, s in sd["state"].items() if "master_param" in s}

    again = make_model(seed=4)
    again.to(torch.bfloat16)
    again[4].bias.data = again[4].bias.data.float()
    again.load_state_dict(model.state_dict())
    opt2 = HybridDeviceOptimizer(again.parameters(), offload_fraction=0.5, param_update_in_fp32=True, lr=1e-3)
    opt2.load_state_dict(sd)  # upstream raised KeyError here before MCore #5929
    for i, m in masters.items():
        assert torch.equal(opt2.state_dict()["state"][i]["master_param"], m)
    assert set(opt2.state) == set(again.parameters())
    for p in again.parameters():
        p.grad = torch.randn_like(p)
    opt2.step()


def test_load_refreshes_host_copies_from_the_model():
    model = make_model()
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, lr=0.0, weight_decay=0.0)
    run(model, opt, batches(1))
    sd = opt.state_dict()
    donor = make_model(seed=8)
    with torch.no_grad():
        for p, q in zip(model.parameters(), donor.parameters(), strict=True):
            p.data.copy_(q.data)  # invisible to version counters
    opt.load_state_dict(sd)
    run(model, opt, batches(1))  # lr 0: weights must stay the donor's
    assert max_diff(model, donor) == 0.0


def test_state_dict_from_a_different_model_is_rejected():
    model = make_model()
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-3)
    run(model, opt, batches(1))
    good = opt.state_dict()

    other = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))
    other_opt = torch.optim.AdamW(other.parameters())
    for p in other.parameters():
        p.grad = torch.ones_like(p)
    other_opt.step()
    with pytest.raises(ValueError, match="different model: param group 0 has 4 parameters in the state dict but 6"):
        opt.load_state_dict(other_opt.state_dict())

    wider = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5)
    )
    wider_opt = HybridDeviceOptimizer(wider.parameters(), offload_fraction=0.5, lr=1e-3)
    with pytest.raises(
        ValueError, match=r"parameter 4 has shape \(5, 16\) but its saved 'exp_avg' has shape \(4, 16\)"
    ):
        wider_opt.load_state_dict(good)
    two = HybridDeviceOptimizer(groups_of(make_model(), True), offload_fraction=0.5, lr=1e-3)
    with pytest.raises(ValueError, match="1 param groups, this optimizer has 2"):
        two.load_state_dict(good)
    with pytest.raises(ValueError, match="not an optimizer state dict"):
        opt.load_state_dict({"model": {}})
