"""One input of a tool, declared once: the MCP parameter and the CLI flag of the same name are built from it.

The flag follows from the name, ``snake_case`` → ``--kebab-case``, except :data:`SPELLINGS` and the positional
``CONFIG``; flags only the CLI has are :class:`CliOnly`, each with the reason the MCP tool has no such parameter.
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
    """One parameter of an MCP tool, which is also the flag of the same name on the matching subcommand."""

    name: str  # the MCP parameter and the argparse dest
    kind: Any  # str, int, float, bool, list[str] or a Literal of choices (without None)
    help: str  # the bounds are added to it
    default: Any = None  # None: not given
    required: bool = False
    bounds: tuple[tuple[str, Any], ...] = ()  # pydantic's gt/ge/lt/le/min_length/max_length
    positional: bool = False  # the CLI's positional CONFIG (only config may)
    aliases: tuple[str, ...] = ()  # older CLI spellings, still accepted
    metavar: str | None = None
    per_flag: bool = False  # a list the CLI takes one value per flag (--modules a --modules b), not --levers a b
    group: str | None = None  # the --help section

    def __post_init__(self) -> None:
        if self.positional and self.name != "config":
            raise ValueError(f"{self.name}: only config is a positional CONFIG (the one spelling rule)")
        unknown = [b for b, _ in self.bounds if b not in BOUND_NAMES]
        if unknown:
            raise ValueError(f"{self.name}: unknown bounds {unknown}")

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
        """The MCP type is ``X | None``."""
        return self.default is None and not self.required

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

    @property
    def annotation(self) -> Any:
        """The MCP parameter's type: the value type with its bounds (floats finite), ``| None``, the description."""
        constraints: dict[str, Any] = dict(self.bounds)
        if self.kind is float:
            constraints["allow_inf_nan"] = False
        inner: Any = Annotated[self.kind, Field(**constraints)] if constraints else self.kind
        outer: Any = inner | None if self.optional else inner
        return Annotated[outer, Field(description=self.description)]

    def check(self, value: Any) -> Any:
        """A value the CLI parsed, held to the bounds the MCP schema enforces (InputError in the planner's words)."""
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
    """A flag only the CLI has, and why the MCP tool has no such parameter."""

    flags: tuple[str, ...]
    why: str
    options: tuple[tuple[str, Any], ...] = ()  # argparse keywords
    alias_of: str | None = None  # the parameter it spells another way (--model-config: config)
    value: Any = None  # the value it gives that parameter (--all: suite="full"); None: the flag's own

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
    title: str = ""  # the MCP tool's title
    help: str = ""  # the subcommand's line in ``mbridge-offload --help``
    # The MCP tool's description, written as its docstring was (the indented lines are the bytes an agent reads),
    # and the subcommand's --help text: one description for both.
    description: str = ""

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: a parameter is declared twice: {names}")

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"{self.name} has no parameter {name!r}")
