"""Child process of validate's upstream run: build the real megatron-core configs and print what they raise.

Run as a script with the target's megatron-core first on its path (never imported: the server and the CLI stay
torch-free): one JSON config in (``{"model", "optimizer", "ddp", "te_version"}``, or ``{"batch": [...]}``), one
answer out (``{"version", "te", "errors", "skipped", "dropped", "built", "ran"}``). Keys the release's dataclasses lack
are dropped. Without Transformer Engine, megatron-core's TE version checks are answered for ``te_version`` so that the
checks after them run, and a check that needs TE itself is skipped; each is listed in ``skipped``, never an error.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import sys
import traceback
import warnings

_DTYPE_FIELDS = {"pipeline_dtype", "params_dtype", "main_grads_dtype", "main_params_dtype", "exp_avg_dtype"}
_DTYPE_FIELDS |= {"exp_avg_sq_dtype", "autocast_dtype", "grad_reduce_in_fp32_dtype"}
_SHORT = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float": "float32", "half": "float16"}
_TE_VERSION_FUNCS = ("get_te_version", "is_te_min_version")
# The config side's TE_VERSION_ASSUMED, written out: this child imports nothing of ours (it may run in another
# release's environment); tests/tools/test_validate_exact.py holds the two together.
ASSUMED_TE = "2.17.1"
# A check that asks for TE by name (e.g. "apply_rope_fusion is not available. Please install TE >= 1.4.", raised
# because TE's fused kernels are absent) when no TE version check of that stage answered "too old".
# Not a message that names TE as a setting ("transformer_engine CUDA graph implementation", "use_transformer_engine_op_
# fuser"): those are the config's own refusals.
_TE_MESSAGE = re.compile(r"install TE\b|(Transformer ?Engine|TE)\b[^.]*\bnot (installed|available|present)", re.I)
_NO_TE = "Transformer Engine is not installed here (it cannot be on a CPU machine)"


class _TEChecks:
    """The TE version checks megatron-core asked while TE is absent, answered for the assumed release."""

    def __init__(self, assumed: str) -> None:
        self.stage = ""
        self.asked: dict[str, list[str]] = {}
        self.failed: dict[str, list[str]] = {}
        self.reset(assumed)

    def reset(self, assumed: str) -> None:
        """Answer for ``assumed`` from now on, nothing asked yet (one config of a batch)."""
        from packaging.version import Version

        self.version, self.assumed = Version(assumed), assumed
        self.asked.clear()
        self.failed.clear()

    def _note(self, call: str) -> None:
        calls = self.asked.setdefault(self.stage, [])
        if call not in calls:
            calls.append(call)

    def get_te_version(self):
        self._note("get_te_version()")
        return self.version

    def is_te_min_version(self, version, check_equality=True):
        from packaging.version import Version

        call = f"is_te_min_version({version!r})"
        self._note(call)
        ok = self.version >= Version(version) if check_equality else self.version > Version(version)
        if not ok:
            self.failed.setdefault(self.stage, []).append(call)
        return ok

    def install(self) -> None:
        """Replace megatron-core's TE version functions wherever its modules imported them."""
        import megatron.core.utils as utils

        originals = {name: getattr(utils, name, None) for name in _TE_VERSION_FUNCS}
        for module in list(sys.modules.values()):
            if not getattr(module, "__name__", "").startswith("megatron.core"):
                continue
            for name, original in originals.items():
                if original is not None and getattr(module, name, None) is original:
                    setattr(module, name, getattr(self, name))


def _resolve(name: str):
    """``torch.nn.functional.silu`` → the object; only names under torch and megatron.core are imported."""
    import importlib

    if not name.startswith(("torch.", "megatron.core.")):
        return name
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return name


def _value(torch, key: str, value):
    """Bridge's YAML writes dtypes and functions as {_target_: torch.bfloat16, _call_: false}; dtype fields may also
    hold short names."""
    if isinstance(value, dict) and "_target_" in value:
        if value.get("_call_", True) is False and isinstance(value["_target_"], str):
            value = _resolve(value["_target_"])
        else:
            value = value["_target_"]
    if key in _DTYPE_FIELDS and isinstance(value, str):
        name = value.removeprefix("torch.")
        return getattr(torch, _SHORT.get(name, name), value)
    return value


def _needs_te(exc: BaseException) -> bool:
    """Whether ``exc`` comes from TE's absence: an import from transformer_engine, or a TE version function."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ImportError) and (e.name or "").split(".")[0] == "transformer_engine":
            return True
        if any(
            frame.name in (*_TE_VERSION_FUNCS, "get_te_version_str") for frame in traceback.extract_tb(e.__traceback__)
        ):
            return True
        todo += [e.__cause__, e.__context__]
    return False


def _build(torch, cls, body: dict, stage: str, out: dict, te: _TEChecks | None):
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: _value(torch, k, v) for k, v in body.items() if k in fields}
    out["dropped"] += sorted(f"{stage}:{k}" for k in body if k not in fields and not k.startswith("_"))
    out["ran"].append(stage)
    if te is not None:
        te.stage = stage
    try:
        built = cls(**kwargs)
    except Exception as exc:  # every error megatron-core raises is the answer, except TE's absence
        if te is not None and (_needs_te(exc) or (_TE_MESSAGE.search(str(exc)) and not te.failed.get(stage))):
            out["skipped"].append(
                f"{stage}: the check that raised {type(exc).__name__}({str(exc)!r}) needs Transformer Engine itself; "
                f"{_NO_TE}, so it was skipped (the checks before it ran)"
            )
        else:
            out["errors"].append({"stage": stage, "type": type(exc).__name__, "message": str(exc)})
        built = None
    if te is not None and te.asked.get(stage):
        out["skipped"].append(
            f"{stage}: megatron-core's TE version checks ({', '.join(te.asked[stage])}) not run against an installed "
            f"TE: {_NO_TE}; answered for TE {te.assumed} (assumed, as in env.te_version; pass --te-version "
            "X.Y, MCP te_version, for another) so that the checks after them ran"
        )
    return built


def _judge(torch, classes, data: dict, te: _TEChecks | None, have_te: bool) -> dict:
    """What megatron-core raises building one config's sections (``data``: model, optimizer, ddp)."""
    import megatron.core

    transformer, optimizer, ddp, mla = classes
    out: dict = {
        "version": megatron.core.__version__.split("+")[0],
        "path": next(iter(megatron.core.__path__)),
        "te": None,
        "errors": [],
        "skipped": [],
        "dropped": [],
        "built": False,
        "ran": [],
    }
    if have_te:
        from importlib.metadata import PackageNotFoundError, version

        try:
            out["te"] = version("transformer-engine")
        except PackageNotFoundError:
            out["te"] = "unknown"
    if te is not None:
        te.reset(str(data.get("te_version") or ASSUMED_TE))
    model = data.get("model") or {}
    # A size written as null is built as written (megatron-core's own TypeError answers it); only a size the config
    # leaves out (a partial YAML) skips the TransformerConfig.
    if all(k in model for k in ("num_layers", "hidden_size", "num_attention_heads")):
        cls = mla if model.get("multi_latent_attention") else transformer
        config = _build(torch, cls, model, "TransformerConfig", out, te)
        if config is not None and data.get("build", True):
            _build_model(torch, config, model, out)
    else:
        out["skipped"].append("TransformerConfig: num_layers, hidden_size and num_attention_heads are needed")
    _build(torch, optimizer, {"lr": 1e-4, **(data.get("optimizer") or {})}, "OptimizerConfig", out, te)
    _build(torch, ddp, data.get("ddp") or {}, "DistributedDataParallelConfig", out, te)
    return out


_BUILD = "GPTModel build (meta device, fake process group)"
# An error that says a kernel package is missing here (grouped_gemm, apex, TE), or a set-up step of the training
# script that a config check does not make (the CUDA-graph-safe RNG tracker), not that the config is wrong: the
# build is skipped from that layer on, and the answer says so.
_MISSING_KERNEL = re.compile(
    r"pip install|is not (available|installed)|No module named|compiled with CUDA|TE is not present|RNG tracker|"
    r"only supported by TE",  # the local spec's attention: "Context parallelism is only supported by TEDotProduct..."
    re.I,
)
_INT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")


def _size(model: dict, key: str, default: int = 1) -> int:
    value = model.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _layout(config, out: dict) -> bool:
    """Every pipeline stage's and virtual chunk's layer count and offset, as the model build asks them."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    vp = config.virtual_pipeline_model_parallel_size
    if not all(isinstance(n, int) for n in (config.pipeline_model_parallel_size, vp or 0)):
        # A size the dataclass kept as written (2.0): no stage can be counted from it; the answer says so.
        out["skipped"].append(f"{_BUILD}: the pipeline sizes are no integers, so no stage's layers were counted")
        return False
    try:
        for pp_rank in range(config.pipeline_model_parallel_size):
            # a pipeline_model_parallel_layout reads the rank from parallel_state, not from pp_rank
            parallel_state.set_pipeline_model_parallel_rank(pp_rank)
            for vp_stage in range(vp) if vp else (None,):
                try:
                    get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
                    get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
                except Exception as exc:  # the build's own refusal, verbatim
                    where = f"pipeline rank {pp_rank}" + (f", virtual stage {vp_stage}" if vp else "")
                    out["errors"].append(
                        {"stage": _BUILD, "type": type(exc).__name__, "message": str(exc).strip(), "where": where}
                    )
                    return False
    finally:
        parallel_state.set_pipeline_model_parallel_rank(None)
    return True


def _groups(model: dict, config) -> None:
    """torch's fake process group (rank 0 of a world the layout divides) and megatron-core's groups on it."""
    import math

    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    tp, pp, cp = (_size(model, k) for k in _INT_KEYS)
    ep = _size(model, "expert_model_parallel_size")
    etp = _size(model, "expert_tensor_parallel_size", tp)
    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.lcm(tp * cp, etp * ep) * pp)
    parallel_state.initialize_model_parallel(
        tp,
        pp,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        create_gloo_process_groups=False,
    )


def _model(torch, config, model: dict, out: dict) -> None:
    """Build the first pipeline stage's GPTModel (its first virtual chunk, one layer of each kind) on the meta device,
    under torch's fake process group sized for the layout: the constructors' assertions come back; no memory, no
    step."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    pp, vp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    try:
        vp_stage = 0 if vp else None
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage, pp_rank=0)
        # One layer of each kind (dense, MoE, ...): the layers of one spec run the same constructor asserts, and
        # a 48-layer MoE stage of 128 experts each takes ~1 s to build even on meta (the 50 ms warm budget).
        kinds: list = []
        for layer_spec in spec.layer_specs:
            if layer_spec not in kinds:
                kinds.append(layer_spec)
        spec.layer_specs = kinds
        kwargs = {k: model[k] for k in ("position_embedding_type", "rotary_percent", "rotary_base") if k in model}
        with torch.device("meta"):
            GPTModel(
                config,
                spec,
                vocab_size=_size(model, "vocab_size", 32000),
                max_sequence_length=_size(model, "seq_length", 4096),
                pre_process=True,
                post_process=pp == 1,
                vp_stage=vp_stage,
                **kwargs,
            )
    except Exception as exc:  # the build's own refusal, verbatim, unless a kernel package is missing here
        text = str(exc).strip()
        if _MISSING_KERNEL.search(text):
            out["skipped"].append(
                f"{_BUILD}: stopped at {type(exc).__name__}({text!r}): a kernel package this "
                "machine lacks; the checks before it ran"
            )
        else:
            out["errors"].append({"stage": _BUILD, "type": type(exc).__name__, "message": text, "where": "rank 0"})


def _build_model(torch, config, model: dict, out: dict) -> None:
    """The build-time checks of the layout: every stage's layer split, then the first stage built on meta."""
    if any(k in model for k in ("hybrid_override_pattern", "hybrid_layer_pattern", "is_hybrid_model")):
        out["skipped"].append(f"{_BUILD}: a hybrid (Mamba) model; only GPT models are built")
        return
    try:
        _groups(model, config)
    except Exception as exc:  # the groups are ours (a world sized to fit), so this is no refusal of the config
        out["skipped"].append(f"{_BUILD}: the fake process group could not be set up ({type(exc).__name__}: {exc})")
        return
    if _layout(config, out):
        # Where the weights would be initialised is no check: on the meta device, nothing is allocated or filled.
        config.use_cpu_initialization, config.perform_initialization = True, False
        if config.sequence_parallel and model.get("transformer_impl", "transformer_engine") != "local":
            # Without TE the build takes megatron-core's local spec, whose torch norms refuse sequence parallelism
            # that TE's norms take: a refusal of this machine's spec, not of the config.
            config.sequence_parallel = False
            out["skipped"].append(
                f"{_BUILD}: built with megatron-core's local layer spec ({_NO_TE}), without sequence_parallel "
                "(the local spec's torch norms refuse it; TE's take it)"
            )
        _model(torch, config, model, out)
    out["built"] = True


def main() -> None:
    """One config on stdin, one answer on stdout; ``--serve``: one a line until stdin closes (the warm worker)."""
    warnings.simplefilter("ignore")  # this process answers in JSON on stdout; megatron-core's warnings are noise
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    classes = (TransformerConfig, OptimizerConfig, DistributedDataParallelConfig, MLATransformerConfig)
    have_te = importlib.util.find_spec("transformer_engine") is not None
    te = None if have_te else _TEChecks(ASSUMED_TE)
    if te is not None:
        te.install()
    if "--serve" in sys.argv:
        print(json.dumps({"ready": True}), flush=True)
        cache: dict[str, str] = {}
        for line in sys.stdin:
            if line not in cache:
                if len(cache) > 256:
                    cache.clear()
                cache[line] = json.dumps(_answer(torch, classes, json.loads(line), te, have_te))
            print(cache[line], flush=True)
        return
    data = json.load(sys.stdin)
    json.dump(_answer(torch, classes, data, te, have_te), sys.stdout)


def _answer(torch, classes, data: dict, te, have_te: bool) -> dict:
    if isinstance(data.get("batch"), list):
        return {"batch": [_judge(torch, classes, item, te, have_te) for item in data["batch"]]}
    return _judge(torch, classes, data, te, have_te)


if __name__ == "__main__":
    main()
