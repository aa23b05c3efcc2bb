"""One interface: every MCP tool parameter is the CLI flag of the same name on the matching subcommand.

Read from the outside: the MCP tools' input schemas come from the SDK's in-memory client (what a host sees), the
flags from the real ``mbridge-offload`` parser. The spelling rule is written out here from the issue and
docs/mcp.md, not read from the code under test. Then generated good and bad values for every parameter of every
tool go through both sides in-process, which must answer the same JSON or both refuse.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client

from mbridge_offload_tools.cli import main as cli
from mbridge_offload_tools.interface.build import finish
from mbridge_offload_tools.server.app import mcp
from tests.support import tree

PAIRS = {
    "validate_config": "validate",
    "estimate_memory": "estimate",
    "recommend_mode": "recommend",
    "apply_offload": "apply",
    "run_unit_tests": "test",
    "diagnose_failure": "diagnose",
    "plot_offload": "plot",
    "trace_memory": "trace",
}
# The only spellings that differ (docs/mcp.md); config may also be the positional CONFIG.
SPELLINGS = {"overrides": "--set", "k": "-k", "timeout_s": "--timeout", "overwrite": "--force"}
# The flags only the CLI has: an output format, a containment the server sets at its start, older spellings.
CLI_ONLY = {
    "validate": {"--json"},
    "estimate": {"--json", "--model-config"},
    "recommend": {"--json", "--model-config"},
    "apply": {"--json", "--allowed-root"},
    "test": {"--json", "--all"},
    "diagnose": {"--json"},
    "plot": {"--json", "--model-config", "--allowed-root"},
    "trace": {"--json", "--model-config"},
}

GOOD_YAML = """\
# a small dense model on one node
model:
  num_layers: 8
  hidden_size: 1024
  num_attention_heads: 8
  vocab_size: 32000
  seq_length: 2048
optimizer:
  optimizer: adam
  lr: 0.0003
  use_distributed_optimizer: true
"""
LOG = (
    "iteration 2 | elapsed time per iteration (ms): 812.5\n"
    "[Rank 0] memory (MB) | allocated: 1000 | max allocated: 50000\n"
)
ARGV = "--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128"


def flag_of(name: str) -> str:
    return SPELLINGS.get(name, "--" + name.replace("_", "-"))


@pytest.fixture(scope="module")
def schemas() -> dict[str, dict[str, Any]]:
    async def listing() -> dict[str, dict[str, Any]]:
        async with Client(mcp) as client:
            return {t.name: t.input_schema for t in (await client.list_tools()).tools}

    return anyio.run(listing)


@pytest.fixture(scope="module")
def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """option string (or ``CONFIG`` for the positional) → action, without --help."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for option in action.option_strings or ["CONFIG"]:
            out[option] = action
    return out


def _action_of(parser: argparse.ArgumentParser, name: str) -> argparse.Action:
    actions = _actions(parser)
    if name == "config" and "CONFIG" in actions:
        return actions["CONFIG"]
    assert flag_of(name) in actions, f"{parser.prog}: no {flag_of(name)} for the MCP parameter {name}"
    return actions[flag_of(name)]


def _kind(prop: dict[str, Any]) -> str:
    kinds = [p.get("type") for p in prop.get("anyOf", [prop]) if p.get("type") != "null"]
    return "enum" if "enum" in prop else kinds[0]


def _limits(prop: dict[str, Any]) -> dict[str, Any]:
    inner = next((p for p in prop.get("anyOf", [prop]) if p.get("type") != "null"), prop)
    return {k: inner[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in inner}


# ---------------------------------------------------------------------------------------------- the names


def test_the_pairs_are_every_tool_and_its_subcommand(schemas, subcommands) -> None:
    assert set(schemas) == set(PAIRS)
    assert set(PAIRS.values()) <= set(subcommands)


@pytest.mark.parametrize("tool", PAIRS)
def test_every_mcp_parameter_is_the_flag_of_the_same_name(tool, schemas, subcommands) -> None:
    parser = subcommands[PAIRS[tool]]
    for name in schemas[tool]["properties"]:
        action = _action_of(parser, name)
        assert action.dest == name, f"{PAIRS[tool]} {flag_of(name)} lands in {action.dest}, not {name}"


@pytest.mark.parametrize("tool", PAIRS)
def test_every_flag_is_an_mcp_parameter_or_one_of_the_few_cli_only_flags(tool, schemas, subcommands) -> None:
    command = PAIRS[tool]
    names = set(schemas[tool]["properties"])
    extra = set()
    for option, action in _actions(subcommands[command]).items():
        if action.dest in names and option in (flag_of(action.dest), "CONFIG", "--no-" + flag_of(action.dest)[2:]):
            continue  # the flag, the positional CONFIG, or a switch's negation (--no-sequence-parallel)
        if action.dest in names:  # another spelling of a parameter: an older one, and its help names the new
            assert flag_of(action.dest) in action.option_strings and flag_of(action.dest) in (action.help or "")
            continue
        extra.add(option)
    assert extra == CLI_ONLY[command]


@pytest.mark.parametrize("tool", PAIRS)
def test_types_defaults_choices_and_required_agree(tool, schemas, subcommands) -> None:
    schema = schemas[tool]
    for name, prop in schema["properties"].items():
        action = _action_of(subcommands[PAIRS[tool]], name)
        required = name in schema.get("required", [])
        assert (action.option_strings == [] and action.nargs is None) == required, name
        if not required:
            assert action.default == prop.get("default"), (name, action.default, prop.get("default"))
        kind = _kind(prop)
        if kind == "enum":
            assert list(action.choices or []) == prop["enum"], name
        elif kind == "boolean":
            assert action.nargs == 0, name  # a switch (--x, or --x/--no-x when unset means "not given")
        elif kind == "array":
            assert isinstance(action, (argparse._AppendAction, argparse._ExtendAction)), name
        else:
            assert action.type is {"integer": int, "number": float, "string": str}[kind] or (
                kind == "string" and action.type is None
            ), name


def test_estimate_and_recommend_take_the_same_inputs(schemas) -> None:
    recommend = dict(schemas["recommend_mode"]["properties"])
    assert recommend.pop("confirm")["default"] is False  # recommend's own: options[0] re-checked by the trace
    assert schemas["estimate_memory"]["properties"] == recommend


def test_plot_apply_and_diagnose_take_the_planners_inputs_as_recommend_does(schemas) -> None:
    """Each planner input a tool takes is recommend's parameter, word for word; which ones each takes is the
    library's statement (apply: all but those it spells its own way; diagnose: diagnose.sizing.input_names)."""
    from mbridge_offload.actions.apply.plan import APPLY_OWN_INPUTS, MODES
    from mbridge_offload.actions.diagnose.sizing import input_names
    from mbridge_offload.plan.inputs.fields import FIELDS

    recommend = {k: v for k, v in schemas["recommend_mode"]["properties"].items() if k != "confirm"}  # its own
    plot = schemas["plot_offload"]["properties"]
    assert {k: v for k, v in plot.items() if k in recommend} == recommend
    assert set(plot) - set(recommend) == {"kind", "sweep", "output", "overwrite", "format"}
    apply = schemas["apply_offload"]["properties"]
    assert {n for n in FIELDS if n in apply and apply[n] != recommend[n]} == APPLY_OWN_INPUTS  # num_layers: its own
    assert set(FIELDS) - APPLY_OWN_INPUTS <= set(apply)
    assert set(apply["mode"]["enum"]) == set(MODES)
    diagnose = schemas["diagnose_failure"]["properties"]
    assert set(diagnose) == {"error", "symptom", "log", "config", "before", "after", *input_names()}
    assert all(diagnose[n] == recommend[n] for n in input_names())


# ---------------------------------------------------------------------------------------------- both sides


def run_cli(argv: list[str]) -> tuple[int, dict[str, Any], str]:
    """The real entry point in-process: exit code, the one JSON object, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main([*argv, "--json"])
            code = 0
        except SystemExit as stop:
            code = int(stop.code or 0)
    return code, json.loads(out.getvalue()), err.getvalue()


def to_argv(command: str, args: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """An MCP call's arguments as the subcommand's flags, by the spelling rule."""
    argv = [command]
    for name, value in args.items():
        if value is None:
            continue
        if name == "config" and command in ("validate", "estimate", "recommend", "apply", "plot"):
            argv.append(str(value))
        elif isinstance(value, bool):
            default = schema["properties"][name].get("default")
            argv += [flag_of(name)] if value else ([] if default is False else ["--no-" + flag_of(name)[2:]])
        elif isinstance(value, list):
            for item in value:
                argv += [flag_of(name), str(item)]
        else:
            argv += [flag_of(name), str(value)]
    return argv


def _good_and_bad(name: str, prop: dict[str, Any], files: dict[str, str]) -> tuple[list[Any], list[Any]]:
    """Values for one parameter: generated from its schema (bounds edges and beyond, every choice), or chosen for
    the strings and lists whose meaning the schema does not say."""
    curated: dict[str, tuple[list[Any], list[Any]]] = {
        "config": ([files["good"]], [files["missing"]]),
        "before": ([files["good"]], [files["missing"]]),
        "after": ([files["good"]], [files["missing"]]),
        "overrides": ([["optimizer.optimizer_offload_fraction=0.5"]], [["model.="]]),
        "target": (["megatron-core==0.16.1"], ["megatron-core==9.9"]),
        "recipe": ([], ["no_such_recipe_config"]),
        "megatron_args": ([ARGV], ["--num-layers 'x"]),
        "te_version": (["2.9"], ["latest"]),
        "env": ([["NVTE_CPU_OFFLOAD_V1=1"], ["te_version=2.10"]], [["NOEQUALS"]]),
        "model": (["qwen3-8b"], ["nope"]),
        "gpu": (["h200-141gb"], ["v100"]),
        "levers": ([["recompute"], ["activation,optimizer"]], [["warp"]]),
        "recompute_modules": ([["core_attn"]], []),
        "offload_modules": ([["core_attn"]], []),
        "modules": ([["core_attn,attn_proj"]], [["nope"]]),
        "pipeline_layout": ([], ["x!"]),
        "host_profile": ([], ["no-such-profile"]),
        "calibration": ([], [files["missing"]]),
        "measured_log": ([LOG], [files["missing_log"]]),
        "measured_settings": ([], [["micro_batch_size=1"], ["NOEQUALS"], ["gpu=b200"]]),  # the bases give no evidence
        "k": (["apply"], ["a; rm -rf ~"]),
        "bridge_repo": ([], [files["missing"]]),
        "path": (["tests/tools"], ["../../etc/passwd"]),
        "error": (["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"], []),
        "log": ([LOG, files["log"]], [files["missing_log"]]),
        "exact": ([False], []),  # True runs megatron-core in a subprocess: tests/tools/test_validate_exact.py
        "sweep": (
            ["optimizer_offload_fraction=0:1:0.5", "micro_batch_size=1,2"],
            ["no_such_input=1:2:1", "optimizer_offload_fraction=1:0:0.5", "tp=" + "1," * 2100],
        ),
    }
    if name in curated:
        return curated[name]
    kind = _kind(prop)
    if kind == "enum":
        return list(prop["enum"]), ["no-such-choice"]
    if kind == "boolean":
        return [True, False], []
    if kind in ("integer", "number"):
        return _numbers(kind, _limits(prop))
    return ["x"], []


def _numbers(kind: str, limits: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    low = limits.get("minimum", limits.get("exclusiveMinimum"))
    high = limits.get("maximum")
    step = 1 if kind == "integer" else (0.5 if high is None or low is None else min(1.0, (high - low) / 2))
    good, bad = [], ["abc"]
    if low is not None:
        good.append(low + step if "exclusiveMinimum" in limits else low)
        bad.append(low if "exclusiveMinimum" in limits else low - step)
    if high is not None:
        good.append(high)
        bad.append(high + step if kind == "integer" else high * 2 + 1)
    if not good:
        good.append(1 if kind == "integer" else 0.5)
    return ([int(v) for v in good] if kind == "integer" else good), bad


# The base of each tool's generated calls: a valid call (or, for the test runner, one the library refuses before
# anything runs: parity takes no path), where each parameter in turn takes a generated value.
BASES: dict[str, dict[str, Any]] = {
    "validate_config": {"config": "{good}"},
    "estimate_memory": {"model": "llama3-8b", "gpu": "h100-80gb", "num_gpus": 8},
    "recommend_mode": {"model": "llama3-8b", "gpu": "h100-80gb", "num_gpus": 8},
    "apply_offload": {"config": "{good}", "mode": "optimizer"},
    "run_unit_tests": {"suite": "parity", "path": "tests/no_such_test_file.py"},
    "diagnose_failure": {"error": "torch.OutOfMemoryError: CUDA out of memory"},
    # A file on both sides (the CLI always writes one; MCP only with output), replaced at each call.
    "plot_offload": {
        "model": "llama3-8b",
        "gpu": "h100-80gb",
        "num_gpus": 8,
        "kind": "phases",
        "output": "{picture}",
        "overwrite": True,
    },
}
# Writes are compared apart (two targets): test_writes_agree, test_plot_writes_agree
SKIP = {"apply_offload": {"output", "in_place", "overwrite"}, "plot_offload": {"output", "overwrite"}}
# recommend and plot take estimate's inputs (the test below) into the same reading (plan.service.plan_source);
# apply and diagnose take recommend's: estimate's cases cover each planner input, the others' cover their own and the
# inputs they read differently.
SAMPLED = {
    "recommend_mode": {"config", "overrides", "megatron_args", "levers", "margin", "headroom_gib", "gpu"},
    "plot_offload": {"config", "overrides", "megatron_args", "kind", "sweep", "format", "gpu", "tp", "levers"},
}
SOURCES = ("config", "recipe", "megatron_args")  # validate takes exactly one


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.chdir(tmp_path)  # the MCP server's root: the launch directory
    (tmp_path / "good.yaml").write_text(GOOD_YAML, encoding="utf-8")
    (tmp_path / "train.log").write_text(LOG, encoding="utf-8")
    return {
        "good": str(tmp_path / "good.yaml"),
        "picture": str(tmp_path / "picture.svg"),
        "missing": str(tmp_path / "missing.yaml"),
        "log": str(tmp_path / "train.log"),
        "missing_log": str(tmp_path / "logs" / "missing.log"),
    }


def _base(tool: str, files: dict[str, str]) -> dict[str, Any]:
    """BASES[tool] with its files (``{good}``, ``{picture}``) in this test's folder."""
    return {k: files[v[1:-1]] if isinstance(v, str) and v.startswith("{") else v for k, v in BASES[tool].items()}


def _cases(tool: str, schema: dict[str, Any], files: dict[str, str]) -> list[tuple[str, dict[str, Any]]]:
    base = _base(tool, files)
    cases = [("base", base)]
    for name, prop in schema["properties"].items():
        if name in SKIP.get(tool, ()):
            continue
        if tool in SAMPLED and name not in SAMPLED[tool]:
            continue
        good, bad = _good_and_bad(name, prop, files)
        for value in [*good, *bad]:
            args = dict(base)
            if tool == "validate_config" and name in SOURCES:
                args = {k: v for k, v in args.items() if k not in SOURCES}
            if tool == "plot_offload" and name == "sweep":  # a sweep is kind sweep's: kind then defaults to it
                args.pop("kind")
            args[name] = value
            cases.append((f"{name}={value!r}", args))
    return cases


# What the server's start decides (its --allow-bridge-repo), never an argument: over MCP a checkout not allowed is
# refused first, so both sides refuse, each with its own reason.
CONTAINED = ("run_unit_tests bridge_repo=",)


def _rewrite_aside(payload: dict[str, Any]) -> dict[str, Any]:
    """A picture's answer without what depends on the file's past: plot's calls all replace one file (the base's
    output, overwrite), so whether this call found the same picture there (a note) or another (a backup) depends on
    the call before it. The written path, the points and every other key stay compared."""
    kept = {k: v for k, v in payload.items() if k != "backup"}
    return {**kept, "notes": [n for n in payload["notes"] if "already holds this picture" not in n]}


def _same(cli_answer: tuple[int, dict[str, Any], str], mcp_answer: Any, label: str) -> None:
    code, payload, _ = cli_answer
    if code in (0, 1):
        assert not mcp_answer.is_error, f"{label}: the CLI answered, MCP refused: {mcp_answer.content[0].text}"
        answer = mcp_answer.structured_content
        if label.startswith("plot_offload "):
            payload, answer = _rewrite_aside(payload), _rewrite_aside(answer)
        assert payload == answer, label
        return
    assert code == 2, f"{label}: exit {code}: {payload}"
    assert mcp_answer.is_error, f"{label}: the CLI refused ({payload['error']}), MCP answered"
    text = mcp_answer.content[0].text
    by_parser = payload["error"].startswith(("--", "-k", "mbridge-offload"))  # argparse or the declared bounds
    assert by_parser or label.startswith(CONTAINED) or payload["error"] in text, (
        f"{label}: two different errors:\n{payload['error']}\n{text}"
    )


@pytest.mark.parametrize("tool", PAIRS)
def test_generated_values_get_the_same_answer_or_the_same_refusal(tool, schemas, files) -> None:
    if tool == "trace_memory":  # each call runs megatron-core in a subprocess: tests/tools/test_trace.py pairs them
        pytest.skip("trace_memory: CLI and MCP answers are compared in tests/tools/test_trace.py")
    cases = _cases(tool, schemas[tool], files)
    cli_answers = [run_cli(to_argv(PAIRS[tool], args, schemas[tool])) for _, args in cases]

    async def over_mcp() -> list[Any]:
        async with Client(mcp) as client:
            return [await client.call_tool(tool, args) for _, args in cases]

    mcp_answers = anyio.run(over_mcp)
    refused = 0
    for (label, _), answer, mcp_answer in zip(cases, cli_answers, mcp_answers, strict=True):
        _same(answer, mcp_answer, f"{tool} {label}")
        refused += answer[0] == 2
    assert cases[0][0] == "base" and (tool == "run_unit_tests" or cli_answers[0][0] in (0, 1))
    assert 0 < refused < len(cases) or tool == "run_unit_tests"  # the values reached both outcomes


def test_a_bound_is_refused_by_both_sides_naming_the_input(schemas, files) -> None:
    for tool, name, value in [
        ("apply_offload", "fraction", 1.5),
        ("run_unit_tests", "steps", 1),
        ("run_unit_tests", "timeout_s", 0.0),
        ("estimate_memory", "tp", 0),
        ("validate_config", "deadline", -1.0),
    ]:
        args = {**_base(tool, files), name: value}
        code, payload, _ = run_cli(to_argv(PAIRS[tool], args, schemas[tool]))
        assert code == 2 and payload["error"].startswith(f"{flag_of(name)} = {value!r} (flag): "), payload

        async def call(tool: str = tool, args: dict[str, Any] = args) -> Any:
            async with Client(mcp) as client:
                return await client.call_tool(tool, args)

        answer = anyio.run(call)
        assert answer.is_error and name in answer.content[0].text


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_the_cli_refuses_what_json_cannot_carry(value, files) -> None:
    code, payload, _ = run_cli(["apply", files["good"], "--mode", "optimizer", f"--fraction={value}"])
    assert code == 2 and "finite" in payload["error"]


# ---------------------------------------------------------------------------------------------- old spellings


def test_recompute_is_the_older_spelling_of_recompute_granularity(subcommands) -> None:
    base = ["estimate", "--model", "llama3-8b", "--gpu", "h100-80gb", "--num-gpus", "8"]
    new = run_cli([*base, "--recompute-granularity", "full"])
    old = run_cli([*base, "--recompute", "full"])
    assert new[0] == old[0] == 0 and new[1] == old[1]
    assert any(a["name"] == "recompute_granularity" and a["value"] == "full" for a in new[1]["assumptions"])
    help_text = " ".join(subcommands["estimate"].format_help().split())
    assert "--recompute-granularity" in help_text and "the older spelling of --recompute-granularity" in help_text


def test_env_te_version_is_the_older_spelling_of_te_version(files) -> None:
    new = run_cli(["validate", files["good"], "--te-version", "2.9"])
    old = run_cli(["validate", files["good"], "--env", "te_version=2.9"])
    assert new[0] == old[0] == 0 and new[1] == old[1] and new[1]["env"]["te_version"] == "2.9"

    async def calls() -> list[Any]:
        async with Client(mcp) as client:
            return [
                await client.call_tool("validate_config", {"config": files["good"], "te_version": "2.9"}),
                await client.call_tool("validate_config", {"config": files["good"], "env": ["te_version=2.9"]}),
                await client.call_tool(
                    "validate_config", {"config": files["good"], "env": ["te_version=2.9"], "te_version": "2.10"}
                ),
            ]

    by_param, by_env, both = anyio.run(calls)
    assert by_param.structured_content == by_env.structured_content == new[1]
    assert both.is_error and "te_version" in both.content[0].text
    code, payload, _ = run_cli(["validate", files["good"], "--env", "te_version=2.9", "--te-version", "2.10"])
    assert code == 2 and payload["error"] in both.content[0].text


def test_model_config_is_the_older_spelling_of_config(files) -> None:
    base = ["estimate", "--gpu", "h100-80gb", "--num-gpus", "8"]
    assert run_cli([*base, files["good"]])[:2] == run_cli([*base, "--model-config", files["good"]])[:2]
    code, payload, _ = run_cli([*base, "--model-config", files["good"], str(Path(files["good"]).with_name("b.yaml"))])
    assert code == 2 and "--model-config" in payload["error"]


def test_all_is_the_older_spelling_of_suite_full(subcommands) -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["test", "--all"])
    finish(args)
    assert args.suite == "full"
    code, payload, _ = run_cli(["test", "--all", "--suite", "parity"])
    assert code == 2 and "--all" in payload["error"] and "--suite" in payload["error"]


def test_a_list_takes_commas_or_several_values_or_several_flags(files) -> None:
    base = ["recommend", "--model", "qwen3-0.6b", "--num-gpus", "1", "--seq-length", "16384"]
    answers = [
        run_cli([*base, "--levers", "activation,optimizer"]),
        run_cli([*base, "--levers", "activation", "optimizer"]),
        run_cli([*base, "--levers", "activation", "--levers", "optimizer"]),
    ]
    assert all(a[0] == 0 for a in answers) and answers[0][1] == answers[1][1] == answers[2][1]
    assert answers[0][1]["levers"] == ["activation", "optimizer"]


# ---------------------------------------------------------------------------------------------- new flags


def test_estimate_takes_overrides_as_set_like_the_mcp_tool(files) -> None:
    override = "optimizer.optimizer_offload_fraction=0.5"
    code, payload, _ = run_cli(["estimate", files["good"], "--gpu", "h100-80gb", "--set", override])
    assert code == 0 and payload["effective"]["optimizer.optimizer_offload_fraction"]["value"] == 0.0  # switch off
    on = "optimizer.optimizer_cpu_offload=true"
    code, payload, _ = run_cli(["estimate", files["good"], "--gpu", "h100-80gb", "--set", on, "--set", override])
    assert code == 0 and payload["effective"]["optimizer.optimizer_offload_fraction"]["value"] == 0.5

    async def call() -> Any:
        async with Client(mcp) as client:
            return await client.call_tool(
                "estimate_memory", {"config": files["good"], "gpu": "h100-80gb", "overrides": [on, override]}
            )

    assert anyio.run(call).structured_content == payload
    code, payload, _ = run_cli(["estimate", "--model", "llama3-8b", "--set", override])
    assert code == 2 and "overrides need a config" in payload["error"]


def test_stdin_is_the_clis_only(files, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(GOOD_YAML))
    code, payload, _ = run_cli(["validate", "-"])
    assert code == 0 and payload["source"] == "<stdin>"

    async def call() -> Any:
        async with Client(mcp) as client:
            return await client.call_tool("validate_config", {"config": "-"})

    answer = anyio.run(call)  # a server's stdin may carry the protocol: never read as a config
    assert answer.is_error and "stdin" in answer.content[0].text


def test_diagnose_log_is_a_path_or_the_text_on_both_sides(files) -> None:
    from_file = run_cli(["diagnose", "--log", files["log"]])
    from_text = run_cli(["diagnose", "--log", LOG])
    assert from_file[0] == from_text[0] == 0 and from_file[1] == from_text[1]
    code, payload, _ = run_cli(["diagnose", "--log", files["missing_log"]])
    assert code == 2 and "missing.log" in payload["error"]


def test_writes_agree(schemas, files, tmp_path: Path) -> None:
    """output, in_place and overwrite: the same bytes written, the same refusal of an existing file."""
    for side in ("cli", "mcp"):
        (tmp_path / f"{side}.yaml").write_text(GOOD_YAML, encoding="utf-8")
    code, cli_first, _ = run_cli(["apply", "cli.yaml", "--mode", "optimizer", "--output", "cli_out.yaml"])
    again, _, _ = run_cli(["apply", "cli.yaml", "--mode", "optimizer", "--output", "cli_out.yaml"])
    forced, cli_forced, _ = run_cli(["apply", "cli.yaml", "--mode", "both", "--num-layers", "2", "--output",
                                     "cli_out.yaml", "--force"])  # fmt: skip
    in_place, cli_in_place, _ = run_cli(["apply", "cli.yaml", "--mode", "optimizer", "--in-place"])

    async def calls() -> list[Any]:
        async with Client(mcp) as client:
            call = client.call_tool
            return [
                await call("apply_offload", {"config": "mcp.yaml", "mode": "optimizer", "output": "mcp_out.yaml"}),
                await call("apply_offload", {"config": "mcp.yaml", "mode": "optimizer", "output": "mcp_out.yaml"}),
                await call(
                    "apply_offload",
                    {
                        "config": "mcp.yaml",
                        "mode": "both",
                        "num_layers": 2,
                        "output": "mcp_out.yaml",
                        "overwrite": True,
                    },
                ),
                await call("apply_offload", {"config": "mcp.yaml", "mode": "optimizer", "in_place": True}),
            ]

    first, refused, overwritten, edited = anyio.run(calls)
    assert (code, again, forced, in_place) == (0, 2, 0, 0) and refused.is_error and not overwritten.is_error
    assert (tmp_path / "cli_out.yaml").read_bytes() == (tmp_path / "mcp_out.yaml").read_bytes()
    assert (tmp_path / "cli.yaml").read_bytes() == (tmp_path / "mcp.yaml").read_bytes() != GOOD_YAML.encode()
    assert cli_first["changes"] == first.structured_content["changes"]
    assert cli_forced["changes"] == overwritten.structured_content["changes"]
    assert cli_in_place["changes"] == edited.structured_content["changes"]


def test_plot_writes_agree(files, tmp_path: Path) -> None:
    """output and overwrite (--force): the same picture written by both sides, an existing file refused by both
    without consent; without output the CLI writes its default file and MCP none (it returns the image)."""
    argv = ["plot", "--model", "llama3-8b", "--gpu", "h100-80gb", "--kind", "phases"]
    code, cli_first, _ = run_cli([*argv, "--output", "cli.svg"])
    again, cli_refused, _ = run_cli([*argv, "--output", "cli.svg"])
    forced, _, _ = run_cli([*argv, "--output", "cli.svg", "--num-gpus", "16", "--force"])
    default, cli_default, _ = run_cli(argv)
    base = {"model": "llama3-8b", "gpu": "h100-80gb", "kind": "phases"}

    async def calls() -> list[Any]:
        async with Client(mcp) as client:
            call = client.call_tool
            return [
                await call("plot_offload", {**base, "output": "mcp.svg"}),
                await call("plot_offload", {**base, "output": "mcp.svg"}),
                await call("plot_offload", {**base, "output": "mcp.svg", "num_gpus": 16, "overwrite": True}),
                await call("plot_offload", base),
            ]

    first, refused, overwritten, image_only = anyio.run(calls)
    assert (code, again, forced, default) == (0, 2, 0, 0) and refused.is_error and not overwritten.is_error
    assert "exists" in cli_refused["error"] and "exists" in refused.content[0].text
    assert cli_first["points"] == first.structured_content["points"] and cli_first["written"] == "cli.svg"
    assert (tmp_path / "cli.svg").read_bytes() == (tmp_path / "mcp.svg").read_bytes()  # 16 GPUs' picture on both
    assert Path(cli_default["written"]).name == "mbridge-offload-phases.svg" and cli_default["format"] == "svg"
    answer = image_only.structured_content
    assert answer["written"] is None and answer["format"] == "png" and image_only.content[0].type == "image"
    pictures = sorted(p.name for p in tmp_path.glob("*.svg*"))
    assert [n for n in pictures if ".bak" not in n] == ["cli.svg", "mbridge-offload-phases.svg", "mcp.svg"]
    assert [n.split(".")[0] for n in pictures if ".bak" in n] == ["cli", "mcp"]  # one backup each, of the replaced


# ---------------------------------------------------------------------------------------------- out of process


def test_the_installed_entry_point_takes_the_new_flags(files) -> None:
    env = dict(os.environ, PYTHONPATH=tree.pythonpath(inherit=True))
    command = [sys.executable, "-m", "mbridge_offload_tools", "estimate", files["good"], "--gpu", "h100-80gb"]
    offload = ["--set", "optimizer.optimizer_cpu_offload=true", "--set", "optimizer.optimizer_offload_fraction=0.25"]
    done = subprocess.run(
        [*command, *offload, "--recompute-granularity", "full", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert payload["effective"]["optimizer.optimizer_offload_fraction"]["value"] == 0.25
    assert math.isfinite(payload["memory_gib"]["total"])
