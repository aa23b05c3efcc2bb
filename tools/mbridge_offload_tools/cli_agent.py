"""CLI subcommands ``apply``, ``test``, ``diagnose`` and ``serve`` (the agent-facing half of ``mbridge-offload``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mbridge_offload.actions.apply_plan import APPLY_OWN_INPUTS, MODES
from mbridge_offload_tools.common import EXIT_BAD_INPUT, EXIT_FINDINGS, EXIT_OK, UsageError, emit


def add_parsers(sub: Any) -> None:
    for add in (_add_apply, _add_test, _add_diagnose, _add_serve):
        add(sub)


def _add_apply(sub: Any) -> None:
    p = sub.add_parser(
        "apply",
        help="switch an offload mode on/off in a config (dry run unless --output/--in-place)",
        description="Edit a config to switch an offload mode on or off, resolving the conflicts it implies; prints "
        "the diff and each change with its reason. Writes only with --output or --in-place, atomically, and never a "
        "config its own validator rejects.",
    )
    p.add_argument("config", help="YAML/JSON config path, or - for stdin")
    p.add_argument(
        "--mode",
        choices=MODES,
        help="what to switch on; none switches offload off; fine-grained offloads the --modules' activations; "
        "recommended asks the planner, with every planner input below as recommend takes it (required unless "
        "--option is given)",
    )
    p.add_argument(
        "--option",
        type=int,
        metavar="N",
        help="write recommend's option N (its options[N]: recompute, layout and offload changes; 0 = the "
        "recommendation); implies --mode recommended, re-validated like every apply",
    )
    p.add_argument("--fraction", type=float, help="optimizer_offload_fraction, in (0, 1]")
    p.add_argument(
        "--num-layers", type=int, help="cpu_offloading_num_layers (the model's own layer count comes from the config)"
    )
    p.add_argument(
        "--modules",
        metavar="M[,M...]",
        help="offload_modules for --mode fine-grained, e.g. expert_fc1 or core_attn,attn_proj",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Hydra-style section.key=VALUE override, applied with the mode and written with it (repeatable)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--output", help="write the edited config to this path")
    where.add_argument("--in-place", action="store_true", help="overwrite CONFIG, keeping a unique CONFIG.bak[.N]")
    p.add_argument(
        "--force", action="store_true", help="let --output replace an existing file (a unique .bak backup is kept)"
    )
    p.add_argument(
        "--format", choices=("yaml", "overrides"), default="yaml", help="what a write contains (default yaml)"
    )
    p.add_argument("--allowed-root", help="an extra directory --output may point into")
    # --mode recommended / --option: every input recommend takes (evidence, levers, headroom, GPU, count, layout...),
    # generated from the one declaration, so option N here is recommend's option N. The model's layer count comes
    # from the config (--set model.num_layers=N): --num-layers is apply's cpu_offloading_num_layers.
    from mbridge_offload_tools.cli_plan import add_plan_inputs

    add_plan_inputs(p, APPLY_OWN_INPUTS)
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.set_defaults(handler=cmd_apply)


def _add_test(sub: Any) -> None:
    p = sub.add_parser(
        "test",
        help="run the offload tests (ours, a Bridge checkout's, or the parity suite)",
        description="Run tests in a subprocess and report counts, durations, failures and a coverage paragraph. "
        "Without -k (or with the upstream skill's -k cpu_offload) it runs the offload suite: the tests marked "
        "cpu_offload (HybridDeviceOptimizer parity and resume, checkpoints, activation schedule, rules), "
        "under a minute on 2 shared cores. --all runs every test.",
    )
    p.add_argument(
        "-k", dest="k", help="pytest -k expression; cpu_offload = the offload suite, anything else selects from all"
    )
    p.add_argument("--bridge-repo", help="Megatron Bridge checkout to run its offload tests")
    p.add_argument("--path", help="one test file/folder/node id under tests/ instead of the offload suite")
    p.add_argument(
        "--suite",
        choices=("unit", "full", "parity"),
        default="unit",
        help="unit = the offload suite (or what -k/--path select); full = every test; parity = tiny-GPT loss "
        "parity with vs without offload (default unit)",
    )
    p.add_argument("--all", action="store_true", help="run every test of tests/ (the same as --suite full)")
    p.add_argument("--config", help="parity: config whose offload settings are trained")
    p.add_argument("--steps", type=int, help="parity: steps per run")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds (default 600)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.set_defaults(handler=cmd_test)


def _add_diagnose(sub: Any) -> None:
    p = sub.add_parser(
        "diagnose",
        help="explain an offload failure from an error message or log",
        description="Match an error message or log against the known offload failure modes: the cause, how to "
        "confirm it (a check, kept apart from the fix), and the fix as overrides; when the text cannot decide, what "
        "to pass. With --config, the fix of an OOM, a slowdown or a host OOM is one of the planner's ranked options "
        "for that config (as recommend gives them, on --gpu/--num-gpus, with the text as the measured log); never a "
        "guessed fraction. With --before/--after it lists the offload keys that changed and the predicted memory "
        "change on that GPU and count.",
    )
    p.add_argument("--log", help="log file")
    p.add_argument("--error", help="error text")
    p.add_argument("--config", help="config of the failing run")
    p.add_argument("--before", help="config before the change")
    p.add_argument("--after", help="config after the change")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    _add_planner_inputs(p)
    p.set_defaults(handler=cmd_diagnose)


def _add_planner_inputs(p: argparse.ArgumentParser) -> None:
    """diagnose's planner inputs as flags, generated from ``PlanInputs`` as estimate's are (one declaration)."""
    from mbridge_offload.actions.diagnose_plan import input_names
    from mbridge_offload.plan.inputs.fields import PlanInputs, flag_name, help_text
    from mbridge_offload_tools.cli_plan import arg_kind

    group = p.add_argument_group(
        "planner inputs",
        "size the fix of an OOM, slowdown or host OOM with the config (as estimate and recommend take them); the "
        "error/log text is the measured log unless --measured-log is given, and an OOM in it sets --ooms",
    )
    for name in input_names():
        info = PlanInputs.model_fields[name]
        group.add_argument(flag_name(name), dest=name, default=None, help=help_text(name), **arg_kind(info.annotation))


def _add_serve(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run the MCP server",
        description="Run the MCP server (the same as mbridge-offload-mcp): the tools of docs/mcp.md over stdio or "
        "streamable HTTP; what it may read, write and run comes from these flags, never from a tool argument.",
    )
    from mbridge_offload_tools.guard import add_policy_flags, add_transport_flags

    add_transport_flags(p)
    add_policy_flags(p)
    p.set_defaults(handler=cmd_serve, json=False)


# ---------------------------------------------------------------------------------------------- apply


def _human_apply(d: dict[str, Any]) -> str:
    lines = []
    for c in d["changes"]:
        lines.append(f"{c['key']}: {c['old']!r} -> {c['new']!r}  ({c['why']})")
    if not d["changes"]:
        lines += d.get("notes", [])
    for f in d["findings"]:
        lines.append(f"{f['severity']}: {f['rule']}: {f['message']}")
    if d.get("diff"):
        lines += ["", d["diff"].rstrip("\n")]
    if d.get("refused"):
        lines.append(d["refused"])
    if d["written"]:
        lines.append(f"written: {d['written']}")
    elif not d.get("refused"):
        lines.append("dry run: nothing written (pass --output FILE or --in-place)")
    return "\n".join(lines)


def cmd_apply(args: argparse.Namespace) -> int:
    from mbridge_offload.actions.apply import apply_offload
    from mbridge_offload.config.sources import ConfigError
    from mbridge_offload_tools.cli_plan import plan_flags

    mode = args.mode or ("recommended" if args.option is not None else None)
    if mode is None:
        raise UsageError("give --mode (optimizer, activation, both, none, fine-grained, recommended) or --option N")
    try:
        result = apply_offload(
            args.config,
            mode,
            option=args.option,
            fraction=args.fraction,
            num_layers=args.num_layers,
            modules=args.modules,
            overrides=args.overrides,
            output=args.output,
            in_place=args.in_place,
            output_format=args.format,
            overwrite=args.force,
            allowed_root=args.allowed_root,
            planner=plan_flags(args, APPLY_OWN_INPUTS) or None,
        )
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    except (KeyError, ValueError) as exc:  # the planner: unknown GPU preset, a setup Megatron rejects
        raise UsageError(str(exc).strip("'\"")) from None
    data = result.to_dict()
    if args.format == "overrides" and not args.json:
        sys.stdout.write("".join(o + "\n" for o in result.overrides))
    else:
        emit(data, args.json, _human_apply)
    return EXIT_OK if result.ok and not result.refused else EXIT_FINDINGS


# ---------------------------------------------------------------------------------------------- test


_OUTCOMES = frozenset({"passed", "failed", "skipped", "error", "xfailed", "xpassed"})


def _human_test(d: dict[str, Any], streamed: frozenset[str] = frozenset()) -> str:
    """The human summary; the ``streamed`` node ids were already shown one per line as they ran (stderr), so they
    are not listed again: a terminal shows each test once."""
    lines = [f"{t['outcome']:8} {t['nodeid']}" for t in d["tests"] if t["nodeid"] not in streamed]
    for f in d["failures"]:
        lines += [f"--- {f['nodeid']}", f["message"] or ""]
    lines += d["notes"]
    if d.get("coverage"):
        lines.append(d["coverage"])
    lines.append(
        f"{d['passed']} passed, {d['failed']} failed, {d['skipped']} skipped, {d['errors']} errors "
        f"in {d['duration_s']:.1f} s"
    )
    return "\n".join(lines)


def cmd_test(args: argparse.Namespace) -> int:
    from mbridge_offload.actions.testresult import TestSuiteError
    from mbridge_offload.actions.testsuite import run_tests

    streamed: set[str] = set()  # node ids a progress line already showed ("<outcome>: <nodeid>")

    def progress(done: int, total: int | None, message: str) -> None:
        if not args.json:
            sys.stderr.write(f"[{done}/{total if total is not None else '?'}] {message}\n")
            outcome, sep, nodeid = message.partition(": ")
            if sep and outcome in _OUTCOMES:
                streamed.add(nodeid)

    if args.all and args.suite not in ("unit", "full"):
        raise UsageError(f"--all runs the whole unit suite; it does not combine with --suite {args.suite}")
    try:
        result = run_tests(
            k=args.k,
            bridge_repo=args.bridge_repo,
            suite="full" if args.all else args.suite,
            timeout_s=args.timeout,
            on_progress=progress,
            config=args.config,
            steps=args.steps,
            path=args.path,
        )
    except TestSuiteError as exc:
        raise UsageError(str(exc)) from None
    emit(result.to_dict(), args.json, lambda d: _human_test(d, frozenset(streamed)))
    return EXIT_OK if result.ok else EXIT_FINDINGS


# ---------------------------------------------------------------------------------------------- diagnose


def _human_diagnose(d: dict[str, Any]) -> str:
    lines = []
    for m in d["matches"]:
        lines += [f"{m['failure']}: {m['title']}", f"  cause:   {m['cause']}", f"  confirm: {m['confirm']}"]
        if m.get("confirm_overrides"):  # the experiment's overrides: a check, never to keep
            lines.append(f"  check:   {' '.join(m['confirm_overrides'])}  (to confirm only; not a fix)")
        if m["fix"]:
            lines.append(f"  fix:     {' '.join(m['fix'])}")
        elif m["actions"] and not d.get("needs"):
            lines.append("  fix:     not a config key; the steps below")
        lines += [f"  also:    {a}" for a in m["actions"]]
    lines += [f"to decide, pass: {n}" for n in d.get("needs", [])]
    if d.get("options"):
        from mbridge_offload_tools.cli_plan import option_lines

        lines.append("options (the planner's, ranked by step time among those that fit; apply --option N writes one):")
        lines += option_lines(d["options"])
    lines += _planner_lines(d)
    for f in d["findings"]:
        lines.append(f"{f['severity']}: {f['rule']}: {f['message']}")
    if d.get("comparison"):
        for c in d["comparison"]["changed"]:
            lines.append(f"changed {c['key']}: {c['before']!r} -> {c['after']!r}")
        c = d["comparison"]
        mem = c.get("memory_gb")
        if mem and mem.get("delta_total") is not None:
            where = f" on {c['num_gpus']['before']} x {c['gpu']['before']}" if c.get("gpu") else ""
            lines.append(
                f"predicted per-GPU peak (worst stage){where}: {mem['before']['total']:.2f} -> "
                f"{mem['after']['total']:.2f} GB (decimal, 10^9 bytes), {mem['delta_total']:+.2f} GB"
            )
        if d["comparison"].get("memory_note"):
            lines.append(d["comparison"]["memory_note"])
    lines += d["notes"]
    return "\n".join(lines) or "no known failure matched"


def _planner_lines(d: dict[str, Any]) -> list[str]:
    """The GPU, GPU count and evidence the planner used, with their sources (every input: --json assumptions)."""
    said = {a["name"]: a for a in d.get("assumptions", [])}
    if "gpu" not in said or "num_gpus" not in said:
        return []
    gpu, count = said["gpu"], said["num_gpus"]
    lines = [
        f"sized on {count['value']} x {gpu['value']} (GPU count: {count['source']}, GPU: {gpu['source']}); every "
        "input with its source is in --json assumptions"
    ]
    lines += [f"evidence: {n}" for n in (d.get("calibration") or {}).get("notes", [])]
    return lines


def cmd_diagnose(args: argparse.Namespace) -> int:
    from mbridge_offload.actions.diagnose import diagnose
    from mbridge_offload.config.sources import ConfigError, load

    if not any((args.log, args.error, args.config, args.before, args.after)):
        raise UsageError("diagnose needs --error TEXT, --log FILE, --config FILE, or --before/--after FILE")
    if (args.before is None) != (args.after is None):
        raise UsageError("pass both --before and --after, or neither")
    log = None
    if args.log:
        from mbridge_offload.config.reading import read_text_file

        log = read_text_file(args.log, what="log", tail=True)
    try:
        cfg = load(args.config) if args.config else None
        before = load(args.before) if args.before else None  # loaded: raw dict and source kept
        after = load(args.after) if args.after else None
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    from mbridge_offload.actions.diagnose_plan import input_names

    report = diagnose(
        error=args.error,
        log=log,
        config=cfg.config if cfg else None,
        raw=cfg.raw if cfg else None,
        before=before,
        after=after,
        source=cfg.source if cfg else None,
        planner={name: getattr(args, name) for name in input_names()},
    )
    emit(report.model_dump(mode="json"), args.json, _human_diagnose)
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    from mbridge_offload_tools.server import run

    try:
        run(args.transport, args.host, args.port, args.roots, args.bridge_repos, args.allow_bridge_venv)
    except OSError as exc:  # port in use
        sys.stderr.write(f"mbridge-offload serve: {exc}\n")
        return EXIT_BAD_INPUT
    return EXIT_OK
