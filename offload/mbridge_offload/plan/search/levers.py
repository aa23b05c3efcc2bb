"""The levers ``recommend`` may pull to make a run fit, which of them a run can use, and their config edits.

Eleven levers, in the user's words (``--levers`` on the CLI, ``levers`` over MCP):

- ``recompute``: selective by module (``recompute_modules``: layernorm, moe_act, core_attn, mla_up_proj,
  shared_experts, mlp, moe, only those the model's layer types have), or full with ``block`` (the first N layers of
  each stage) or ``uniform`` (every layer, one at a time);
- ``activation``: layer-level activation offload (``model.cpu_offloading_num_layers``);
- ``fine-grained``: fine-grained activation offload (``model.offload_modules``);
- ``optimizer``: HybridDeviceOptimizer (``optimizer.optimizer_offload_fraction``);
- ``grad-reduce``: gradients reduced and kept in bf16 (``ddp.grad_reduce_in_fp32=false``);
- ``ce-fusion``: Transformer Engine's fused cross entropy (``model.cross_entropy_loss_fusion=true``,
  ``model.cross_entropy_fusion_impl=te``);
- ``cp``, ``tp`` (with sequence parallelism), ``mbs`` and ``vpp``: change the parallel layout, the micro-batch or
  the interleaving, so checkpoints and throughput change with them;
- ``expandable-segments``: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (``env_vars``), offered only when
  the user's out-of-memory message shows memory reserved but unallocated (fragmentation).

By default recompute and the three offloads; the others are evaluated and shown as alternatives, ranked first only
when the caller allows them. PP is suggested (``planner._suggest``), never changed. Which combinations upstream
accepts is the rule catalogue's word (``resolve.Constraints.activation_blockers``, ``advice.Vetter``,
``fine_grained_plan.blockers``), never a copy here. Never imports torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mbridge_offload.config.errors import InputError
from mbridge_offload.config.overrides import format_override
from mbridge_offload.plan.inputs.fields import DEFAULT_LEVERS, LEVERS
from mbridge_offload.plan.inputs.resolve import Resolved
from mbridge_offload.plan.model.architecture import ModelSpec
from mbridge_offload.plan.model.run import Setup, check_setup, hdo_fails_at_first_step
from mbridge_offload.plan.search import fine_grained_plan as fg

# The default keeps the parallel layout, the numerics and the checkpoints as they are: recompute and the three
# offloads (DEFAULT_LEVERS, declared with LEVERS in plan/inputs/fields.py).
OFFLOAD_LEVERS = ("activation", "fine-grained", "optimizer")
LAYOUT_LEVERS = ("cp", "tp", "mbs")
SWITCH_LEVERS = ("grad-reduce", "ce-fusion", "vpp", "expandable-segments")
# Less reserved-but-unallocated than this in an OOM message is the allocator's ordinary rounding, not fragmentation
# that expandable segments would give back (PyTorch rounds blocks to 2 MiB / 20 MiB; a few hundred MiB is normal).
FRAGMENTATION_MIN_GIB = 1.0
# What each lever writes (Bridge keys; apply and options[].changes carry the exact overrides).
WRITES = {
    "recompute": "model.recompute_granularity, recompute_modules (selective: layernorm, moe_act, core_attn, "
    "mla_up_proj, shared_experts, mlp, moe, those this model's layers have) or recompute_method/num_layers (full)",
    "activation": "model.cpu_offloading, cpu_offloading_num_layers (+ activations on, weights off)",
    "fine-grained": "model.fine_grained_activation_offloading, offload_modules, transformer_impl, "
    "env_vars.NVTE_CPU_OFFLOAD_V1",
    "optimizer": "optimizer.optimizer_cpu_offload, optimizer_offload_fraction, overlap_cpu_optimizer_d2h_h2d",
    "cp": "model.context_parallel_size (doubling)",
    "tp": "model.tensor_model_parallel_size (doubling, at most 8) with sequence_parallel",
    "mbs": "train.micro_batch_size (halving; the global batch kept)",
    "grad-reduce": "ddp.grad_reduce_in_fp32=false",
    "ce-fusion": "model.cross_entropy_loss_fusion=true, cross_entropy_fusion_impl=te",
    "vpp": "model.virtual_pipeline_model_parallel_size (off, or one step up or down among the values dividing a "
    "stage's layers)",
    "expandable-segments": "env_vars.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (only where an OOM message shows "
    f"at least {FRAGMENTATION_MIN_GIB:g} GiB reserved but unallocated)",
}
# The one env var the expandable-segments lever writes (Bridge passes env_vars to the launcher's environment).
EXPANDABLE = "expandable_segments:True"
# TP stays inside one NVLink domain of an 8-GPU node: across nodes its per-layer collectives go over the network
# (memory-levers.md, "TP inside an NVLink domain").
MAX_TP = 8
MAX_CP = 64


def parse(given: list[str] | None) -> tuple[tuple[str, ...], bool]:
    """The levers asked for (``["recompute,optimizer"]`` or ``["recompute", "optimizer"]``) and whether they were
    asked for at all (else the defaults).

    Raises:
        InputError: an unknown lever, or none, with the list of levers.
    """
    if given is None:
        return DEFAULT_LEVERS, False
    names = [n.strip().lower().replace("_", "-") for item in given for n in str(item).split(",") if n.strip()]
    unknown = [n for n in names if n not in LEVERS]
    if unknown or not names:
        what = f"unknown lever {', '.join(map(repr, unknown))}" if unknown else "no lever given"
        raise InputError(
            f"--levers / levers: {what}; allowed: {', '.join(LEVERS)} (comma-separated, e.g. "
            "--levers recompute,activation,optimizer)"
        )
    return tuple(dict.fromkeys(names)), True


# ------------------------------------------------------------------------------------------- layout levers


def _valid(m: ModelSpec, s: Setup) -> bool:
    """Megatron accepts the layout and the global batch splits into whole micro-batches of every DP rank."""
    try:
        check_setup(m, replace(s, optimizer_offload_fraction=0.0, activation_offload_layers=0, offload_modules=()))
    except ValueError:
        return False
    return s.global_batch_size is None or s.global_batch_size % (s.micro_batch_size * s.dp) == 0


def layout_variants(lever: str, m: ModelSpec, s: Setup) -> list[Setup]:
    """``s`` with ``lever`` (cp, tp, mbs) changed, every value Megatron and the global batch allow, smallest change
    first: TP and CP double (TP with sequence parallelism, as Bridge recipes run it), MBS halves."""
    out: list[Setup] = []
    if s.global_batch_size is None:
        # The same job: a layout change keeps the samples per step the config as given implies (4·PP micro-batches
        # per DP rank), so fewer DP ranks run more micro-batches each, not a smaller step.
        from mbridge_offload.plan.time.step import samples_per_step

        s = replace(s, global_batch_size=samples_per_step(s))
    if lever in ("tp", "cp"):
        step, cap = getattr(s, lever) * 2, MAX_TP if lever == "tp" else MAX_CP
        sp: dict[str, Any] = {"sequence_parallel": True} if lever == "tp" else {}
        while step <= cap:
            out.append(replace(s, **{lever: step, **sp}))
            step *= 2
    elif lever == "mbs":
        mbs = s.micro_batch_size // 2
        while mbs >= 1:
            out.append(replace(s, micro_batch_size=mbs))
            mbs //= 2
    return [v for v in out if _valid(m, v)]


def why_not_layout(lever: str, m: ModelSpec, s: Setup) -> str:
    """In words, why ``lever`` has no value this run can take."""
    seq = s.seq_length or m.seq_length
    if lever == "tp":
        return (
            f"no TP above {s.tp} up to {MAX_TP} divides num_attention_heads {m.num_attention_heads} and "
            f"num_query_groups {m.num_query_groups}, num_gpus {s.num_gpus} and the global batch "
            f"({s.global_batch_size}) into whole micro-batches per DP rank"
        )
    if lever == "cp":
        return (
            f"no CP above {s.cp} divides seq_length {seq} into 2·CP chunks, num_gpus {s.num_gpus} and the global "
            f"batch ({s.global_batch_size}) into whole micro-batches per DP rank"
        )
    if s.global_batch_size is None:
        return "no global batch size given (--global-batch-size): a smaller micro-batch would be a smaller step"
    return (
        f"micro_batch_size is {s.micro_batch_size}: no smaller micro-batch splits the global batch "
        f"{s.global_batch_size} over DP {s.dp}"
        if s.micro_batch_size > 1
        else "micro_batch_size is already 1"
    )


# ------------------------------------------------------------------------------------------- recompute


def switch_variants(lever: str, m: ModelSpec, s: Setup) -> list[Setup]:
    """``s`` with one switch lever pulled, each value Megatron accepts (empty where it changes nothing here):

    - ``grad-reduce``: ``ddp.grad_reduce_in_fp32=false``: the gradient buffers (and their reduce-scatter) in the
      parameters' bf16, half of fp32's bytes (``plan/memory/stage.py``); the optimizer step then casts each shard to
      fp32 (``plan/memory/phases.py``). Only where the config reduces in fp32 and trains in 16 bits.
    - ``ce-fusion``: Transformer Engine's fused cross entropy before 2.18 keeps the bf16 logits and overwrites them
      with their gradient, where megatron-core's unfused and ``native`` paths keep an fp32 copy
      (``activations.output_bytes``, ``loss_transient_bytes``). From TE 2.18 it keeps an fp32 gradient too: no
      saving, not offered (``Setup.te_version``).
    - ``vpp``: interleaving off, or one step up or down among the values that divide a stage's layers: interleaving
      adds in-flight micro-batches on the first stage and shrinks the bubble (``plan/memory/schedule.py``,
      ``plan/time``).
    """
    if lever == "grad-reduce":
        ok = s.grad_reduce_in_fp32 and s.params_dtype in ("bf16", "fp16") and not s.use_megatron_fsdp
        return [replace(s, grad_reduce_in_fp32=False)] if ok else []
    if lever == "ce-fusion":
        if s.te_cross_entropy() or s.te_at_least(2, 18):
            return []
        return [replace(s, cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")]
    if lever == "vpp":
        if s.pp == 1 or s.pipeline_layout is not None or s.num_layers_in_first_pipeline_stage is not None:
            return []
        per_rank = m.num_layers // s.pp if m.num_layers % s.pp == 0 else 0
        divisors = [v for v in range(2, per_rank + 1) if per_rank % v == 0]
        # The changes a user tries: interleaving off, or one step either way (the next divisor down and up);
        # further steps only shrink the bubble further at more in-flight memory on the first stage.
        if s.vpp is None:
            values: list[int | None] = [*divisors[:1]]
        else:
            values = [None, *[v for v in divisors if v < s.vpp][-1:], *[v for v in divisors if v > s.vpp][:1]]
        out = [replace(s, vpp=v) for v in values if v != s.vpp]
        return [v for v in out if _valid(m, v)]
    return []


# Why a switch lever changes nothing for a run (vpp's reason names the run's PP, ce-fusion's the TE release: ``usable``
# says them).
_NOTHING_TO_SWITCH = {
    "grad-reduce": "gradients are already reduced in the parameters' dtype (ddp.grad_reduce_in_fp32 is false), or fp32",
    "ce-fusion": "Transformer Engine's fused cross entropy is already on",
    "expandable-segments": "no out-of-memory message with memory reserved but unallocated (fragmentation) in the "
    "evidence, or PYTORCH_CUDA_ALLOC_CONF already sets expandable_segments",
}


def _te_cross_entropy_saves_nothing(s: Setup) -> str | None:
    """Why TE's fused cross entropy is not offered from TE 2.18, where it keeps an fp32 gradient too."""
    if s.te_at_least(2, 18) and not s.te_cross_entropy():
        return (
            f"from Transformer Engine 2.18 (this answer assumes {s.te_version}) the fused cross entropy keeps an fp32 "
            "gradient of the logits, as megatron-core's own does: switching it on saves no memory"
        )
    return None


def usable(lever: str, r: Resolved, base: Setup, frag_gib: float | None = None) -> str | None:
    """None when ``lever`` can change something for this run; else why not, in words (``frag_gib``: the
    fragmentation the evidence shows, ``anchor.Anchor.expandable_segments_gib``)."""
    m = r.model
    if lever == "recompute":
        full_uniform = (base.recompute_granularity, base.recompute_method, base.recompute_num_layers)
        return "recompute is already full (uniform, 1 layer)" if full_uniform == ("full", "uniform", 1) else None
    if lever == "activation":
        blockers = r.constraints.activation_blockers(base, m.num_layers)
        return "; ".join(blockers) if blockers else None
    if lever == "fine-grained":
        if fg.useful_sets(m, base, r.constraints.model_config()):
            return None
        return "fine-grained offloading frees nothing here, or the rule catalogue refuses every module set"
    if lever == "optimizer":
        return (
            "Megatron-FSDP: upstream refuses optimizer CPU offload"
            if base.use_megatron_fsdp
            else (hdo_fails_at_first_step(base))
        )
    if lever in SWITCH_LEVERS:
        expandable = lever == "expandable-segments"
        if expandable_evidence(frag_gib, base) if expandable else switch_variants(lever, m, base):
            return None
        vpp = f"PP is {base.pp}: interleaving needs PP > 1, an even split and no explicit pipeline layout"
        if lever == "ce-fusion":
            return _te_cross_entropy_saves_nothing(base) or _NOTHING_TO_SWITCH[lever]
        return _NOTHING_TO_SWITCH.get(lever, vpp)
    return None if layout_variants(lever, m, base) else why_not_layout(lever, m, base)


def expandable_evidence(frag_gib: float | None, base: Setup) -> float | None:
    """``frag_gib``, the GiB the user's out-of-memory message shows reserved but unallocated (what
    ``expandable_segments:True`` usually gives back), when it is at least ``FRAGMENTATION_MIN_GIB`` and the run does
    not set it already; else None."""
    if base.expandable_segments or frag_gib is None:
        return None
    return frag_gib if frag_gib >= FRAGMENTATION_MIN_GIB else None


def check_usable(levers: tuple[str, ...], r: Resolved, base: Setup, frag_gib: float | None = None) -> None:
    """Every lever the caller named explicitly can be used here.

    Raises:
        InputError: naming each lever that cannot, why, and the levers that can.
    """
    refused = {lever: why for lever in levers if (why := usable(lever, r, base, frag_gib)) is not None}
    if refused:
        allowed = [lever for lever in LEVERS if lever in refused or usable(lever, r, base, frag_gib) is None]
        allowed = [lever for lever in allowed if lever not in refused]
        reasons = "; ".join(f"{lever}: {why}" for lever, why in refused.items())
        raise InputError(
            f"--levers / levers: cannot use {', '.join(refused)} for this run ({reasons}); levers this run can use: "
            f"{', '.join(allowed) or 'none'}"
        )


# ------------------------------------------------------------------------------------------- edits


# The recompute settings (``used`` reports any change of them as the recompute lever).
RECOMPUTE_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")
# What each layout and switch lever changes, in LEVERS order: (config key, the Setup attribute that holds its value).
# ``used`` reports a lever when any of its attributes differs; ``lever_overrides`` writes each of its keys.
EDITS: dict[str, tuple[tuple[str, str], ...]] = {
    "cp": (("model.context_parallel_size", "cp"),),
    "tp": (("model.tensor_model_parallel_size", "tp"), ("model.sequence_parallel", "sp")),
    "mbs": (("train.micro_batch_size", "micro_batch_size"),),
    "grad-reduce": (("ddp.grad_reduce_in_fp32", "grad_reduce_in_fp32"),),
    "ce-fusion": (
        ("model.cross_entropy_loss_fusion", "cross_entropy_loss_fusion"),
        ("model.cross_entropy_fusion_impl", "cross_entropy_fusion_impl"),
    ),
    "vpp": (("model.virtual_pipeline_model_parallel_size", "vpp"),),
    # The lever only switches it on; the env var's value is EXPANDABLE.
    "expandable-segments": (("env_vars.PYTORCH_CUDA_ALLOC_CONF", "expandable_segments"),),
}


def used(base: Setup, s: Setup) -> list[str]:
    """The levers ``s`` pulls relative to ``base``, in LEVERS order."""
    out = ["recompute"] if any(getattr(base, k) != getattr(s, k) for k in RECOMPUTE_FIELDS) else []
    offloads = (s.activation_offload_layers, s.offload_modules, s.optimizer_offload_fraction)
    out += [lever for lever, on in zip(OFFLOAD_LEVERS, offloads, strict=True) if on]
    return out + [lever for lever, edits in EDITS.items() if any(getattr(base, a) != getattr(s, a) for _, a in edits)]


def lever_overrides(base: Setup, s: Setup) -> list[str]:
    """Hydra-style overrides (Bridge keys) of the layout, switch and recompute changes from ``base`` to ``s``; the
    offload keys are ``advice.overrides_for``'s."""
    pulled = used(base, s)
    out = [
        format_override(key, EXPANDABLE if attr == "expandable_segments" else getattr(s, attr))
        for lever in pulled
        for key, attr in EDITS.get(lever, ())
    ]
    if "recompute" in pulled:
        out.append(format_override("model.recompute_granularity", s.recompute_granularity))
        if s.recompute_granularity == "selective":
            out.append(format_override("model.recompute_modules", list(s.recompute_modules)))
        if s.recompute_granularity == "full" or base.recompute_method is not None:
            out.append(format_override("model.recompute_method", s.recompute_method))
        if s.recompute_granularity == "full" or base.recompute_num_layers is not None:
            out.append(format_override("model.recompute_num_layers", s.recompute_num_layers))
    return out
