"""HybridDeviceOptimizer: parity with torch AdamW, the split, the training-loop surface and bad input."""

from __future__ import annotations

import copy

import pytest
import torch

from mbridge_offload_runtime.optimizer.buckets import split_params
from mbridge_offload_runtime.optimizer.clip import clip_grad_norm_
from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer

# The offload suite (`mbridge-offload test -k cpu_offload`, `pytest -k cpu_offload`): see pyproject.toml.
pytestmark = pytest.mark.cpu_offload

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )


def groups_of(model: torch.nn.Module, two_groups: bool) -> list[dict]:
    params = list(model.parameters())
    if not two_groups:
        return [{"params": params}]
    return [{"params": params[:3], "lr": 3e-2}, {"params": params[3:], "lr": 5e-3, "weight_decay": 0.0}]


def train(model, opt, steps: int, seed: int = 1, scheduler=None) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(6, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("steps", [1, 10])
@pytest.mark.parametrize("two_groups", [False, True], ids=["one_group", "two_groups"])
@pytest.mark.parametrize("overlap", [False, True], ids=["no_overlap", "overlap"])
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 1.0])
def test_matches_torch_adamw_with_lr_scheduler(fraction, overlap, two_groups, steps):
    ours, ref = make_model(), make_model()
    opt = HybridDeviceOptimizer(
        groups_of(ours, two_groups),
        offload_fraction=fraction,
        overlap_cpu_optimizer_d2h_h2d=overlap,
        bucket_size_numel=300,
        **HYPER,
    )
    ref_opt = torch.optim.AdamW(groups_of(ref, two_groups), **HYPER)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    train(ours, opt, steps, scheduler=sched)
    train(ref, ref_opt, steps, scheduler=ref_sched)
    assert max_diff(ours, ref) <= 1e-6
    assert max_diff(ours, make_model()) > 1e-4  # it did train
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    if fraction > 0:
        assert opt.num_buckets >= 1


def test_split_is_megatrons_greedy_prefix_and_reports_the_achieved_fraction():
    model = make_model()
    sizes = [p.numel() for p in model.parameters()]  # 256, 32, 512, 16, 64, 4 (884 in all)
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.3, lr=1e-3)
    # threshold 0.3 * 884 = 265.2: 256 < 265.2 so the next tensor (32) is taken too, then 288 >= 265.2 stops.
    assert [opt.is_offloaded(p) for p in model.parameters()] == [True, True, False, False, False, False]
    assert opt.offloaded_numel == sizes[0] + sizes[1] == 288
    assert opt.total_numel == sum(sizes)
    assert opt.offloaded_fraction == pytest.approx(288 / 884)
    assert split_params(list(model.parameters()), 0.0, [True] * 6) == [False] * 6
    assert split_params(list(model.parameters()), 1.0, [True] * 6) == [True] * 6


def test_buckets_respect_size_and_group_boundaries():
    model = make_model()
    opt = HybridDeviceOptimizer(groups_of(model, True), offload_fraction=1.0, bucket_size_numel=300, lr=1e-3)
    # group 0: 256+32 | 512 ; group 1: 16+64+4
    assert [len(b.members) for b in opt._buckets] == [2, 1, 3]
    assert [b.group_index for b in opt._buckets] == [0, 0, 1]
    assert len(opt.sub_optimizers) == 3  # one CPU optimizer per bucket, no device optimizer at fraction 1.0


def test_default_cpu_optimizer_is_fused_adamw():
    opt = HybridDeviceOptimizer(make_model().parameters(), offload_fraction=1.0, lr=1e-3)
    sub = opt.sub_optimizers[0]
    assert isinstance(sub, torch.optim.AdamW) and sub.param_groups[0]["fused"] is True


def test_any_optimizer_class_on_either_side():
    ours, ref = make_model(), make_model()
    opt = HybridDeviceOptimizer(
        ours.parameters(),
        offload_fraction=0.5,
        cpu_optimizer_cls=torch.optim.SGD,
        gpu_optimizer_cls=torch.optim.SGD,
        lr=0.1,
        momentum=0.9,
    )
    train(ours, opt, 5)
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), 5)
    assert max_diff(ours, ref) <= 1e-6


def test_state_is_the_union_keyed_by_model_params_and_live():
    model = make_model()
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-3)
    assert len(opt.state) == 0
    train(model, opt, 2)
    params = list(model.parameters())
    assert set(opt.state) == set(params)
    assert all(opt.state[p]["exp_avg"].shape == p.shape for p in params)
    before = opt.state[params[0]]["exp_avg"].clone()
    train(model, opt, 1, seed=7)
    assert not torch.equal(before, opt.state[params[0]]["exp_avg"])  # views follow the flat state
    assert opt.state[params[0]]["step"].item() == 3


def test_params_without_grads_are_skipped_like_torch():
    ours, ref = make_model(), make_model()
    for m in (ours, ref):
        m[4].weight.requires_grad_(False)  # frozen: never gets a grad
    opt = HybridDeviceOptimizer(ours.parameters(), offload_fraction=1.0, bucket_size_numel=10_000, **HYPER)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    frozen = ours[4].weight.detach().clone()
    train(ours, opt, 4)
    train(ref, ref_opt, 4)
    assert torch.equal(ours[4].weight, frozen)
    assert max_diff(ours, ref) <= 1e-6
    assert ours[4].weight not in opt.state


def test_param_without_grad_inside_a_bucket_is_left_untouched():
    model = make_model()
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, bucket_size_numel=10_000, lr=1e-2)
    train(model, opt, 2)
    bias = model[2].bias
    value, moment = bias.detach().clone(), opt.state[bias]["exp_avg"].clone()
    model(torch.randn(3, 8)).sum().backward()
    bias.grad = None  # e.g. an unused expert this step
    opt.step()
    assert torch.equal(bias, value) and torch.equal(opt.state[bias]["exp_avg"], moment)
    assert not torch.equal(model[0].weight, opt.state[model[0].weight]["exp_avg"])  # the others moved on


def test_zero_grad_clears_grad_and_decoupled_grad():
    model = make_model()
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    p = next(model.parameters())
    p.decoupled_grad = torch.ones_like(p)
    opt.zero_grad(set_to_none=False)
    assert all(q.grad is not None and q.grad.abs().sum() == 0 for q in model.parameters())
    assert p.decoupled_grad.abs().sum() == 0
    opt.zero_grad()
    assert all(q.grad is None for q in model.parameters()) and p.decoupled_grad is None


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_decoupled_grad_takes_precedence(fraction):
    ours, ref = make_model(), make_model()
    opt = HybridDeviceOptimizer(ours.parameters(), offload_fraction=fraction, **HYPER)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        g = torch.randn_like(p)
        p.decoupled_grad, p.grad, q.grad = g, torch.full_like(p, 100.0), g.clone()
    opt.step()
    ref_opt.step()
    assert max_diff(ours, ref) <= 1e-6


def test_the_fp32_gradient_copies_of_the_masters_are_freed_after_the_step():
    # They are the step's transient (the planner's optimizer_step phase), never resident through forward/backward.
    model = make_model().to(torch.bfloat16)
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, param_update_in_fp32=True, **HYPER)
    masters = dict(opt._masters)
    assert masters, "bf16 parameters stepped on the compute device have fp32 masters"
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        assert all(m.grad is None for m in masters.values())


def test_bf16_params_with_fp32_masters_track_an_fp32_reference():
    ours, ref = make_model(), make_model()
    ours.to(torch.bfloat16)
    ref.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in ref.state_dict().items()})  # same start
    opt = HybridDeviceOptimizer(ours.parameters(), offload_fraction=0.5, param_update_in_fp32=True, **HYPER)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    for _ in range(5):
        for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
            g = torch.randn_like(q)
            p.grad, q.grad = g.to(torch.bfloat16), g.to(torch.bfloat16).float()
        opt.step()
        ref_opt.step()
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and opt.state[p]["master_param"].dtype == torch.float32
        torch.testing.assert_close(opt.state[p]["master_param"], q, atol=1e-6, rtol=0)
        torch.testing.assert_close(p, q.to(torch.bfloat16), atol=0, rtol=0)


def test_clip_grad_norm_matches_torch_over_both_parts():
    ours, ref = make_model(), make_model()
    opt = HybridDeviceOptimizer(ours.parameters(), offload_fraction=0.5, lr=1e-3)
    for m in (ours, ref):
        m(torch.ones(4, 8)).pow(2).sum().backward()
    norm = opt.clip_grad_norm_(0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    torch.testing.assert_close(norm, ref_norm)
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert clip_grad_norm_([torch.zeros(2, requires_grad=True)], 1.0).item() == 0.0


def test_model_weights_loaded_after_construction_are_not_reverted():
    model, donor = make_model(), make_model(seed=5)
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, param_update_in_fp32=True, lr=0.0)
    model.load_state_dict(donor.state_dict())  # a model-only checkpoint load (Bridge #4082)
    train(model, opt, 1)  # lr 0 and no weight decay effect beyond lr: weights must stay the loaded ones
    assert max_diff(model, donor) == 0.0


def test_refresh_from_model_sees_writes_through_data():
    model, donor = make_model(), make_model(seed=5)
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=0.0)
    for p, q in zip(model.parameters(), donor.parameters(), strict=True):
        p.data.copy_(q.data)  # .data writes bypass the version counter
    opt.refresh_from_model()
    train(model, opt, 1)
    assert max_diff(model, donor) == 0.0
    assert HybridDeviceOptimizer.update_fp32_param_by_new_param is not None


def test_dummy_step_materializes_state_without_touching_weights():
    model = make_model()
    before = copy.deepcopy(model)
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-2)
    opt.dummy_step()
    assert max_diff(model, before) == 0.0
    assert len(opt.state) == 6
    assert all(float(s["step"]) == 0.0 and s["exp_avg"].abs().sum() == 0 for s in opt.state.values())


def test_defaults_recreate_the_optimizer_like_megatron_does():
    model = make_model()
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, bucket_size_numel=64, lr=1e-3)
    again = HybridDeviceOptimizer(list(model.parameters()), **opt.defaults)
    assert again.offloaded_numel == opt.offloaded_numel and again.num_buckets == opt.num_buckets
    assert all(set(g) == {"params", "lr"} for g in opt.param_groups)  # no classes or options in the groups


def test_add_param_group_keeps_existing_state():
    model, extra = make_model(), torch.nn.Linear(4, 4)
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-2)
    train(model, opt, 2)
    moment = opt.state[model[0].weight]["exp_avg"].clone()
    opt.add_param_group({"params": list(extra.parameters()), "lr": 1e-3})
    assert torch.equal(opt.state[model[0].weight]["exp_avg"], moment)
    assert opt.param_groups[1]["lr"] == 1e-3 and len(opt.param_groups) == 2


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan")])
def test_fraction_outside_unit_interval_is_rejected(fraction):
    with pytest.raises(ValueError, match="offload_fraction"):
        HybridDeviceOptimizer(make_model().parameters(), offload_fraction=fraction)


def test_non_tensor_params_are_rejected():
    with pytest.raises(TypeError, match="parameter 1 is a str"):
        HybridDeviceOptimizer([torch.zeros(2, requires_grad=True), "weight"])


@pytest.mark.parametrize("cls", [torch.optim.AdamW([torch.zeros(1)]), dict, "AdamW"])
def test_optimizer_class_that_is_not_a_torch_optimizer_is_rejected(cls):
    with pytest.raises(TypeError, match=r"cpu_optimizer_cls.*not a torch\.optim\.Optimizer"):
        HybridDeviceOptimizer(make_model().parameters(), cpu_optimizer_cls=cls)
    with pytest.raises(TypeError, match="gpu_optimizer_cls"):
        HybridDeviceOptimizer(make_model().parameters(), gpu_optimizer_cls=cls)


def test_bad_bucket_size_is_rejected():
    with pytest.raises(ValueError, match="bucket_size_numel"):
        HybridDeviceOptimizer(make_model().parameters(), bucket_size_numel=0)
