"""The catalogue of known offload failure modes that ``mbridge_offload.actions.diagnose`` matches logs against.

Each :class:`FailureMode` is data: the patterns that recognise it in an error or log, the cause, how to confirm
it, and the fix as overrides (or a function of the config that computes them), plus other actions and the
upstream issues that report it. Sources: the upstream skill's failure table and the user problems collected in
``docs/cpu-offloading.md``. The upstream error *messages* are matched from the rule catalogue (``config/rules/``);
the entries here that also explain one of those say which in :data:`EXPLAINS_RULES`.

Plain Python: no torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from mbridge_offload.actions import failure_conditions as fc
from mbridge_offload.actions.apply_plan import DEFAULT_FRACTION
from mbridge_offload.config.rules.optimizer import overlap_advised
from mbridge_offload.config.schema import OffloadConfig

FixFn = Callable[[OffloadConfig | None, "re.Match[str]"], list[str]]


@dataclass(frozen=True)
class FailureMode:
    """A known way an offload run fails, with what to tell the user."""

    id: str
    title: str
    patterns: tuple[str, ...]
    cause: str
    confirm: str
    fix: tuple[str, ...] | FixFn = ()
    actions: tuple[str, ...] = ()
    references: tuple[str, ...] = ()
    # Only match when this holds for the given config (None config: always).
    when: Callable[[OffloadConfig], bool] | None = None
    # Without a config, report this one only if it is one of the likely readings (not every OOM variant).
    without_config: bool = True
    # How users describe it in their own words; matched by meaning (CONCEPTS), not by substring.
    phrasings: tuple[str, ...] = ()
    # With a config: the reason it excludes this mode (key and value), or None (``failure_conditions``).
    rules_out: Callable[[OffloadConfig], str | None] | None = None
    # With a config: the cause told with the config's values, instead of ``cause``.
    explain: Callable[[OffloadConfig], str] | None = None
    # Modes this one explains better when both match: (id, why the other one does not apply).
    supersedes: tuple[tuple[str, str], ...] = ()
    # The overrides of the confirming experiment (``confirm``): they show the cause, they do not fix it (e.g.
    # resuming without the optimizer state throws that state away), so they never appear in ``fix``.
    confirm_with: tuple[str, ...] = ()
    # Without a config: the ideas (CONCEPTS) the text must all show before this reading is offered, so that a bare
    # symptom never leads with a mechanism nothing showed (a plain OOM is not "activation offload").
    shows: tuple[str, ...] = ()
    # What the report's ``needs`` asks for when this mode matched without a config (or with an empty fix).
    needs: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------- fixes that read the config


def _fraction(cfg: OffloadConfig | None) -> float | None:
    if cfg is None or not cfg.optimizer.optimizer_cpu_offload:
        return None
    return cfg.optimizer.optimizer_offload_fraction


def _fraction_overrides(fraction: float) -> list[str]:
    """The fraction, and the overlap switch where the rule catalogue advises it (OPT-OVERLAP's one threshold,
    the same that ``apply`` and the planner use): never overlap advice that ``validate`` would not give."""
    out = [f"optimizer.optimizer_offload_fraction={fraction}"]
    if overlap_advised(fraction):
        out.append("optimizer.overlap_cpu_optimizer_d2h_h2d=true")
    return out


def _fix_slowdown(cfg: OffloadConfig | None, _m: re.Match[str]) -> list[str]:
    current = _fraction(cfg)
    lower = 0.5 if current is None else max(0.25, round(current - 0.25, 2))
    if cfg is not None and cfg.model.cpu_offloading and not cfg.optimizer.optimizer_cpu_offload:
        layers = max(1, cfg.model.cpu_offloading_num_layers // 2)
        return [f"model.cpu_offloading_num_layers={layers}"]
    return _fraction_overrides(lower)


# Megatron-LM's validate_args checks of the offload flags (rule ids, origin megatron-lm), and the words that
# point at each one in a user's description; the fixes come from the rule catalogue, the one source.
_MLM_RULES: tuple[tuple[str, str], ...] = (
    ("ACT-MLM-FG-TE-IMPL", r"fine.?grained|offload.?modules"),
    ("OPT-MLM-FP8-PARAM-GATHER", r"fp8"),
    ("OPT-MLM-PRECISION-AWARE", r"optimi[sz]er|precision|fraction"),
)


def _mlm_rule(rule_id: str):
    from mbridge_offload.config.rules.catalogue import all_rules

    return next(r for r in all_rules() if r.id == rule_id)


def _fix_mlm_args(_cfg: OffloadConfig | None, m: re.Match[str]) -> list[str]:
    """The fix of the first validate_args check the description points at; none when it names no mechanism."""
    for rule_id, words in _MLM_RULES:
        if re.search(words, m.string, re.IGNORECASE):
            return list(_mlm_rule(rule_id).fix or ())
    return []


def _mlm_actions() -> tuple[str, ...]:
    from mbridge_offload.config.mlm_fixes import flag_edit

    out = []
    for rule_id, _words in reversed(_MLM_RULES):  # the check every --optimizer-cpu-offload meets first
        rule = _mlm_rule(rule_id)
        flags = [" ".join(edit[0]) for f in rule.fix or () if (edit := flag_edit(f))]
        out.append(f"if the AssertionError reads {rule.message!r}: add {' '.join(flags)} ({rule_id})")
    return tuple(out)


def _fix_layer_range(cfg: OffloadConfig | None, m: re.Match[str]) -> list[str]:
    total: int | None
    try:
        total = int(m.group("n"))
    except (IndexError, ValueError, TypeError):
        total = int(cfg.model.num_layers) if cfg is not None and cfg.model.num_layers else None
    return [f"model.cpu_offloading_num_layers={total - 1}"] if total else []


_OOM = (r"CUDA out of memory", r"OutOfMemoryError", r"CUDA error: out of memory", r"\bOOM\b", r"out of memory")
# Optimizer offload starts where `apply` starts it (the balanced starting point).
_START_FRACTION = DEFAULT_FRACTION
_SWITCH_TO_OPTIMIZER = (
    "model.cpu_offloading=false",
    "optimizer.optimizer_cpu_offload=true",
    *_fraction_overrides(_START_FRACTION),
)

# ---------------------------------------------------------------------------------------------- meaning

# The ideas a user's description is made of, each with the words that express it. A phrasing of a failure mode
# matches a text when every idea of the phrasing is in the text, however it is worded (diagnose.py).
CONCEPTS: dict[str, str] = {
    "gpu": r"\bgpus?\b|\bcuda\b|\bdevice\b|\bvram\b|\bhbm\b|\bcards?\b|\baccelerators?\b|\bh100\b|\ba100\b",
    "memory": r"\bmem(ory)?\b|\bvram\b|\bhbm\b|\ballocat\w*|\bfootprint|\b[gm]i?b\b|\busage\b|\bram\b",
    "host": r"\bhost\b|\bsystem (ram|memory)|\bram\b|\bdram\b|\bnode'?s? memory|\bmachine",
    "decrease": (
        r"\b(go|goes|going|gone|went|come|came|coming) down|\bdrop\w*|\bdecreas\w*|\breduc\w*|\blower\w*|"
        r"\bshr[iu]nk\w*|\bsmaller\b|\bfreed?\b|\bless\b|\bbenefit|\bhelp(s|ed)?\b|"
        # "save" as in memory, not as in a checkpoint
        r"(?<!checkpoint )(?<!ckpt )\bsav(e|ed|es|ing|ings)\b(?! (a |the )?(checkpoint|ckpt|state|optimizer|model))|"
        r"\bmove[sd]? the needle|\bimprov\w*"
    ),
    "negation": (
        r"\bnot?\b|\bnever\b|\bnothing\b|\bzero\b|\bnone\b|\bunchanged|\bsame\b|\bidentical|\bno effect|"
        r"n't\b|\bfail(s|ed)? to|\bbarely\b|\bhardly\b|\bstill\b|\bflat\b"
    ),
    "oom": (
        r"out of memory|\boom\b|outofmemory|\bran out|\bruns? out|\brunning out|\bexhaust\w*|not enough (\w+ )?memory|"
        r"exceed\w*.{0,30}(memory|capacity)|(memory|gpu|hbm|vram|device) (is |was |got )?full|too little memory|"
        r"does ?n[o']t fit|won't fit"
    ),
    "slow": (
        r"\bslow\w*|(?<!no )(?<!any )\blonger\b|\bcrawl\w*|\bsluggish|\btakes? (forever|ages)|\btimes slower|"
        r"\b\d+(\.\d+)?\s*x\s+(longer|more time)|\bdragg?ing|\blow (mfu|throughput|gpu utili[sz]ation)|"
        r"\b(throughput|performance|mfu|speed|tokens?/s|tflop/?s)( has| had)?( \w+)? (dropped|fell|regress\w*|tanked|"
        r"(gone|went|goes) down|decreased)"
    ),
    "time": (
        r"\bsteps?\b|\biterations?\b|\biters?\b|\btime\b|\bthroughput|\btokens?/s|\bsamples?/s|\bs/it\b|"
        r"\bseconds?\b|\bms\b|\bspeed|\bperformance|\btraining\b"
    ),
    "increase": (
        r"\bjump\w*|\bspik\w*|\bexplod\w*|\bdiverg\w*|\bblew up|\bblow(s|n)? up|\bskyrocket\w*|\bnan\b|"
        r"\bworse\b|\bhigher\b|\bincreas\w*|\bshot up|\bwent up|\bgoes up|\bdoubl\w*|\btripl\w*|\bgrew\b|\brose\b|"
        r"\bback to (its )?(initial|starting|random)"
    ),
    "loss": r"\bloss\w*|\bperplexity|\bppl\b|\bconverg\w*|\btraining curve",
    "resume": (
        r"\bresum\w*|\brestart\w*|\breload\w*|\brestor\w*|\bcheckpoints?\b|\bckpts?\b|\bload(ed|ing)?\b|"
        r"\bpick(ed|ing)? up (again|where)|\bcontinu\w*"
    ),
    "save": (
        r"\bsav(e|es|ed|ing)\b.{0,30}\b(checkpoint|ckpt|state|optimizer)|\b(checkpoint|ckpt)\w*.{0,20}\bsav|"
        r"\bwrit\w* (the |a )?(checkpoint|ckpt)|\bsave_checkpoint"
    ),
    "hang": (
        r"\bhang\w*|\bhung\b|\bstuck\b|\bfreez\w*|\bfroze\w*|\bdeadlock\w*|\bnever (finish|complet|return)\w*|"
        r"\bforever\b|\bno progress"
    ),
    "pinned": r"\bpin(ned|ning)?\b|\bpage.?locked|\bmemlock|\bulimit|\bhostalloc|\blocked memory",
    "killed": r"\bkill\w*|\bsigkill|\bterminated|\bdied\b|\bexit code 137|\breaped",
    "assert": r"\bassert\w*",
    "weights_only": r"weights.?only|unpickl\w*|safe.?globals|\bpickle",
    "activation": r"\bactivations?\b|\bcpu_offloading\b|\blayer.?level|\boffload(ed|ing)? (\d+ )?layers",
    "optimizer": r"\boptimi[sz]er|\badam\w*|\bhdo\b|hybriddeviceoptimizer|\bfraction",
    "offload": r"offload\w*|\bcpu offload|\bmov\w* (the )?\w* ?(states? )?to (the )?(cpu|host)",
    "pipeline": r"\bpipeline|\bpp\s*(=|>|is)?\s*[2-9]|\bpp\b",
    "recompute": r"\brecomput\w*|\bcheckpointing activations|\bactivation checkpointing",
    "cudagraph": r"cuda.?graphs?|\bcudagraph",
    "finetune": (
        r"\bfine.?tun\w*|\bpre.?trained\b|\bsft\b|\b(hf|hugging ?face) (checkpoint|weights|model)|"
        r"\bpretrained_checkpoint|\bbase model"
    ),
    "early_step": (
        r"\b(step|iteration|iter) ?(#)?(1|2|one|two)\b|\b(first|second) (optimizer )?(step|iteration|update)|"
        r"\bafter (one|the first) (step|update)"
    ),
    "random": (
        r"\brandom\w*|\buntrained|\bfrom scratch|\bln\(?vocab|\bcollaps\w*|\bgarbage|"
        r"\b(back to|like) (an? )?(random|init\w*|fresh)"
    ),
    "device_dtype": (
        r"same device and the same dtype|\b(device|dtype) mismatch|\bmismatch\w* (of )?(devices?|dtypes?)|"
        r"\bdifferent (devices?|dtypes?)|\bwrong (device|dtype)|\bmixed (devices?|dtypes?)|\bon (the )?cpu and"
    ),
    "state": r"\b(optimi[sz]er )?states?\b|\bexp_avg\w*|\bmoments?\b",
    "ranks": r"\branks?\b|\bacross (the )?(gpus|workers|processes)",
    "differ": r"\bdiffer\w*|\bmismatch\w*|\binconsistent|\bnot (the )?same\b",
    "double_buffer": r"double.?buffer\w*",
    "sizes": r"\bsizes?\b|\bshapes?\b",
    "fsdp": r"\bfsdp\b|megatron.?fsdp|\bm-?fsdp\b|\bdtensors?\b",
    "fused": r"\bfused ?adam\w*|\bfused (optimi[sz]er|kernel)|\bapex\b|transformer.?engine'?s? adam|\bte adam",
    "cpu": r"\bcpu\b",
    "nan": r"\bnans?\b|\bpoison\w*|\bgarbage (values|states)",
    "low_precision": (
        r"\bbf16\b|\bfp16\b|\bbfloat16\b|\bhalf.precision|\blow(er)?.precision|\bprecision.?aware|"
        r"\bexp_avg(_sq)?_dtype|\bmain_params_dtype"
    ),
    "fp32": r"\bfp32\b|\bfloat32\b|\bfull precision|\bsingle precision|\b4 bytes",
    "stale": (
        r"\bstale\b|\bprevious (step|iteration)'?s? grad\w*|\bold grad\w*|\bre-?appl\w*|\bapplied again|"
        r"\bleftover grad\w*|\bcached grad\w*|\blast step'?s? grad\w*"
    ),
    "megatron_lm": r"megatron.?lm\b|\bmlm\b|pretrain_gpt|megatron/training|\barguments\.py|\bvalidate_args",
    "args": (
        r"\bvalidate_args|\bargs?\b|\barguments?\b|\bflags?\b|\bargv\b|command.?line|\boptions?\b|"
        r"(?<![\w-])--[a-z][\w-]+"
    ),
    "failure": (
        r"\bfail\w*|\berrors?\b|\bassert\w*|\breject\w*|\brefus\w*|\bcrash\w*|\bbreaks?\b|\bbroke\w*|"
        r"\bcomplain\w*|\bdies\b|\bdied\b|\bexits?\b|won't (start|run)|does ?n[o']t (start|run|work)|\bblows? up"
    ),
    "no_grad": (
        r"\bno grad\w*|\bgrad(ient)? (is |was )?none|\bwithout (a )?grad\w*|\bunused (expert|param\w*)|"
        r"\bno tokens|\bnot routed|\bgets? no tokens|\b(receive|got)s? no tokens"
    ),
}

# ---------------------------------------------------------------------------------------------- the catalogue

KNOWN: tuple[FailureMode, ...] = (
    # --- the upstream config errors (also matched from the rule catalogue; these carry the confirm step)
    FailureMode(
        "pp_constraint",
        "Activation offloading with pipeline parallelism",
        (r"Currently there is no support for Pipeline parallelism with CPU offloading",),
        "layer-level activation offloading (model.cpu_offloading) is used with pipeline_model_parallel_size > 1; "
        "Megatron Core refuses the combination",
        "check model.pipeline_model_parallel_size in the config (or --pipeline-model-parallel-size)",
        _SWITCH_TO_OPTIMIZER,
        (
            "alternatively keep activation offload and set model.pipeline_model_parallel_size=1 if the model fits on "
            "one stage (see `mbridge-offload estimate`)",
        ),
        phrasings=("activation offloading with pipeline parallelism fails",),
    ),
    FailureMode(
        "recompute_constraint",
        "Activation offloading with recomputation",
        (r"CPU offloading does not work when activation recomputation is enabled",),
        "model.cpu_offloading is combined with activation recomputation (recompute_granularity is not null)",
        "check model.recompute_granularity",
        ("model.recompute_granularity=null",),
        ("or keep recompute and switch activation offload off (model.cpu_offloading=false)",),
        phrasings=("activation offloading with recompute fails",),
    ),
    FailureMode(
        "fine_grained_constraint",
        "Layer-level and fine-grained activation offloading together",
        (r"fine_grained_activation_offloading cannot be enabled with cpu_offloading",),
        "both activation-offload mechanisms are on; their saved-tensor hooks and schedules would corrupt each other",
        "check model.fine_grained_activation_offloading and model.cpu_offloading",
        ("model.fine_grained_activation_offloading=false",),
        ("or keep fine-grained offloading (works with PP>1) and set model.cpu_offloading=false",),
    ),
    FailureMode(
        "cuda_graph_constraint",
        "Activation offloading with CUDA graphs",
        (r"CUDA graphs not supported with CPU offloading", r"Cudagraphs not supported"),
        "CUDA graphs (cuda_graph_impl other than none/full_iteration, or Bridge's local CUDA-graph manager) are on "
        "together with model.cpu_offloading",
        "check model.cuda_graph_impl and model.enable_cuda_graph",
        ("model.cuda_graph_impl=none",),
        ("or keep CUDA graphs and use optimizer offloading instead (unaffected by CUDA graphs)",),
        phrasings=("activation offloading with CUDA graphs fails",),
    ),
    FailureMode(
        "layer_range",
        "Too many offloaded layers",
        (r"CPU offloading can be done only for layers less than (?P<n>\d+)",),
        "model.cpu_offloading_num_layers is not below model.num_layers (at least one layer must stay on the GPU)",
        "compare model.cpu_offloading_num_layers with model.num_layers",
        _fix_layer_range,
    ),
    FailureMode(
        "te_nothing_to_offload",
        "Activation offload with nothing to offload",
        (r"CPU Offloading is enabled while it is not mentioned what to offload",),
        "model.cpu_offloading is on but cpu_offloading_activations and cpu_offloading_weights are both false; "
        "Transformer Engine raises this during model construction (Megatron-Bridge#2684)",
        "check model.cpu_offloading_activations and model.cpu_offloading_weights",
        ("model.cpu_offloading_activations=true",),
        references=("NVIDIA-NeMo/Megatron-Bridge#2684",),
    ),
    FailureMode(
        "te_missing",
        "Activation offloading without Transformer Engine",
        (
            r"CPU Offloading is enabled when TE is not present",
            r"CPU Offloading cannot be enabled while TE is not present",
        ),
        "layer-level activation offload is implemented by Transformer Engine; it is missing or "
        "model.transformer_impl is not transformer_engine",
        "python -c 'import transformer_engine.pytorch' in the training environment; check model.transformer_impl",
        ("model.transformer_impl=transformer_engine",),
        ("or switch activation offload off: model.cpu_offloading=false",),
    ),
    FailureMode(
        "te_signature",
        "get_cpu_offload_context called with the wrong arguments",
        (
            r"get_cpu_offload_context\(\) takes from \d+ to \d+ positional arguments but \d+ were given",
            r"get_cpu_offload_context\(\) got an unexpected keyword argument",
        ),
        "Megatron Core's version dispatch passes arguments Transformer Engine's version does not take "
        "(TE 1.8/1.9 with older MCore, or a TE version string such as '0.1.0+te2.9.0' that MCore mis-parses)",
        "pip show transformer-engine megatron-core; compare with the pairing in Megatron Bridge's uv.lock",
        (),
        (
            "upgrade megatron-core (dispatch fixed by NVIDIA/Megatron-LM PR #996) or install the transformer-engine "
            "version your megatron-core release was tested with",
        ),
        ("NVIDIA/Megatron-LM#1018", "NVIDIA/Megatron-LM#1041"),
    ),
    FailureMode(
        "decoupled_weight_decay",
        "Optimizer offload needs AdamW mode",
        (r"CPU offloading only supported with decoupled_weight_decay enabled",),
        "optimizer.optimizer_cpu_offload with decoupled_weight_decay=false; the CPU optimizer is torch AdamW",
        "check optimizer.decoupled_weight_decay",
        ("optimizer.decoupled_weight_decay=true",),
    ),
    FailureMode(
        "precision_aware_required",
        "Megatron-LM optimizer offload needs the precision-aware optimizer",
        (r"optimizer cpu offload must be used in conjunction with `?--use-precision-aware-optimizer",),
        "Megatron-LM's validate_args requires --use-precision-aware-optimizer with --optimizer-cpu-offload",
        "check the launch flags for --use-precision-aware-optimizer",
        ("optimizer.use_precision_aware_optimizer=true",),
        ("on the Megatron-LM command line add --use-precision-aware-optimizer",),
    ),
    FailureMode(
        "mlm_validate_args",
        "Megatron-LM's argument check rejects the offload flags",
        (),
        "Megatron-LM's validate_args (megatron/training/arguments.py) asserts on offload flag combinations that "
        "megatron-core's own configs accept: --optimizer-cpu-offload needs --use-precision-aware-optimizer, with "
        "--fp8-param-gather also --fp8-recipe delayed, and --fine-grained-activation-offloading needs "
        "--transformer-impl transformer_engine",
        'run `mbridge-offload validate --megatron-args "<the launch flags>"` (it applies these checks and answers '
        "with the flag to add), or read the AssertionError line just above the validate_args frame",
        _fix_mlm_args,
        _mlm_actions(),
        phrasings=(
            "Megatron-LM validate_args fails with the offload flags",
            "Megatron-LM rejects the offload command-line arguments",
            "pretrain_gpt argument check fails with the offload options",
        ),
        needs=(
            'the Megatron-LM command line (`mbridge-offload validate --megatron-args "..."`, MCP validate_config '
            "megatron_args) or the AssertionError text: it names the one check that failed",
        ),
    ),
    FailureMode(
        "mfsdp_v2",
        "Megatron-FSDP v2 does not support optimizer offload",
        (r"MFSDP v2 does not (currently )?support optimizer CPU offload",),
        "optimizer.optimizer_cpu_offload with Megatron-FSDP v2",
        "check ddp.use_megatron_fsdp and the FSDP version",
        ("optimizer.optimizer_cpu_offload=false",),
        ("or use the distributed optimizer instead of Megatron-FSDP v2 (ddp.use_megatron_fsdp=false)",),
    ),
    FailureMode(
        "skip_megatron_wrapping",
        "skip_megatron_wrapping with optimizer offload",
        (r"skip_megatron_wrapping=True is incompatible with optimizer_cpu_offload",),
        "get_megatron_optimizer(skip_megatron_wrapping=True) cannot wrap the HybridDeviceOptimizer",
        "look for skip_megatron_wrapping=True where your code builds the optimizer",
        ("optimizer.optimizer_cpu_offload=false",),
        ("or keep offloading and call get_megatron_optimizer without skip_megatron_wrapping=True",),
    ),
    FailureMode(
        "optimizer_state_device_mismatch",
        "Optimizer state on mixed devices/dtypes after resume",
        (r"Tensors of the same index must be on the same device and the same dtype",),
        "after the checkpoint load some Adam state tensors (exp_avg, exp_avg_sq) are not on the device or dtype of "
        "the parameter their sub-optimizer steps (e.g. GPU state for a CPU copy at optimizer_offload_fraction=1.0); "
        "torch's foreach/fused Adam groups tensors by device and dtype and refuses the mix",
        "after load, print {k: (v.device, v.dtype)} of each optimizer.state entry next to its parameter's; the "
        "traceback ends in torch/utils/_foreach_utils.py _group_tensors_by_device_and_dtype",
        (),
        (
            "upgrade megatron-core / Megatron Bridge (the HDO's load hooks move each state to its sub-optimizer's "
            "device), or resume with this project's HybridDeviceOptimizer, whose load_state_dict places every "
            "state with its sub-optimizer",
            "workaround that loses the Adam moments (they restart from zero): resume the weights only with "
            "checkpoint.load_optim=false",
        ),
        ("NVIDIA-NeMo/Speech#14574",),
        rules_out=fc.rules_out_save_assert,
        phrasings=(
            "optimizer states end up on different devices after resume",
            "optimizer state tensors have mixed dtypes after loading the checkpoint",
        ),
    ),
    FailureMode(
        "common_state_differs",
        "Common state dict differs across ranks",
        (r"There is difference in the common state dict in different ranks",),
        "with optimizer_cpu_offload the HybridDeviceOptimizer's per-parameter state (optimizer param_state keys) "
        "lands in the checkpoint's common (replicated) part, which each rank fills differently; the save warns "
        "and the resume from that checkpoint fails",
        "the warning lists ('optimizer', 0, 'param_state', ...) keys; it does not appear with "
        "optimizer_cpu_offload=false",
        ("optimizer.use_distributed_optimizer=true", "ddp.use_distributed_optimizer=true"),
        (
            "the distributed optimizer saves the HDO's state sharded (fully_reshardable / dp_reshardable) instead "
            "of in the common dict; or resume the weights only (checkpoint.load_optim=false)",
        ),
        ("NVIDIA-NeMo/Speech#14243",),
        rules_out=fc.rules_out_save_assert,
        phrasings=(
            "the common state dict differs across ranks",
            "optimizer state differs between ranks when saving the checkpoint",
        ),
    ),
    FailureMode(
        "double_buffer_size_mismatch",
        "Double-buffered reload: buffers of different sizes",
        (r"Can't copy two buffers of different sizes", r"CPU buffer shape does not match the offloaded tensor shape"),
        "Transformer Engine's double-buffered reload (model.cpu_offloading_double_buffering) reuses one GPU buffer "
        "per tensor slot and assumes every offloaded layer saves the same tensors with the same shapes; layers that "
        "differ (dense and MoE layers, another layer type, a changed sequence length) break it (TE fixed "
        "asymmetric layers in PR #1984)",
        "the traceback ends in transformer_engine/pytorch/cpu_offload.py reload; the run passes with "
        "model.cpu_offloading_double_buffering=false",
        ("model.cpu_offloading_double_buffering=false",),
        ("or upgrade transformer-engine (asymmetric layers fixed in TE PR #1984)",),
        ("NVIDIA-NeMo/Speech#14670",),
        rules_out=fc.rules_out_double_buffering,
        phrasings=(
            "double buffering fails with buffers of different sizes",
            "activation offload double buffer size mismatch",
        ),
    ),
    FailureMode(
        "mfsdp_offload_pin_memory",
        "Megatron-FSDP + optimizer offload fails in pin_memory",
        (
            r"Megatron FSDP does not work with CPU_OFFLOADING",
            r"(?:megatron_fsdp|fully_shard|DTensor|_dtensor).{0,600}pin_memory",
            r"pin_memory.{0,600}(?:megatron_fsdp|DTensor|_dtensor)",
        ),
        "the HybridDeviceOptimizer clones every parameter to the CPU and pins the clone when the optimizer is "
        "built (get_megatron_optimizer); under Megatron-FSDP the parameters are sharded DTensors (EP shards "
        "included) and pin_memory goes through DTensor dispatch, which fails",
        "the traceback runs setup_model_and_optimizer -> get_megatron_optimizer -> hybrid_optimizer and ends in "
        "pin_memory with DTensor frames; ddp.use_megatron_fsdp is true",
        (
            "ddp.use_megatron_fsdp=false",
            "ddp.use_distributed_optimizer=true",
            "optimizer.use_distributed_optimizer=true",
        ),
        (
            "the distributed optimizer works with optimizer offload; Megatron-LM PR #4623 (open) makes the HDO "
            "use the FSDP local shards",
        ),
        ("NVIDIA/Megatron-LM#1986", "NVIDIA/Megatron-LM#4623"),
        rules_out=fc.rules_out_fsdp,
        phrasings=("Megatron-FSDP with optimizer offload crashes in pin_memory", "FSDP with CPU offload fails pinning"),
    ),
    # --- failures with no single message
    FailureMode(
        "oom_activation_offload",
        "OOM with activation offloading",
        _OOM,
        "activation offload requires PP=1, so every GPU holds all layers' weights, gradients and optimizer states; "
        "for large (30B+, MoE) models these alone exceed the GPU (Qwen3-30B-A3B: 70.3 GiB allocated at PP=1 on an "
        "80 GB H100)",
        "compare torch.cuda.max_memory_allocated() with the GPU size; run `mbridge-offload estimate` with this config",
        (),  # sized by the planner (actions/diagnose_plan.py): a generic fraction can leave the run over budget
        ("optimizer offload and recompute also work with PP > 1 (model.pipeline_model_parallel_size)",),
        rules_out=fc.rules_out_oom_activation,
        shows=("activation", "offload"),
        phrasings=("GPU memory ran out", "the job does not fit on the GPU", "activation offload ran out of GPU memory"),
    ),
    FailureMode(
        "oom_partial_optimizer_offload",
        "OOM at partial optimizer offload",
        _OOM,
        "optimizer.optimizer_offload_fraction is below 1.0 and the GPU-resident share of the Adam states is still "
        "too large (each 25 % moved saved ~3.8 GiB on Qwen3-30B-A3B)",
        "compare the peak memory with the fraction; `mbridge-offload estimate --optimizer-offload-fraction F` for "
        "a few fractions",
        (),  # sized by the planner
        ("or add pipeline parallelism (model.pipeline_model_parallel_size)",),
        rules_out=fc.rules_out_oom_partial,
        shows=("optimizer", "offload"),
        phrasings=("GPU memory ran out", "the job does not fit on the GPU", "optimizer offload ran out of GPU memory"),
    ),
    FailureMode(
        "oom_full_optimizer_offload",
        "OOM with all optimizer states offloaded",
        _OOM,
        "with optimizer_offload_fraction=1.0 the remaining GPU memory is weights, gradients and activations; more "
        "optimizer offload cannot help",
        "look at the allocator snapshot or `mbridge-offload estimate`: activations and weights dominate",
        (),  # sized by the planner
        ("recompute, more tensor/pipeline parallelism or a smaller train.micro_batch_size",),
        rules_out=fc.rules_out_oom_full,
        without_config=False,
        phrasings=("ran out of GPU memory with everything offloaded",),
    ),
    FailureMode(
        "oom_no_offload",
        "OOM without offloading",
        _OOM,
        "nothing is offloaded yet; where the memory goes (activations, optimizer states, weights) decides the lever",
        "`mbridge-offload recommend CONFIG` predicts the memory before/after",
        (),  # sized by the planner
        ("recompute, optimizer or activation offload, or more parallelism: the planner ranks them",),
        rules_out=fc.rules_out_oom_none,
        without_config=False,
        phrasings=("GPU memory ran out", "the job does not fit on the GPU"),
    ),
    FailureMode(
        "slowdown",
        "Step time much slower with offloading",
        (
            r"\b(?P<x>\d+(?:\.\d+)?)\s*x\s*(?:slower|slowdown)",
            r"\bslow(?:er|down|s down)?\b",
            r"throughput (?:regression|drop)",
            r"(?:step|iteration) time (?:went up|increased|doubled|grew)",
        ),
        "the CPU Adam step dominates: the penalty is roughly linear in optimizer_offload_fraction (1.9x at 25 %, "
        "4.2x at 100 % on Qwen3-30B-A3B); D2H/H2D overlap wins only ~7 % back",
        "compare step times at two fractions; profile the optimizer step (CPU time vs copies)",
        _fix_slowdown,
        ("more CPU cores per GPU (OMP_NUM_THREADS) speed the CPU step up",),
        rules_out=fc.rules_out_slowdown,
        explain=fc.explain_slowdown,
        phrasings=(
            "training got slow with offload",
            "step time increased with offload",
            "iterations slow",
            "throughput dropped with offload",
        ),
    ),
    FailureMode(
        "no_saving",
        "Optimizer offload saves no memory",
        (
            r"(?:no|zero) (?:memory )?(?:saving|reduction|difference)",
            r"memory (?:unchanged|did not (?:drop|change))",
            r"did not reduce (?:gpu )?memory",
        ),
        "optimizer.optimizer_cpu_offload is off, or on with optimizer_offload_fraction 0.0 (Bridge's default): the "
        "HybridDeviceOptimizer then keeps every state on the GPU",
        "check optimizer.optimizer_cpu_offload and optimizer.optimizer_offload_fraction in the effective config "
        "(`mbridge-offload validate`)",
        lambda cfg, _m: fc.fix_no_saving(cfg),
        rules_out=fc.rules_out_no_saving,
        explain=fc.explain_no_saving,
        phrasings=("no GPU memory was freed", "offload did not reduce memory", "memory usage unchanged with offload"),
    ),
    FailureMode(
        "finetune_stale_masters",
        "Fine-tune: loss right at step 1, random at step 2",
        (
            r"sync_hybrid_device_optimizer_fp32_master_copies",
            r"(?:fine.?tun\w*|pretrained).{0,200}loss.{0,160}(?:random|collaps\w*)",
            r"loss.{0,60}step ?1\b.{0,160}(?:random|collaps\w*|~?10\b).{0,60}step ?2\b",
        ),
        "the HybridDeviceOptimizer's CPU and fp32 copies of the weights are made when the optimizer is built, "
        "before the pretrained checkpoint is loaded into the model; the load (model only) refreshes the distributed "
        "optimizer's own fp32 shards but not these copies, so the first step runs Adam on random-init weights and "
        "writes them back: step 1's loss is right, step 2's is that of a random model (optimizer_cpu_offload + "
        "distributed optimizer + bf16/fp16 + model-only load)",
        "log the loss of steps 1-3: right, then ~ln(vocab size) (about 10-12); it does not happen with "
        "optimizer.optimizer_cpu_offload=false",
        (),
        (
            "upgrade Megatron Bridge (PR #4082: sync_hybrid_device_optimizer_fp32_master_copies after checkpoint "
            "load; Megatron Bridge 0.6.2 has it); the megatron-core fix is Megatron-LM PR #5071 (open); NeMo-RL has "
            "the same fix (PR #2372)",
            "until then: call the same sync after loading, or turn optimizer offload off for the fine-tune "
            "(optimizer.optimizer_cpu_offload=false); with this project's HybridDeviceOptimizer call "
            "refresh_from_model() after a model-only load",
            "checkpoint.load_optim=false does not help: a fine-tune start loads no optimizer state",
        ),
        ("NVIDIA-NeMo/Megatron-Bridge#3949", "NVIDIA-NeMo/Megatron-Bridge#4082", "NVIDIA-NeMo/RL#2371"),
        rules_out=lambda cfg: fc.rules_out_save_assert(cfg),
        explain=fc.explain_stale_masters,
        supersedes=(
            (
                "resume_loss_jump",
                "a fine-tune start loads no optimizer state, so resuming without it (checkpoint.load_optim=false) "
                "tells nothing; the stale copies are the HybridDeviceOptimizer's (finetune_stale_masters)",
            ),
        ),
        phrasings=(
            "fine-tuning from a pretrained checkpoint the loss is right at the first step and random at step two",
            "fine-tuning loss collapses to random after the first step",
            "after loading the pretrained weights the loss goes back to random",
        ),
    ),
    FailureMode(
        "resume_loss_jump",
        "Loss jumps after resuming from a checkpoint",
        (
            r"loss (?:jumps?|jumped|spikes?|spiked|explodes?|exploded|diverge)",
            r"after (?:resum|restart|load)\w*.{0,40}loss",
            r"loss.{0,40}after (?:resum|restart|load)",
        ),
        "resuming a run (model and optimizer state), the HybridDeviceOptimizer's fp32 masters or its Adam step "
        "counter were not restored: precision-aware + offload resume (Megatron-LM#1842), stale 'step' in "
        "DP-reshardable loads (SkyRL#1401, Megatron-LM PR #5929)",
        "a confirmation, not a fix: resume once from the same checkpoint with checkpoint.load_optim=false "
        "(--no-load-optim); if the jump goes away, the optimizer-state restore is at fault (that run throws the Adam "
        "state away, so do not keep training with it)",
        (),
        (
            "upgrade Megatron Bridge to >= 0.6.2: PR #4082 (Megatron-Bridge#3949) calls "
            "sync_hybrid_device_optimizer_fp32_master_copies after every checkpoint load, refreshing the "
            "HybridDeviceOptimizer's CPU copies and fp32 masters from the loaded weights",
            "upgrade megatron-core past Megatron-LM PR #5929 (main; Megatron-LM PR #6124 on dev): it restores the "
            "Adam 'step' in DP-reshardable loads and the fp32 masters of native-fp32 parameters",
            "or use this project's HybridDeviceOptimizer (install_optimizer_offload): its load_state_dict refreshes "
            "the host copies and masters from the loaded weights, then restores the saved masters and each "
            "parameter's step (resume is bit-exact: tests/runtime/test_optimizer_resume.py)",
        ),
        ("NVIDIA/Megatron-LM#1842", "NVIDIA-NeMo/Megatron-Bridge#4082", "NovaSky-AI/SkyRL#1401"),
        rules_out=fc.rules_out_resume_jump,
        confirm_with=("checkpoint.load_optim=false",),
        phrasings=(
            "loss jumped after resuming",
            "loss increased after loading the checkpoint",
            "loss diverged after restart",
        ),
    ),
    FailureMode(
        "checkpoint_save_assert",
        "AssertionError saving a checkpoint with optimizer offload",
        (
            r"gbuf_local_end - gbuf_local_start",
            r"AssertionError.{0,200}(?:save|checkpoint)",
            r"(?:save|checkpoint).{0,200}AssertionError",
        ),
        "torch AdamW's 0-dim 'step' tensor went through the per-bucket shape assertion of the distributed "
        "optimizer's save path (fixed in megatron-core 0.18.0, Megatron-LM PR #2874)",
        "the traceback ends in distrib_optimizer.py's state save; check `pip show megatron-core` (< 0.18.0)",
        (),
        (
            "upgrade to megatron-core >= 0.18.0 / Megatron Bridge >= 0.5.0 (Megatron-LM PR #2874)",
            "workaround until then, which writes checkpoints without the optimizer state (a resume restarts the "
            "Adam moments): checkpoint.save_optim=false",
        ),
        ("NVIDIA-NeMo/Megatron-Bridge#1942", "NVIDIA/Megatron-LM#1872"),
        rules_out=fc.rules_out_save_assert,
        phrasings=("assertion fails saving a checkpoint", "assert while saving the optimizer state"),
    ),
    FailureMode(
        "weights_only_load",
        "torch.load(weights_only=True) rejects the optimizer checkpoint",
        (r"Weights only load failed", r"WeightsUnpickler error", r"Unsupported global: GLOBAL torch\.optim"),
        "PyTorch >= 2.6 loads with weights_only=True by default, and the HybridDeviceOptimizer's param groups "
        "carry the optimizer classes (cpu_optimizer_cls/gpu_optimizer_cls) as pickled objects",
        "the error names a GLOBAL like torch.optim.adamw.AdamW",
        (),
        (
            "for a checkpoint you trust: torch.serialization.add_safe_globals([torch.optim.AdamW, torch.optim.SGD]) "
            "before loading, or torch.load(..., weights_only=False)",
        ),
        ("NovaSky-AI/SkyRL#1401",),
        phrasings=("weights_only load fails", "unpickling fails"),
    ),
    FailureMode(
        "fp32_master_keyerror",
        "KeyError restoring fp32 masters",
        (r"_update_fp32_params_by_new_state",),
        "native-fp32 parameters have no separate fp32 master, and older megatron-core looked them up anyway "
        "(fixed by Megatron-LM PR #5929)",
        "the traceback ends in hybrid_optimizer.py _update_fp32_params_by_new_state with a KeyError",
        (),
        ("upgrade megatron-core past PR #5929",),
        ("NovaSky-AI/SkyRL#1401",),
    ),
    FailureMode(
        "pinned_memory",
        "Pinned host memory could not be allocated",
        (
            r"pin_memory",
            r"cudaHostAlloc",
            r"cudaErrorInvalidValue",
            r"memlock",
            r"RLIMIT_MEMLOCK",
            r"ulimit -l",
            r"cannot (?:allocate|register) (?:pinned|page-locked)",
            r"page-locked",
        ),
        "offloaded optimizer states, CPU grads and activation buffers are pinned (page-locked); the container's "
        "memlock limit or the host RAM is too small for them",
        "`ulimit -l` inside the container (should be unlimited); `free -g` during the run",
        lambda cfg, _m: fc.fix_pinned(cfg),
        ("or run the container with --ulimit memlock=-1, or lower optimizer_offload_fraction",),
        ("verl-project/verl#6690",),
        phrasings=("cannot pin host memory", "memlock limit too low", "page-locked memory fails"),
    ),
    FailureMode(
        "host_oom",
        "The host ran out of memory",
        (r"Cannot allocate memory", r"oom-kill", r"Out of memory: Killed process", r"\bKilled\b"),
        "offloaded state lives in host RAM (~16 bytes per offloaded parameter, pinned) shared by all GPUs of the node",
        "`dmesg | grep -i oom` on the node; `mbridge-offload estimate` reports host_gb",
        _fix_slowdown,
        ("give the job more host memory or fewer GPUs per node",),
        phrasings=(
            "host ran out of memory",
            "host memory exhausted",
            "process killed by the kernel",
            "node RAM exhausted",
        ),
    ),
    FailureMode(
        "fsdp_save_hang",
        "Checkpoint save hangs with Megatron-FSDP and optimizer offload",
        (r"hang.{0,80}(?:save|checkpoint)", r"(?:save|checkpoint).{0,80}hang"),
        "Megatron-FSDP's optimizer checkpoint save with optimizer_cpu_offload=True can hang (Megatron-LM#4910)",
        "the hang is in the optimizer state save: py-spy dump shows the ranks in the optimizer checkpoint save, "
        "and one save with checkpoint.save_optim=false completes",
        (
            "ddp.use_megatron_fsdp=false",
            "ddp.use_distributed_optimizer=true",
            "optimizer.use_distributed_optimizer=true",
        ),
        (
            "the distributed optimizer saves the offloaded state without the hang; Megatron-LM PR #4623 fixed the "
            "small reproducer (a full Qwen3.5-35B-A3B still hung)",
            "workaround that writes checkpoints without the optimizer state: checkpoint.save_optim=false",
        ),
        ("NVIDIA/Megatron-LM#4910",),
        rules_out=fc.rules_out_fsdp,
        confirm_with=("checkpoint.save_optim=false",),
        phrasings=("checkpoint save hangs", "stuck saving the optimizer state"),
    ),
    FailureMode(
        "stale_grad_reapplied",
        "Grad-less parameter updated with a stale gradient",
        (
            r"stale grad\w*.{0,200}(?:hybrid|offload|HybridDeviceOptimizer)",
            r"(?:hybrid|offload|HybridDeviceOptimizer).{0,200}stale grad\w*",
            r"_set_sub_optimizer_grads",
        ),
        "megatron-core's HybridDeviceOptimizer keeps each inner parameter's .grad from the last step; when the "
        "model parameter has no gradient it only sets requires_grad=False, and torch's Adam skips a parameter only "
        "when .grad is None, so the previous step's gradient is applied again (MoE experts that got no tokens, "
        "unused or conditional branches)",
        "compare a parameter whose .grad is None in a step before and after optimizer.step(): it must not change",
        (),
        (
            "upgrade megatron-core past Megatron-LM PR #7551 (open, 2026-09; also PR #6871), which clears the cached "
            "grads; this project's HybridDeviceOptimizer already skips parameters without a gradient "
            "(install_optimizer_offload; tests/runtime/test_optimizer_stale_grad.py is the regression test)",
            "or turn optimizer offload off (optimizer.optimizer_cpu_offload=false)",
        ),
        ("NVIDIA/Megatron-LM#7551", "NVIDIA/Megatron-LM#6871"),
        rules_out=fc.rules_out_save_assert,
        explain=fc.explain_stale_grad,
        phrasings=(
            "a parameter with no gradient is still updated with the stale gradient",
            "experts that get no tokens still change with optimizer offload",
            "the previous step's gradient is applied again to unused experts",
        ),
    ),
    FailureMode(
        "fused_adam_cpu_tensors",
        "GPU-only fused Adam on CPU tensors (NaN, no error)",
        (
            r"FusedAdam.{0,300}\bcpu",
            r"\bcpu.{0,300}FusedAdam",
            r"multi_tensor_apply.{0,200}\bcpu",
        ),
        "a GPU-only fused Adam (Transformer Engine's or Apex's FusedAdam) steps tensors that live on the CPU "
        "(CPU-offloaded optimizer states or parameters): it may raise nothing and write garbage, so exp_avg is "
        "poisoned and the loss turns NaN, often right after a resume",
        "check which optimizer class steps the host-resident tensors: print type(sub) for every sub-optimizer and "
        "the device of its parameters; it must be torch.optim.AdamW (CPU fused) for CPU tensors",
        ("optimizer.use_torch_optimizer_for_cpu_offload=true",),
        (
            "megatron-core's HDO uses torch.optim.AdamW for its CPU part; a GPU-only class passed as "
            "cpu_optimizer_cls (or FSDP2/DTensor cpu_offload with TE FusedAdam, NeMo-RL#3544) must be replaced "
            "by torch's Adam/AdamW, or offload turned off",
        ),
        ("NVIDIA-NeMo/RL#3544",),
        supersedes=(
            (
                "resume_loss_jump",
                "the NaN comes from a GPU-only fused Adam stepping host tensors (fused_adam_cpu_tensors), not from "
                "the state restore: checkpoint.load_optim=false only hides it until the moments are rebuilt",
            ),
            ("slowdown", "the text reports NaN values, not a longer step time"),
        ),
        phrasings=(
            "fused Adam with CPU offloaded states gives NaN loss",
            "exp_avg poisoned after resume with fused Adam and CPU offload",
            "the fused optimizer runs on CPU tensors and the loss becomes NaN",
        ),
    ),
    FailureMode(
        "precision_dtypes_ignored",
        "Offload ignores precision-aware state dtypes",
        (
            r"exp_avg(?:_sq)?_dtype.{0,200}(?:fp32|float32|ignored|not honou?red)",
            r"main_params_dtype.{0,200}(?:fp32|float32|ignored|not honou?red)",
        ),
        "with optimizer_cpu_offload, megatron-core's factory builds the HybridDeviceOptimizer with "
        "param_update_in_fp32=True and never passes main_params_dtype / exp_avg_dtype / exp_avg_sq_dtype, and "
        "torch AdamW creates its moments like the fp32 master: all three states are fp32 whatever the config asks",
        "after one step, print {k: v.dtype for k, v in sub.state[p].items()} for a sub-optimizer of the HDO: "
        "fp32 although the config says bf16/fp16",
        (
            "optimizer.main_params_dtype=fp32",
            "optimizer.exp_avg_dtype=fp32",
            "optimizer.exp_avg_sq_dtype=fp32",
        ),
        (
            "the overrides make the config say what runs, so memory estimates (`mbridge-offload estimate`) count "
            "fp32 states on the host; lower-precision offloaded states need a megatron-core with the dtypes passed "
            "through (radixark/Megatron-LM PR #67; MCore dev branch commit bcc46a5f29)",
        ),
        ("radixark/Megatron-LM#67",),
        rules_out=fc.rules_out_precision_dtypes,
        explain=fc.explain_precision_dtypes,
        phrasings=(
            "optimizer states stay fp32 with offload although exp_avg_dtype is bf16",
            "precision-aware dtypes are ignored with optimizer CPU offload",
            "offloaded optimizer moments are float32 instead of bf16",
        ),
    ),
)


# A GPU OOM that neither the text nor a config attributes to a mechanism: no fix is guessed (advising to switch off
# something nobody said was on would mislead); the report asks for what tells the readings apart.
OOM_UNATTRIBUTED = FailureMode(
    "oom_unattributed",
    "GPU out of memory (which offload is on is not known yet)",
    _OOM,
    "the text shows a GPU out-of-memory error, but neither it nor a config says whether activation offloading, "
    "optimizer offloading (and at which fraction) or nothing is offloaded; each has a different fix",
    "pass the run's config (`--config FILE`; MCP: config) or the log lines that show the offload settings: diagnose "
    "then tells the activation-offload, partial/full optimizer-offload and no-offload readings apart",
    (),
    (
        "`mbridge-offload estimate CONFIG` shows where the per-GPU memory goes; `mbridge-offload recommend CONFIG` "
        "picks the smallest offload that fits",
    ),
    needs=(
        "the failing run's config (--config FILE, MCP config): which offloads are on decides the reading and the fix",
        "the log around the OOM (--log FILE): the allocation that failed and the step it happened at",
    ),
)


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
