"""Both sides of one declaration (``TOOLS``): a subcommand (its flags, help, description) and an MCP tool's signature.

Imports neither the MCP SDK nor the library's heavy parts: the CLI builds its parser from here.
"""

from __future__ import annotations

import argparse
import copy
import functools
import inspect
from collections.abc import Callable
from typing import Any

from mbridge_offload.config.errors import InputError
from mbridge_offload_tools.interface.param import CliOnly, Param, Tool
from mbridge_offload_tools.interface.tools import BY_COMMAND, TOOLS

# ---------------------------------------------------------------------------------------------- the CLI


def _help(p: Param) -> str:
    text = p.description
    if p.aliases:
        text += f" ({', '.join(p.aliases)}: the older spelling of {p.flag})"
    return text.replace("%", "%%")  # argparse formats help with %


def _argparse_options(p: Param) -> dict[str, Any]:
    """The argparse keywords of one parameter's flag (type, choices, arity; never the bounds: :func:`finish`)."""
    options: dict[str, Any] = {"dest": p.name, "default": copy.copy(p.default), "help": _help(p)}
    if p.kind is bool:
        options["action"] = "store_true" if p.default is False else argparse.BooleanOptionalAction
        return options
    if p.choices is not None:
        options["choices"] = list(p.choices)
    elif p.is_list:
        options.update(action="append" if p.per_flag else "extend", nargs=None if p.per_flag else "+")
    else:
        options["type"] = p.kind
    if p.metavar is not None:
        options["metavar"] = p.metavar
    return options


def add_command(sub: Any, tool: str, handler: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """The subcommand of the MCP tool ``tool``: its line in the command list, the tool's description and flags."""
    spec = TOOLS[tool]
    description = inspect.cleandoc(spec.description).replace("%", "%%")  # argparse formats help with %
    parser: argparse.ArgumentParser = sub.add_parser(spec.command, help=spec.help, description=description)
    add_arguments(parser, tool)
    parser.set_defaults(handler=handler)
    return parser


def add_arguments(parser: argparse.ArgumentParser, tool: str) -> None:
    """Add the declared parameters of ``tool`` (an MCP tool name) and its CLI-only flags to ``parser``."""
    spec = TOOLS[tool]
    groups: dict[str, Any] = {}
    for p in spec.params:
        if p.positional:
            parser.add_argument(
                "config", nargs=None if p.required else "?", metavar="CONFIG", default=None, help=_help(p)
            )
            continue
        where: Any = parser
        if p.group is not None:  # the planner's inputs: one --help section per group
            where = groups.setdefault(p.group, parser.add_argument_group(f"{p.group} inputs"))
        where.add_argument(p.flag, *p.aliases, **_argparse_options(p))
    for c in spec.cli_only:
        parser.add_argument(*c.flags, dest=c.dest, **dict(c.options))


def _fold_alias(args: argparse.Namespace, spec: Tool, c: CliOnly) -> None:
    """Give the parameter ``c`` spells another way the value of ``c`` (refusing two different answers)."""
    given = getattr(args, c.dest, None)
    if c.alias_of is None or given in (None, False):
        return
    p = spec.param(c.alias_of)
    value = given if c.value is None else c.value
    current = getattr(args, p.name)
    if current not in (p.default, value):
        raise InputError(f"{c.flags[0]} is the older spelling of {p.flag} {value}: give one of them, not both")
    setattr(args, p.name, value)


def finish(args: argparse.Namespace) -> None:
    """After argparse: older spellings folded into their parameter, every value held to its declared bounds (an
    InputError, exit 2, where two spellings disagree or a value is out of bounds)."""
    spec = BY_COMMAND.get(getattr(args, "command", ""))
    if spec is None:
        return
    for c in spec.cli_only:
        _fold_alias(args, spec, c)
    for p in spec.params:
        setattr(args, p.name, p.check(getattr(args, p.name)))


def values(args: argparse.Namespace, tool: str) -> dict[str, Any]:
    """The parsed flags of ``tool``'s subcommand as the MCP tool receives its arguments: name → value."""
    return {p.name: getattr(args, p.name) for p in TOOLS[tool].params}


# ---------------------------------------------------------------------------------------------- MCP


def mcp_parameters(tool: str) -> list[inspect.Parameter]:
    """The MCP tool's parameters: keyword-only, each with its declared type, bounds, default and description."""
    kw = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter(p.name, kw, annotation=p.annotation)
        if p.required
        else inspect.Parameter(p.name, kw, default=p.default, annotation=p.annotation)
        for p in TOOLS[tool].params
    ]


def declared(tool: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``fn(**v)`` (or ``fn(ctx, **v)``, ``ctx`` the MCP context) with the declared signature of the MCP
    tool ``tool``; a call that leaves a parameter out (a direct Python call) gets its declared default."""
    spec = TOOLS[tool]

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(fn, eval_str=True)
        front = [p.replace(kind=p.KEYWORD_ONLY) for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            for p in spec.params:
                if p.name not in kwargs and not p.required:
                    kwargs[p.name] = copy.copy(p.default)
            return fn(*args, **kwargs)

        signature = inspect.Signature([*front, *mcp_parameters(tool)], return_annotation=own.return_annotation)
        call.__signature__ = signature  # type: ignore[attr-defined]
        return call

    return wrap
