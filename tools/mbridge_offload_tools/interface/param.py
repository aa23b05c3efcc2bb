"""One input of a tool, declared once: the MCP parameter and the CLI flag of the same name are built from it.

A :class:`Param` holds what both sides need: the name, the value's type, its bounds, its default and its help. The
CLI flag follows from the name by one rule, ``snake_case`` → ``--kebab-case``, with the exceptions of
:data:`SPELLINGS` (and ``config``, the positional ``CONFIG`` where a tool's main input is a config). Older CLI
spellings stay accepted as ``aliases``; flags only the CLI has (``--json``) are :class:`CliOnly`, each with the
reason the MCP tool has no such parameter.
"""

from __future__ import annotations

import functools
import math
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError

from mbridge_offload.config.errors import InputError

# The only CLI spellings that are not the parameter's name in kebab case (docs/mcp.md says so; a test holds it).
SPELLINGS: dict[str, str] = {"overrides": "--set", "k": "-k", "timeout_s": "--timeout", "overwrite": "--force"}
BOUND_NAMES = ("gt", "ge", "lt", "le", "min_length", "max_length")
_SIGNS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "min_length": "length >=", "max_length": "length <="}


@dataclass(frozen=True)
class Param:
    """One parameter of an MCP tool, which is also the flag of the same name on the matching subcommand.

    Attributes:
        name: the MCP parameter and the argparse ``dest``.
        kind: the value's type without ``None``: ``str``, ``int``, ``float``, ``bool``, ``list[str]`` or a
            ``Literal`` of choices.
        help: what it means, in the user's words (the bounds are added to it).
        default: the value when not given, on both sides (``None`` = not given).
        required: no default: the MCP call must pass it; on the CLI a required positional.
        bounds: ``(name, value)`` pairs of pydantic's ``gt``/``ge``/``lt``/``le``/``min_length``/``max_length``.
        positional: the CLI takes it as the positional ``CONFIG`` (only ``config`` may).
        aliases: older CLI spellings, still accepted (the help names them beside the new flag).
        metavar: how the CLI help shows the value.
        per_flag: a list the CLI takes one value per flag (``--modules a,b --modules c``) instead of several after
            one flag (``--levers a b``); either way the values reach the tool as the MCP list would.
        group: the ``--help`` section (the planner's input groups, or a tool's own, e.g. plot's picture).
    """

    name: str
    kind: Any
    help: str
    default: Any = None
    required: bool = False
    bounds: tuple[tuple[str, Any], ...] = ()
    positional: bool = False
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    per_flag: bool = False
    group: str | None = None

    def __post_init__(self) -> None:
        if self.positional and self.name != "config":
            raise ValueError(f"{self.name}: only config is a positional CONFIG (the one spelling rule)")
        unknown = [b for b, _ in self.bounds if b not in BOUND_NAMES]
        if unknown:
            raise ValueError(f"{self.name}: unknown bounds {unknown}")

    # ------------------------------------------------------------------------------------------ names

    @property
    def flag(self) -> str:
        """The CLI spelling: ``CONFIG`` for the positional, else ``--kebab-case`` or the :data:`SPELLINGS` one."""
        if self.positional:
            return "CONFIG"
        return SPELLINGS.get(self.name, "--" + self.name.replace("_", "-"))

    @property
    def is_list(self) -> bool:
        return typing.get_origin(self.kind) is list

    @property
    def choices(self) -> tuple[Any, ...] | None:
        return typing.get_args(self.kind) if typing.get_origin(self.kind) is Literal else None

    @property
    def optional(self) -> bool:
        """``None`` is a value of it (not given): the MCP type is ``X | None``."""
        return self.default is None and not self.required

    # ------------------------------------------------------------------------------------------ texts

    def bounds_text(self) -> str:
        """``>= 1, <= 65536`` (empty without bounds), as the planner's inputs write theirs."""
        return ", ".join(
            f"{_SIGNS[b]} {v:g}" if isinstance(v, (int, float)) else f"{_SIGNS[b]} {v}" for b, v in self.bounds
        )

    @property
    def description(self) -> str:
        """The help with the bounds: the MCP parameter's description and the CLI flag's help."""
        bounds = self.bounds_text()
        return self.help + (f" [{bounds}]" if bounds else "")

    # ------------------------------------------------------------------------------------------ types

    @property
    def annotation(self) -> Any:
        """The MCP parameter's type: the value type with its bounds, ``| None`` when optional, the description.

        Floats refuse NaN and infinity (as the planner's inputs do).
        """
        constraints: dict[str, Any] = dict(self.bounds)
        if self.kind is float:
            constraints["allow_inf_nan"] = False
        inner: Any = Annotated[self.kind, Field(**constraints)] if constraints else self.kind
        outer: Any = inner | None if self.optional else inner
        return Annotated[outer, Field(description=self.description)]

    def check(self, value: Any) -> Any:
        """A value the CLI parsed, held to the bounds the MCP schema enforces (``None``, not given, passes).

        Raises:
            InputError: ``--flag = value (flag): what is wrong`` (the planner's own wording for its inputs).
        """
        if value is None or not (self.bounds or self.kind is float):
            return value
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"{self.flag} = {value!r} (flag): must be a finite number")
        try:
            return _adapter(self.kind, self.bounds).validate_python(value)
        except ValidationError as exc:
            text = exc.errors()[0]["msg"]
            raise InputError(f"{self.flag} = {value!r} (flag): {text[0].lower() + text[1:]}") from None


@functools.cache
def _adapter(kind: Any, bounds: tuple[tuple[str, Any], ...]) -> TypeAdapter[Any]:
    return TypeAdapter(Annotated[kind, Field(**dict(bounds))])


def bounds(**given: Any) -> tuple[tuple[str, Any], ...]:
    """``bounds(ge=1, le=10)`` → the pairs a :class:`Param` holds."""
    return tuple(given.items())


@dataclass(frozen=True)
class CliOnly:
    """A flag only the CLI has, and why the MCP tool has no such parameter.

    Attributes:
        flags: its spellings.
        why: the reason (an output format, a containment the server sets at its start, an older spelling).
        options: the argparse keywords (``action``, ``metavar``, ``help``...).
        alias_of: the parameter it spells another way (``--model-config`` = ``config``), if any.
        value: the value it gives that parameter (``--all`` = ``suite="full"``); ``None``: the flag's own value.
    """

    flags: tuple[str, ...]
    why: str
    options: tuple[tuple[str, Any], ...] = ()
    alias_of: str | None = None
    value: Any = None

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")


JSON_FLAG = CliOnly(
    ("--json",),
    "an output format: an MCP tool always answers structured content",
    (("action", "store_true"), ("help", "print exactly one JSON object")),
)


@dataclass(frozen=True)
class Tool:
    """An MCP tool and its subcommand: the parameters both take, and the flags only the CLI has."""

    name: str
    command: str
    params: tuple[Param, ...]
    cli_only: tuple[CliOnly, ...] = (JSON_FLAG,)

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: a parameter is declared twice: {names}")

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"{self.name} has no parameter {name!r}")
