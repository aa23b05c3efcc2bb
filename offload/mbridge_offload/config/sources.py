"""Read configs from where users keep them: Bridge YAML, JSON, Hydra-style overrides, Megatron-LM argv.

Everything ends as a plain nested ``dict`` (the *raw* config, unknown keys included) and an
``OffloadConfig`` built from it. Parsing uses real parsers: ruamel.yaml (round-trip, so line numbers are
known for error messages), ``json``, Hydra's own override grammar, and ``argparse`` for Megatron-LM flags.
No torch import on this path.
"""

from __future__ import annotations

import copy
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mbridge_offload.config import reading
from mbridge_offload.config.errors import DeadlineError, InputError
from mbridge_offload.config.megatron_lm import argv as megatron_lm
from mbridge_offload.config.schema import SECTIONS, OffloadConfig, refuses_non_finite


class ConfigError(InputError):
    """Bad input: the config cannot be read or does not type-check. The message is one actionable line."""


@dataclass
class LoadedConfig:
    raw: dict[str, Any]
    config: OffloadConfig
    source: str
    overrides: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- text


def _yaml():
    from ruamel.yaml import YAML

    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    return yaml


def to_plain(node: Any, budget: reading.Budget | None = None, depth: int = 0, path: str = "") -> Any:
    """ruamel's round-trip containers → plain dicts, lists and scalars, within the reader's limits (InputError)."""
    budget = budget or reading.Budget("<config>")
    budget.visit(depth)
    if isinstance(node, dict):
        return {str(k): to_plain(v, budget, depth + 1, f"{path}.{k}".lstrip(".")) for k, v in node.items()}
    if isinstance(node, list | tuple):
        return [to_plain(v, budget, depth + 1, f"{path}[{i}]") for i, v in enumerate(node)]
    tagged_value = getattr(node, "value", None)
    if type(node).__name__ == "TaggedScalar":  # unknown !!tags: keep the scalar
        return tagged_value
    if isinstance(node, bool) or node is None:
        return node
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node)
    if isinstance(node, str):
        return str(node)
    return node


def parse_text(text: str, where: str = "<text>") -> tuple[dict[str, Any], Any]:
    """Parse YAML or JSON text into ``(plain dict, round-trip tree or None)``; ConfigError when malformed."""
    from ruamel.yaml.error import MarkedYAMLError, YAMLError

    reading.check_text(text, where)
    kind, tree = ("JSON" if text.lstrip().startswith("{") else "YAML"), None
    try:
        if kind == "JSON":
            loaded = json.loads(text, parse_constant=reading.refuse_json_constant)
        else:
            reading.check_flow_depth(text, where)
            loaded = tree = _yaml().load(io.StringIO(text))
        data = to_plain(loaded, reading.Budget(where)) if loaded is not None else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}") from None
    except MarkedYAMLError as exc:
        mark = exc.problem_mark
        loc = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark else where
        raise ConfigError(f"{loc}: malformed YAML: {exc.problem or exc.context}") from None
    except YAMLError as exc:
        raise ConfigError(f"{where}: malformed YAML: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply", "a config is a few levels deep") from None
    except InputError as exc:
        raise _located(exc, where) from None
    except ValueError as exc:  # e.g. an integer over Python's 4300-digit conversion limit
        raise ConfigError(f"{where}: malformed {kind}: {exc}", "write numbers of realistic size") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where}: the top level must be a mapping of sections (model:, optimizer:, …), got {type(data).__name__}"
        )
    return unwrap_container(data, tree)


# Bridge's perf-recipe YAMLs hold the sections under one top-level `ConfigContainer:` key.
CONTAINER_KEYS = ("ConfigContainer",)
_ROOTS: dict[int, Any] = {}


def unwrap_container(data: dict[str, Any], tree: Any = None) -> tuple[dict[str, Any], Any]:
    """``{ConfigContainer: {model: …}}`` → ``({model: …}, that inner node)``; anything else unchanged.

    The inner round-trip node is part of the whole document: edit it in place and dump :func:`document_root` of it
    to write the file back with its wrapper (and its comments).
    """
    key = next((k for k in CONTAINER_KEYS if isinstance(data.get(k), dict)), None)
    if key is None or set(data) - {key, "_target_"}:
        return data, tree
    inner_tree = tree[key] if tree is not None else None
    if inner_tree is not None:
        _ROOTS[id(inner_tree)] = (inner_tree, tree)
        while len(_ROOTS) > 64:  # a long-running server reads many files: keep the recent ones only
            _ROOTS.pop(next(iter(_ROOTS)))
    return data[key], inner_tree


def document_root(tree: Any) -> Any:
    """The whole document a (possibly unwrapped) round-trip tree belongs to, for dumping it back."""
    entry = _ROOTS.get(id(tree))
    return entry[1] if entry is not None and entry[0] is tree else tree


def _located(exc: InputError, where: str) -> ConfigError:
    message = exc.message if exc.message.startswith(where) else f"{where}: {exc.message}"
    return ConfigError(message, exc.fix)


def read_source(source: str, stdin: Any = None) -> tuple[str, str]:
    """``(text, where)`` for a file path, ``-`` (stdin) or inline YAML/JSON text (ConfigError: unreadable)."""
    if source == "-":
        try:
            return reading.read_stream(stdin or sys.stdin, "<stdin>"), "<stdin>"
        except DeadlineError:
            raise
        except InputError as exc:
            raise ConfigError(exc.message, exc.fix) from None
    looks_inline = (
        "\n" in source
        or "\0" in source
        or source.lstrip().startswith("{")
        or (":" in source and not _exists(source) and not source.endswith((".yaml", ".yml", ".json")))
    )
    if looks_inline:
        return source, "<text>"
    if not _exists(source) and not Path(source).is_symlink():
        raise ConfigError(f"{source}: no such file; pass a Bridge YAML/JSON path, '-' for stdin, or inline YAML text")
    try:
        return reading.read_text_file(source), source
    except InputError as exc:
        raise ConfigError(exc.message, exc.fix) from None


def _exists(source: str) -> bool:
    try:
        return Path(source).exists()
    except (OSError, ValueError):  # a name too long for a path, a NUL byte: not a file
        return False


# ---------------------------------------------------------------------------------------------- overrides


def parse_overrides(overrides: list[str]) -> list[Any]:
    """Parse Hydra-style overrides with Hydra's grammar (``a.b=1``, ``+a.b=1``, ``++a.b=1``, ``~a.b``)."""
    if not overrides:
        return []
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            parsed.append(parser.parse_overrides([text])[0])
        except HydraException as exc:
            first = str(exc).splitlines()[0]
            raise ConfigError(f"override {text!r}: {first}; expected KEY=VALUE, +KEY=VALUE or ~KEY") from None
    return parsed


def override_value(override: str) -> Any:
    """The value of one ``key=value`` override as the config holds it once applied (Hydra's grammar: ``true``,
    ``0.35``, ``[a,b]``, ``null``)."""
    key, _, value = override.lstrip("+").partition("=")
    probe: dict[str, Any] = {}
    apply_overrides(probe, [f"++{key}={value}"])
    node: Any = probe
    for part in key.split("."):
        node = node[part]
    return node


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply Hydra-style overrides to a plain config dict (in place) and return it (ConfigError: bad override)."""
    if not overrides:
        return raw  # Hydra's parser costs ~70 ms to import; keep plain `validate FILE` fast
    from hydra.core.override_parser.types import OverrideType

    for override in parse_overrides(overrides):
        *parents, leaf = override.key_or_group.split(".")
        node = raw
        for part in parents:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {override.input_line!r}: {part!r} is not a section")
            node = child
        if override.type == OverrideType.DEL:
            if leaf not in node:
                raise ConfigError(
                    f"override {override.input_line!r}: {override.key_or_group} is not set, nothing to delete"
                )
            del node[leaf]
            continue
        if override.type == OverrideType.ADD and leaf in node:
            raise ConfigError(
                f"override {override.input_line!r}: {override.key_or_group} is already set; "
                f"use {override.key_or_group}=VALUE (or ++{override.key_or_group}=VALUE)"
            )
        # The value as Hydra's grammar reads it: null is None, 'None' (any string) stays a string, as megatron-core
        # would see it (recompute_granularity: "None" is refused there).
        node[leaf] = override.value()  # nan/inf as in a file: build_config refuses them where a key needs finite
    return raw


# ---------------------------------------------------------------------------------------------- Megatron-LM argv


def parse_megatron_argv(argv: list[str]) -> dict[str, Any]:
    """Megatron-LM ``pretrain_gpt.py`` flags → a raw config dict, through Megatron-LM 0.19.2's parser.

    Unknown flags are kept in ``unknown_arguments`` (validate warns about each); known flags no rule reads are
    kept under ``megatron_lm``. Raises ConfigError where Megatron-LM's parser refuses a value.
    """
    try:
        return megatron_lm.parse_argv(argv)
    except megatron_lm.ArgvError as exc:
        raise ConfigError(f"Megatron-LM refuses the arguments: {exc}") from None


# ---------------------------------------------------------------------------------------------- Bridge recipes


def _stdout_to_stderr():
    """Bridge logs (and its imports print) to stdout, which is the CLI's JSON channel: send them to stderr. Logging
    handlers created meanwhile keep stderr as their stream."""
    import contextlib

    return contextlib.redirect_stdout(sys.stderr)


def _defining_files(root: Path, name: str) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if f"def {name}(" in p.read_text(encoding="utf-8", errors="ignore"))


def recipe_config(name: str) -> dict[str, Any]:
    """A Megatron Bridge recipe's (or Bridge 0.6 perf recipe's) real ``ConfigContainer``, as its YAML dump reads.

    Needs megatron-bridge importable; ConfigError when it is missing or has no recipe of that name.
    """
    with _stdout_to_stderr():
        return _recipe_config(name)


def _recipe_config(name: str) -> dict[str, Any]:
    import importlib
    import importlib.machinery
    import importlib.util
    import types

    error: Exception | None = None
    try:
        spec = importlib.util.find_spec("megatron.bridge.recipes")
    except Exception as exc:  # ImportError, or TE's RuntimeError for its empty meta package
        spec, error = None, exc
    if spec is None or not spec.submodule_search_locations:
        detail = f"{error.__class__.__name__}: {str(error).splitlines()[0]}" if error else "not installed"
        raise ConfigError(
            f"--recipe needs megatron-bridge importable here ({detail}); run inside your Bridge "
            "environment, or dump the config with ConfigContainer.to_yaml() and validate that file"
        )
    # Find the module that defines the recipe by reading the sources, then import only that module: the
    # recipes package's own __init__ imports every model family (VLM data loaders included), which drags in
    # optional dependencies a config check does not need.
    root = Path(next(iter(spec.submodule_search_locations)))
    # Bridge 0.6 also ships megatron.bridge.perf_recipes (<model>_<task>_<N>gpu_<gpu>_<precision>_config), beside.
    package_name, hits = "megatron.bridge.recipes", _defining_files(root, name)
    if not hits and (root.parent / "perf_recipes").is_dir():
        package_name, root = "megatron.bridge.perf_recipes", root.parent / "perf_recipes"
        hits = _defining_files(root, name)
    if not hits:
        raise ConfigError(
            f"--recipe {name}: no such recipe in megatron.bridge.recipes or megatron.bridge.perf_recipes "
            "(names look like qwen3_30b_a3b_pretrain_config or llama3_70b_pretrain_64gpu_gb200_bf16_config)"
        )
    if package_name == "megatron.bridge.recipes" and package_name not in sys.modules:
        # A package module without its __init__ (see above), with a real spec: find_spec on the next call (same
        # process, e.g. the MCP server, which keeps these imports warm) reads the spec from sys.modules.
        package = types.ModuleType("megatron.bridge.recipes")
        package.__path__ = [str(root)]
        package.__spec__ = importlib.machinery.ModuleSpec("megatron.bridge.recipes", None, is_package=True)
        package.__spec__.submodule_search_locations = [str(root)]
        sys.modules["megatron.bridge.recipes"] = package
    module_name = f"{package_name}." + ".".join(hits[0].relative_to(root).with_suffix("").parts)
    try:
        if package_name == "megatron.bridge.perf_recipes":
            # its __init__ orders the family imports (a module imported alone can meet a partial one)
            importlib.import_module(package_name)
        factory = getattr(importlib.import_module(module_name), name)
    except Exception as exc:
        raise _recipe_failed(name, f"importing {module_name}", exc) from None
    try:
        container = factory()
    except Exception as exc:  # e.g. a recipe that reads its HF config from the hub, offline
        raise _recipe_failed(name, "building the recipe", exc) from None
    if not hasattr(container, "to_yaml"):
        raise ConfigError(f"--recipe {name}: the recipe returned {type(container).__name__}, not a ConfigContainer")
    import tempfile

    # The same path a user's file takes: Bridge's own YAML dump, then our reader.
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / f"{name}.yaml"
        container.to_yaml(str(dump))
        data, _ = parse_text(dump.read_text(encoding="utf-8"), where=f"recipe:{name}")
    return data


def _recipe_failed(name: str, step: str, exc: Exception) -> ConfigError:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return ConfigError(f"--recipe {name}: {step} failed ({exc.__class__.__name__}: {first})")


# ---------------------------------------------------------------------------------------------- typed model


def _line_of(tree: Any, loc: tuple[Any, ...]) -> int | None:
    node = tree
    line = None
    for part in loc:
        lc = getattr(node, "lc", None)
        if lc is None or not isinstance(node, dict) or part not in node:
            break
        try:
            line = lc.key(part)[0] + 1
        except (KeyError, TypeError):
            break
        node = node[part]
    return line


def _check_finite(data: dict[str, Any], where: str, tree: Any) -> None:
    """Refuse NaN/±inf where ``schema.refuses_non_finite``; elsewhere upstream's float fields keep them."""
    for name in SECTIONS:
        section = data.get(name)
        for key, value in section.items() if isinstance(section, dict) else ():
            if not refuses_non_finite(name, key):
                continue
            try:
                reading.check_number(value, f"{name}.{key}")
            except InputError as exc:
                line = _line_of(tree, (name, key)) if tree is not None else None
                raise ConfigError(
                    f"{where}:{line}: {exc.message}" if line else f"{where}: {exc.message}", exc.fix
                ) from None


def build_config(raw: dict[str, Any], where: str = "<config>", tree: Any = None) -> OffloadConfig:
    """Type-check a raw config; a ConfigError names the key, the value, what was expected and the file's line."""
    for name in SECTIONS:
        if name in raw and raw[name] is not None and not isinstance(raw[name], dict):
            raise ConfigError(f"{where}: section {name!r} must be a mapping, got {raw[name]!r}")
    data = {k: (v if v is not None else {}) if k in SECTIONS else v for k, v in raw.items()}
    _check_finite(data, where, tree)
    try:
        return OffloadConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"][:2]) if err["loc"] and err["loc"][0] in SECTIONS else tuple(err["loc"][:1])
        dotted = ".".join(str(p) for p in loc)
        line = _line_of(tree, loc) if tree is not None else None
        place = f"{where}:{line}" if line else where
        value = err.get("input")
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ConfigError(f"{place}: {dotted} = {value!r}: {err['msg'].lower()}{more}") from None


def load(
    source: str | None = None,
    overrides: list[str] | None = None,
    *,
    argv: list[str] | None = None,
    recipe: str | None = None,
    stdin: Any = None,
) -> LoadedConfig:
    """Load a config from a file/text/stdin (``-``), a Bridge recipe, or Megatron-LM argv, then apply overrides.

    Raises ConfigError, with a one-line message, for any bad input.
    """
    overrides = list(overrides or [])
    tree = None
    if argv is not None:
        raw, where = parse_megatron_argv(argv), "<argv>"
    elif recipe is not None:
        raw, where = recipe_config(recipe), f"recipe:{recipe}"
    elif source is not None:
        text, where = read_source(source, stdin=stdin)
        raw, tree = parse_text(text, where)
    else:
        raw, where = {}, "<empty>"
    written = copy.deepcopy(raw) if overrides else None
    apply_overrides(raw, overrides)
    frontend = raw.pop("frontend", "bridge")
    config = build_config(raw, where, tree if not overrides else None)
    config.env.setdefault("frontend", str(frontend))
    if written is not None:  # the run a user's log measured is the config as written (plan/evidence/runs.py)
        written.pop("frontend", None)
        as_written = build_config(written, where, tree)
        as_written.env.setdefault("frontend", str(frontend))
        config._written = (as_written, written)
    return LoadedConfig(raw=raw, config=config, source=where, overrides=overrides)
