"""The rule catalogue: every check on a CPU-offloading config, as data plus a small check function.

Modelled on ruff's registry. A rule's ``applies_to`` is a specifier on megatron-core; the supported targets are the
releases checked by running real code (``tests/config/test_differential.py``): 0.16.1 and 0.19.2, plus ``main``
(read, not run), each paired with its Bridge release. No torch, no megatron.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from mbridge_offload.config.schema import OffloadConfig

Severity = Literal["error", "warning", "info"]
Origin = Literal["mcore", "te", "bridge", "megatron-lm", "advisory"]

SEVERITIES: tuple[str, ...] = ("error", "warning", "info")
ORIGINS: tuple[str, ...] = ("mcore", "te", "bridge", "megatron-lm", "advisory")

# Where upstream enforces a rule. The differential test compares the first error per stage with real code.
STAGE_TRANSFORMER_CONFIG = "TransformerConfig.__post_init__"
STAGE_OPTIMIZER_CONFIG = "OptimizerConfig.__post_init__"
STAGE_OPTIMIZER_FACTORY = "get_megatron_optimizer"
STAGE_TE = "Transformer Engine get_cpu_offload_context (model build)"
STAGE_BRIDGE = "Megatron Bridge ConfigContainer.validate / layer build"
STAGE_MLM = "Megatron-LM validate_args"
STAGE_ADVISORY = "not enforced upstream"
# After every config check and the build: megatron-core's own code failing at the first optimizer step.
STAGE_FIRST_STEP = "megatron-core's first optimizer step"

# ---------------------------------------------------------------------------------------------- versions

Version = tuple[int, int, int]


@dataclass(frozen=True)
class Target:
    """The upstream release a config is validated against."""

    package: str
    version: Version
    label: str
    bridge: str

    def __str__(self) -> str:
        return f"{self.package}=={self.label}"


TARGETS: dict[str, Target] = {
    "0.16.1": Target("megatron-core", (0, 16, 1), "0.16.1", "megatron-bridge 0.3.x"),
    "0.19.2": Target("megatron-core", (0, 19, 2), "0.19.2", "megatron-bridge 0.6.x"),
    # HEAD as read for the reference (NVIDIA/Megatron-LM d98e8a64dd); ordered after every release.
    "main": Target("megatron-core", (0, 20, 0), "main", "megatron-bridge HEAD"),
}
_TARGET_ALIASES = {"0.16": "0.16.1", "0.19": "0.19.2", "head": "main"}
DEFAULT_TARGET = "megatron-core==0.19.2"


def parse_target(text: str | Target) -> Target:
    """``"megatron-core==0.16.1"`` (or ``0.16``, ``0.19.2``, ``main``) → :class:`Target` (else ValueError)."""
    if isinstance(text, Target):
        return text
    spec = str(text).strip()
    package, sep, version = spec.partition("==")
    if not sep:
        package, version = "megatron-core", spec
    package, version = package.strip().lower().replace("_", "-"), version.strip().lower()
    key = _TARGET_ALIASES.get(version, version)
    if package not in {"megatron-core", "mcore"} or key not in TARGETS:
        supported = ", ".join(f"megatron-core=={name}" for name in TARGETS)
        raise ValueError(f"unsupported target {spec!r}: use one of {supported}")
    return TARGETS[key]


def _version(text: str) -> Version:
    parts = [int(p) for p in re.findall(r"\d+", text)[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


_OPS: dict[str, Callable[[Version, Version], bool]] = {
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
}


def spec_contains(spec: str, version: Version) -> bool:
    """``spec_contains(">=0.19,<0.20", (0, 19, 2))`` → True. An empty spec contains every version."""
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op = next(o for o in (">=", "<=", "==", "!=", ">", "<") if clause.startswith(o))
        if not _OPS[op](version, _version(clause[len(op) :])):
            return False
    return True


# ---------------------------------------------------------------------------------------------- context


# The Transformer Engine release Megatron Bridge 0.6.2 pins: its release branch (r0.6.0, which 0.6.0-0.6.2 are cut
# from) locks transformer-engine 2.17.1+4329ff84 in uv.lock; Bridge's main branch locks 2.18.0, not released as 0.6.x.
TE_VERSION_ASSUMED = "2.17.1"


def nvte_cpu_offload_v1(config: OffloadConfig, raw: dict[str, Any]) -> str:
    """``NVTE_CPU_OFFLOAD_V1`` as the job sees it: the caller's environment (``--env``) first, else the config's
    ``env_vars``, which Bridge applies at start-up with ``os.environ.setdefault(name, str(value))``; else "0"."""
    if "NVTE_CPU_OFFLOAD_V1" in config.env:
        return str(config.env["NVTE_CPU_OFFLOAD_V1"])
    env_vars = raw.get("env_vars") if isinstance(raw, dict) else None
    if isinstance(env_vars, dict) and "NVTE_CPU_OFFLOAD_V1" in env_vars:
        return str(env_vars["NVTE_CPU_OFFLOAD_V1"])
    return "0"


@dataclass
class Context:
    """What a check function sees: the typed config, the raw dict, the target and environment facts."""

    config: OffloadConfig
    raw: dict[str, Any]
    target: Target
    # What Megatron Bridge's finalize() changed before megatron-core's checks: (key, as written, as Bridge sets it).
    normalized: tuple[tuple[str, Any, Any], ...] = ()
    # Whether the config is a Megatron Bridge ConfigContainer (config.bridge.is_container): its validate() applies.
    container: bool = False

    @property
    def model(self):
        return self.config.model

    @property
    def opt(self):
        return self.config.optimizer

    def seen(self, dotted: str) -> Any:
        """The value megatron-core sees for ``dotted``: as the user wrote it (``'false'``, ``"2"``), else the default.

        megatron-core's dataclasses do not convert types, and its messages print the values as given.
        """
        section, _, key = dotted.partition(".")
        body = self.raw.get(section) if isinstance(self.raw, dict) else None
        if isinstance(body, dict) and key in body:
            return body[key]
        return getattr(getattr(self.config, section), key, None)

    @property
    def frontend(self) -> str:
        return self.config.env.get("frontend", "bridge")

    @property
    def te_version(self) -> Version:
        return _version(str(self.config.env.get("te_version", TE_VERSION_ASSUMED)))

    @property
    def nvte_cpu_offload_v1(self) -> bool:
        return nvte_cpu_offload_v1(self.config, self.raw) == "1"

    @property
    def te_offload_path(self) -> str:
        """``v1`` (legacy, TE < 2.10 or NVTE_CPU_OFFLOAD_V1=1) or ``v2`` (TE ≥ 2.10 default)."""
        return "v1" if self.te_version < (2, 10, 0) or self.nvte_cpu_offload_v1 else "v2"

    @property
    def cuda_graph_impl(self) -> str | None:
        """The implementation MCore ends up with: the deprecated ``enable_cuda_graph`` maps to ``local`` and
        ``external_cuda_graph`` to ``transformer_engine`` (transformer_config.py, both releases)."""
        impl = self.model.cuda_graph_impl
        if impl == "none" and self.model.enable_cuda_graph:
            impl = "local"
        elif impl == "none" and self.model.external_cuda_graph:
            impl = "transformer_engine"
        # 0.19 migrates the deprecated scope "full_iteration" (cuda_graph_scope / cuda_graph_modules) to
        # cuda_graph_impl="full_iteration" when the impl is none or local (cuda_graph_config.py).
        if self.target.version >= (0, 19, 0) and impl in ("none", "local") and "full_iteration" in self._scopes():
            return "full_iteration"
        return impl

    def _scopes(self) -> list[str]:
        names: list[str] = []
        for value in (self.model.cuda_graph_scope, self.model.extras().get("cuda_graph_modules")):
            items = value if isinstance(value, list) else [value] if isinstance(value, str) else []
            names.extend(str(v).strip() for item in items for v in str(item).split(","))
        return names

    @property
    def cuda_graph_modules(self) -> list[str]:
        """0.19's ``cuda_graph_modules`` as normalised: ``"full"``, None and ``[]`` all mean the whole layer (empty)."""
        value = self.model.extras().get("cuda_graph_modules", "full")
        if value in (None, "full", []) or value == ["full"]:
            return []
        return [str(v) for v in value] if isinstance(value, list) else [s for s in str(value).split(",") if s]

    @property
    def allowed_cuda_graph_impls(self) -> tuple[str, ...]:
        if self.target.version >= (0, 19, 0):
            return ("none", "transformer_engine", "local", "full_iteration")
        return ("none", "transformer_engine", "local")

    @property
    def distributed_optimizer(self) -> bool:
        # Bridge keeps optimizer.* and ddp.* use_distributed_optimizer in sync (either one switches it on).
        if self.frontend == "megatron-lm":
            return self.opt.use_distributed_optimizer
        return self.opt.use_distributed_optimizer or self.config.ddp.use_distributed_optimizer


# ---------------------------------------------------------------------------------------------- rules


@dataclass
class Match:
    """One hit of a rule: values for the message/fix templates, or an explicit message/fix/keys."""

    values: dict[str, Any] = field(default_factory=dict)
    message: str | None = None
    fix: list[str] | None = None
    keys: list[str] | None = None
    # The exception upstream raises for this hit when it is not the rule's own: a value of the wrong type makes
    # upstream's comparison raise a TypeError where the rule's check would raise its ValueError.
    exception: str | None = None


CheckResult = bool | Match | Iterable[Match] | None


@dataclass(frozen=True)
class Rule:
    """A check: data plus a small function.

    ``message`` is upstream's text verbatim (a ``str.format`` template; ``upstream`` False: our own, for advisory
    rules); ``upstream_text`` is the exact ``str(exception)`` where it differs (a bare ``assert`` has none); ``why``
    is our explanation, never in ``message``. ``shadowed_by``: rules that, when they fire, make this one unreachable
    upstream. ``follows``: the upstream check of another file of the same stage this one comes right after (the
    catalogue orders each stage from these).
    """

    id: str
    severity: Severity
    origin: Origin
    summary: str
    keys: tuple[str, ...]
    why: str
    check: Callable[[Context], CheckResult]
    message: str
    upstream: bool = True
    upstream_text: str | None = None
    exception: str | None = None
    stage: str = STAGE_ADVISORY
    fix: tuple[str, ...] | None = None
    applies_to: str = ""
    shadowed_by: tuple[str, ...] = ()
    follows: str | None = None

    def applies(self, target: Target) -> bool:
        return spec_contains(self.applies_to, target.version)

    def run(self, ctx: Context) -> list[Match]:
        """The matches of this rule on ``ctx`` (empty when it does not fire)."""
        result = self.check(ctx)
        if result is None or result is False:
            return []
        if result is True:
            return [Match()]
        if isinstance(result, Match):
            return [result]
        return list(result)


def advisory(**kw: Any) -> Rule:
    """Our own advice: not enforced upstream, and worded by us."""
    return Rule(origin="advisory", upstream=False, **kw)
