"""Generated bad inputs and faults for the CLI and the MCP server (tests/tools/test_robustness.py and
benchmarks/bad_inputs.py share them).

:func:`build_sandbox` writes a sandbox of hostile files (alias bombs, deep nesting, a FIFO, a 50 MB sparse file,
non-UTF-8 bytes, NaN/inf/huge numbers, wrong types, symlink games, a read-only file, ...) inside ``outer/sandbox``;
:func:`cases` crosses them with every command and tool that reads a config, and adds usage, output-path and
planner cases. Every case must be answered with exit code 2 (MCP: ``isError``) and exactly one JSON error object,
within a deadline, without a traceback, and without changing any file.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support import tree

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 20.0  # per case, as judged here
# The project's own per-call deadline (MBRIDGE_OFFLOAD_DEADLINE_S, default 60 s), lowered for the suite so that an
# input that is slow to process is stopped by it quickly. The CLI and the server must still answer exit 2/isError.
CALL_DEADLINE_S = "5"

GOOD = """\
# a small, valid Bridge config
model:
  num_layers: 8  # decoder layers
  hidden_size: 1024
  num_attention_heads: 8
  vocab_size: 32000
  seq_length: 2048
  gradient_accumulation_fusion: False
  tp_comm_overlap_cfg:
optimizer:
  optimizer: adam
  lr: 0.0003
  use_distributed_optimizer: true
"""


@dataclass
class Case:
    """One bad input: a CLI argv (``--json`` is added) and/or an MCP tool call."""

    id: str
    cli: list[str] | None = None
    mcp: tuple[str, dict[str, Any]] | None = None
    stdin: bytes | None = None


@dataclass
class Outcome:
    """How one case was answered."""

    case: str
    surface: str
    held: bool
    seconds: float
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- the sandbox


def _alias_bomb(levels: int, width: int = 9) -> str:
    lines = ['a0: &a0 ["lol"]']
    for i in range(1, levels + 1):
        refs = ", ".join([f"*a{i - 1}"] * width)
        lines.append(f"a{i}: &a{i} [{refs}]")
    lines.append(f"model: {{num_layers: 4, extra: *a{levels}}}")
    return "\n".join(lines) + "\n"


def _deep_block(levels: int) -> str:
    lines = ["model:"] + [f"{'  ' * (i + 1)}k{i}:" for i in range(levels)]
    return "\n".join(lines) + " 1\n"


def _files() -> dict[str, str | bytes]:
    texts: dict[str, str | bytes] = {
        "empty_mapping_list.yaml": "- 1\n- 2\n",
        "scalar_top.yaml": "42\n",
        "section_scalar.yaml": "model: 5\n",
        "malformed.yaml": "model:\n  num_layers: [16\n",
        "tabs.yaml": "model:\n\tnum_layers: 4\n",
        "duplicate_keys.yaml": "model:\n  num_layers: 4\n  num_layers: 8\n",
        # Wrong types where the loader decides: model/optimizer/ddp keep one as written, for megatron-core's own
        # checks to judge (tests/config/test_sources.py::test_wrong_type_in_megatron_core_section_*).
        "bad_int_text.yaml": "train:\n  micro_batch_size: abc\n",
        "bad_int_list.yaml": "train:\n  micro_batch_size: [1, 2]\n",
        "bad_int_map.yaml": "train:\n  global_batch_size: {a: 1}\n",
        "bad_float_text.yaml": "dataset:\n  seq_length: half\n",
        "nan.yaml": "optimizer:\n  optimizer_offload_fraction: .nan\n",
        "inf.yaml": "model:\n  num_layers: .inf\n",
        "neg_inf.yaml": "model:\n  cpu_offloading_num_layers: -.inf\n",
        "float_overflow.yaml": "optimizer:\n  optimizer_offload_fraction: 1e999\n",
        "huge_int.yaml": "model:\n  num_layers: " + "9" * 5000 + "\n",
        "huge_int.json": '{"model": {"num_layers": ' + "9" * 5000 + "}}",
        "nan.json": '{"optimizer": {"optimizer_offload_fraction": NaN}}',
        "infinity.json": '{"model": {"num_layers": Infinity}}',
        "neg_infinity.json": '{"optimizer": {"lr": -Infinity}}',
        "malformed.json": '{"model": {"num_layers": 4,}}',
        "deep.json": "{" + '"a": {' * 100_000 + "}" * 100_001,
        "deep_json_40.json": '{"model": ' + '{"a": ' * 40 + "1" + "}" * 41,
        "deep_flow.yaml": "model: " + "[" * 5000 + "]" * 5000 + "\n",
        "deep_flow_40.yaml": "model: " + "[" * 40 + "]" * 40 + "\n",
        "deep_block.yaml": _deep_block(60),
        "alias_bomb_9.yaml": _alias_bomb(9),
        "alias_bomb_6.yaml": _alias_bomb(6),
        "alias_bomb_wide.yaml": _alias_bomb(3, width=200),
        "not_utf8.yaml": b"model:\n  num_layers: \xff\xfe\n",
        "binary.yaml": bytes(range(256)) * 4,
        "big_3mb.yaml": "model:\n" + "".join(f"  k{i}: {i}\n" for i in range(260_000)),
        "nul_bytes.yaml": "model:\n  num_layers: 4\x00\n",
        # Parallel sizes megatron-core's dataclass accepts but no run can have: refused by every tool.
        "parallel_cp_zero.yaml": "model:\n  num_layers: 8\n  num_attention_heads: 8\n  context_parallel_size: 0\n",
        "parallel_tp_negative.yaml": "model:\n  num_attention_heads: 8\n  tensor_model_parallel_size: -2\n",
        "parallel_etp_zero.json": '{"model": {"num_layers": 8, "expert_tensor_parallel_size": 0}}',
    }
    return texts


def build_sandbox(outer: Path) -> Path:
    """Write the hostile files into ``outer/sandbox`` (and a decoy beside it); return the sandbox."""
    sandbox = outer / "sandbox"
    sandbox.mkdir(parents=True, exist_ok=True)
    (outer / "decoy.yaml").write_text(GOOD, encoding="utf-8")  # outside the sandbox: must never change
    (sandbox / "good.yaml").write_text(GOOD, encoding="utf-8")
    (sandbox / "README.md").write_text("# not a config\n", encoding="utf-8")
    for name, content in _files().items():
        path = sandbox / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    with open(sandbox / "big_50mb.yaml", "wb") as handle:
        handle.truncate(50 * 1024 * 1024)  # sparse: 50 MB by size, nothing on disk
    (sandbox / "a_directory.yaml").mkdir(exist_ok=True)
    fifo = sandbox / "fifo.yaml"
    if not fifo.exists():
        os.mkfifo(fifo)
    readonly = sandbox / "readonly.yaml"
    readonly.write_text(GOOD, encoding="utf-8")
    readonly.chmod(0o444)
    links = {
        "link_dev_zero.yaml": "/dev/zero",
        "link_outside.yaml": str(outer / "decoy.yaml"),
        "link_dangling.yaml": str(sandbox / "no-such-target.yaml"),
        "link_loop_a.yaml": str(sandbox / "link_loop_b.yaml"),
        "link_loop_b.yaml": str(sandbox / "link_loop_a.yaml"),
        "link_dir.yaml": str(sandbox / "a_directory.yaml"),
        "link_fifo.yaml": str(fifo),
    }
    for name, target in links.items():
        if not (sandbox / name).is_symlink():
            os.symlink(target, sandbox / name)
    (sandbox / "subdir").mkdir(exist_ok=True)
    _plot_targets(sandbox, outer)
    return sandbox


def _plot_targets(sandbox: Path, outer: Path) -> None:
    """Pictures ``plot`` must not write over: the same hostile kinds as apply's outputs, with a picture's name."""
    (sandbox / "picture.svg").write_text("<svg/>\n", encoding="utf-8")
    readonly = sandbox / "readonly.svg"
    readonly.write_text("<svg/>\n", encoding="utf-8")
    readonly.chmod(0o444)
    (sandbox / "a_directory.svg").mkdir(exist_ok=True)
    if not (sandbox / "fifo.svg").exists():
        os.mkfifo(sandbox / "fifo.svg")
    (outer / "decoy.svg").write_text("<svg/>\n", encoding="utf-8")
    for name, target in {"link_outside.svg": str(outer / "decoy.svg"), "link_dev_zero.png": "/dev/zero"}.items():
        if not (sandbox / name).is_symlink():
            os.symlink(target, sandbox / name)


# ---------------------------------------------------------------------------------------------- the cases

_READ_FILES = [
    *sorted(_files()),
    "big_50mb.yaml",
    "a_directory.yaml",
    "fifo.yaml",
    "link_dev_zero.yaml",
    "link_dangling.yaml",
    "link_loop_a.yaml",
    "link_dir.yaml",
    "link_fifo.yaml",
    "no_such_file.yaml",
]


def _reading_cases(sandbox: Path) -> list[Case]:
    out = []
    for name in _READ_FILES:
        path = str(sandbox / name)
        out += [
            Case(f"validate:{name}", cli=["validate", path], mcp=("validate_config", {"config": path})),
            Case(
                f"apply:{name}",
                cli=["apply", path, "--mode", "optimizer"],
                mcp=("apply_offload", {"config": path, "mode": "optimizer"}),
            ),
            Case(
                f"recommend:{name}",
                cli=["recommend", path, "--gpu", "h100-80gb"],
                mcp=("recommend_mode", {"config": path, "gpu": "h100-80gb"}),
            ),
            Case(f"diagnose:{name}", cli=["diagnose", "--config", path], mcp=("diagnose_failure", {"config": path})),
        ]
    for device in ("/dev/zero", "/dev/null", "/dev/urandom", "/proc/self/mem"):
        out.append(Case(f"validate:{device}", cli=["validate", device], mcp=("validate_config", {"config": device})))
    out.append(Case("diagnose-log:fifo", cli=["diagnose", "--log", str(sandbox / "fifo.yaml")]))
    out.append(Case("diagnose-log:dir", cli=["diagnose", "--log", str(sandbox / "a_directory.yaml")]))
    out.append(Case("diagnose-log:dev-zero", cli=["diagnose", "--log", "/dev/zero"]))
    if os.geteuid() != 0:  # root reads anything: a mode-000 file is only unreadable for other users
        locked = sandbox / "locked.yaml"
        out.append(
            Case("validate:mode-000", cli=["validate", str(locked)], mcp=("validate_config", {"config": str(locked)}))
        )
    return out


def _inline_cases() -> list[Case]:
    texts = {
        "alias-bomb": _alias_bomb(9),
        "deep-flow": "model: " + "[" * 3000 + "]" * 3000,
        "deep-json": "{" + '"a": {' * 3000 + "}" * 3001,
        "json-nan": '{"optimizer": {"lr": NaN}}',
        "json-inf": '{"model": {"num_layers": Infinity}}',
        "yaml-nan": "model:\n  num_layers: .nan\n",
        # A wrong type where the loader decides (model/optimizer/ddp keep one as written: megatron-core judges it).
        "type": "train:\n  micro_batch_size: [1]\n",
        "top-list": "- a\n- b\n",
        "huge-int": "model:\n  num_layers: " + "1" * 4500 + "\n",
        "too-long": "model:\n" + "  k: 1\n" * 400_000,
        "nul": "model:\n  num_layers: 4\x00\n",
    }
    out = []
    for name, text in texts.items():
        out.append(Case(f"inline-validate:{name}", mcp=("validate_config", {"config": text})))
        out.append(
            Case(f"inline-apply:{name}", mcp=("apply_offload", {"config": text, "mode": "both", "num_layers": 2}))
        )
    out.append(Case("stdin:not-utf8", cli=["validate", "-"], stdin=b"model:\n  num_layers: \xff\n"))
    out.append(Case("stdin:alias-bomb", cli=["validate", "-"], stdin=_alias_bomb(9).encode()))
    out.append(Case("stdin:too-big", cli=["validate", "-"], stdin=b"model:\n" + b"  k: 1\n" * 400_000))
    out.append(Case("stdin:nan-json", cli=["validate", "-"], stdin=b'{"optimizer": {"lr": NaN}}'))
    return out


def _output_cases(sandbox: Path) -> list[Case]:
    good = str(sandbox / "good.yaml")
    outer = sandbox.parent
    targets = {
        "existing-readme": str(sandbox / "README.md"),
        "same-as-input": good,
        "traversal": str(sandbox / ".." / "escaped.yaml"),
        "absolute-outside": str(outer / "decoy.yaml"),
        "a-directory": str(sandbox / "a_directory.yaml"),
        "missing-dir": str(sandbox / "no" / "such" / "dir" / "x.yaml"),
        "symlink-outside": str(sandbox / "link_outside.yaml"),
        "symlink-dev-zero": str(sandbox / "link_dev_zero.yaml"),
        "fifo": str(sandbox / "fifo.yaml"),
        "readonly": str(sandbox / "readonly.yaml"),
        "dev-null": "/dev/null",
        "etc": "/etc/mbridge-offload-robustness.yaml",
    }
    out = []
    for name, target in targets.items():
        out.append(
            Case(
                f"output:{name}",
                cli=["apply", good, "--mode", "optimizer", "--output", target],
                mcp=("apply_offload", {"config": good, "mode": "optimizer", "output": target}),
            )
        )
    for name in ("readonly.yaml", "link_outside.yaml", "link_dev_zero.yaml"):
        path = str(sandbox / name)
        out.append(
            Case(
                f"in-place:{name}",
                cli=["apply", path, "--mode", "optimizer", "--in-place"],
                mcp=("apply_offload", {"config": path, "mode": "optimizer", "in_place": True}),
            )
        )
    for name in ("readonly", "absolute-outside", "symlink-outside", "a-directory"):
        out.append(
            Case(
                f"forced-output:{name}",
                cli=["apply", good, "--mode", "optimizer", "--output", targets[name], "--force"],
                mcp=(
                    "apply_offload",
                    {"config": good, "mode": "optimizer", "output": targets[name], "overwrite": True},
                ),
            )
        )
    out.append(
        Case(
            "in-place-overrides-format",
            cli=["apply", good, "--mode", "optimizer", "--in-place", "--format", "overrides"],
            mcp=("apply_offload", {"config": good, "mode": "optimizer", "in_place": True, "format": "overrides"}),
        )
    )
    out.append(
        Case(
            "mcp-allowed-root-argument",
            mcp=(
                "apply_offload",
                {"config": good, "mode": "optimizer", "output": str(outer / "x.yaml"), "allowed_root": "/"},
            ),
        )
    )
    out += _plot_output_cases(sandbox)
    out.append(Case("mcp-read-outside-roots", mcp=("validate_config", {"config": str(outer / "decoy.yaml")})))
    out.append(
        Case("mcp-read-via-link-outside", mcp=("validate_config", {"config": str(sandbox / "link_outside.yaml")}))
    )
    out.append(Case("mcp-bridge-repo-not-allowed", mcp=("run_unit_tests", {"bridge_repo": str(sandbox)})))
    out.append(Case("mcp-bridge-repo-root", mcp=("run_unit_tests", {"bridge_repo": "/"})))
    return out


def _plot_output_cases(sandbox: Path) -> list[Case]:
    outer = sandbox.parent
    sweep = ["--model", "llama3-8b", "--sweep", "micro_batch_size=1,2"]
    targets = {  # name → (path, with consent)
        "existing": (sandbox / "picture.svg", False),
        "readonly": (sandbox / "readonly.svg", True),
        "a-directory": (sandbox / "a_directory.svg", True),
        "fifo": (sandbox / "fifo.svg", True),
        "symlink-outside": (sandbox / "link_outside.svg", True),
        "symlink-dev-zero": (sandbox / "link_dev_zero.png", True),
        "absolute-outside": (outer / "escaped.svg", False),
        "traversal": (sandbox / ".." / "escaped.svg", False),
        "missing-dir": (sandbox / "no" / "such" / "dir" / "x.svg", False),
        "not-a-picture": (sandbox / "good.yaml", True),
        "etc": (Path("/etc/mbridge-offload-robustness.svg"), False),
    }
    out = []
    for name, (target, consent) in targets.items():
        force = ["--force"] if consent else []
        out.append(
            Case(
                f"plot-output:{name}",
                cli=["plot", *sweep, "--output", str(target), *force],
                mcp=(
                    "plot_offload",
                    {
                        "model": "llama3-8b",
                        "sweep": "micro_batch_size=1,2",
                        "output": str(target),
                        "overwrite": consent,
                    },
                ),
            )
        )
    return out


def _usage_cases(sandbox: Path) -> list[Case]:
    good = str(sandbox / "good.yaml")
    argvs = {
        "no-command": [],
        "unknown-command": ["frobnicate"],
        "unknown-flag": ["validate", good, "--no-such-flag"],
        "validate-nothing": ["validate"],
        "validate-two-sources": ["validate", good, "--recipe", "x"],
        "bad-target": ["validate", good, "--target", "megatron-core==9.9"],
        "bad-env": ["validate", good, "--env", "NOEQUALS"],
        "bad-override": ["validate", good, "--set", "model.="],
        "override-deep": ["apply", good, "--mode", "optimizer", "--set", "model.a.b.c=1"],
        "override-delete-missing": ["validate", good, "--set", "~model.nope"],
        "override-type": ["validate", good, "--set", "train.micro_batch_size=abc"],
        "override-nan": ["validate", good, "--set", "optimizer.optimizer_offload_fraction=nan"],
        "override-inf": ["validate", good, "--set", "model.num_layers=inf"],
        "bad-mode": ["apply", good, "--mode", "everything"],
        "fraction-2": ["apply", good, "--mode", "optimizer", "--fraction", "2"],
        "fraction-neg": ["apply", good, "--mode", "optimizer", "--fraction", "-0.5"],
        "fraction-nan": ["apply", good, "--mode", "optimizer", "--fraction", "nan"],
        "fraction-inf": ["apply", good, "--mode", "optimizer", "--fraction", "inf"],
        "fraction-text": ["apply", good, "--mode", "optimizer", "--fraction", "half"],
        "layers-0": ["apply", good, "--mode", "activation", "--num-layers", "0"],
        "layers-neg": ["apply", good, "--mode", "activation", "--num-layers", "-3"],
        "layers-huge": ["apply", good, "--mode", "activation", "--num-layers", "10" * 30],
        "layers-with-optimizer": ["apply", good, "--mode", "optimizer", "--num-layers", "2"],
        "output-and-in-place": ["apply", good, "--mode", "optimizer", "--output", "x.yaml", "--in-place"],
        "in-place-inline": ["apply", "model:\n  num_layers: 4\n", "--mode", "optimizer", "--in-place"],
        "recipe-missing": ["validate", "--recipe", "no_such_recipe_config"],
        "megatron-args-quote": ["validate", "--megatron-args", "--num-layers 'x"],
        "megatron-args-type": ["validate", "--megatron-args", "--num-layers abc"],
        "test-bad-k": ["test", "-k", "a; rm -rf ~"],
        "test-path-outside": ["test", "--path", "../../etc/passwd"],
        "test-bridge-not-repo": ["test", "--bridge-repo", str(sandbox)],
        "test-timeout-0": ["test", "--timeout", "0"],
        "diagnose-nothing": ["diagnose"],
        "diagnose-before-only": ["diagnose", "--before", good],
        "plot-nothing": ["plot", "--model", "llama3-8b"],
        "plot-bad-kind": ["plot", "--model", "llama3-8b", "--kind", "bars"],
        "plot-sweep-not-an-input": ["plot", "--model", "llama3-8b", "--sweep", "batchsize=1:4:1"],
        "plot-sweep-text-input": ["plot", "--model", "llama3-8b", "--sweep", "gpu=1:2:1"],
        "plot-sweep-empty": ["plot", "--model", "llama3-8b", "--sweep", "optimizer_offload_fraction=1:0:0.1"],
        "plot-sweep-step-0": ["plot", "--model", "llama3-8b", "--sweep", "optimizer_offload_fraction=0:1:0"],
        "plot-sweep-malformed": ["plot", "--model", "llama3-8b", "--sweep", "optimizer_offload_fraction=0-1"],
        "plot-sweep-nan": ["plot", "--model", "llama3-8b", "--sweep", "optimizer_offload_fraction=nan:1:0.5"],
        "plot-sweep-huge": ["plot", "--model", "llama3-8b", "--sweep", "num_layers=1:" + "9" * 40 + ":1"],
        "plot-sweep-out-of-bounds": ["plot", "--model", "llama3-8b", "--sweep", "tp=0:2:1"],
        "plot-config-bad": ["plot", str(sandbox / "malformed.yaml"), "--sweep", "micro_batch_size=1,2"],
    }
    out = [Case(f"usage:{name}", cli=argv) for name, argv in argvs.items()]
    tool_args = {
        "validate-missing-config": ("validate_config", {}),
        "validate-empty-config": ("validate_config", {"config": ""}),
        "validate-config-number": ("validate_config", {"config": 5}),
        "validate-overrides-string": ("validate_config", {"config": good, "overrides": "model.num_layers=4"}),
        "validate-bad-target": ("validate_config", {"config": good, "target": "megatron-core==9.9"}),
        "apply-bad-mode": ("apply_offload", {"config": good, "mode": "everything"}),
        "apply-fraction-2": ("apply_offload", {"config": good, "mode": "optimizer", "fraction": 2}),
        "apply-fraction-neg": ("apply_offload", {"config": good, "mode": "optimizer", "fraction": -1}),
        "apply-layers-0": ("apply_offload", {"config": good, "mode": "activation", "num_layers": 0}),
        "apply-layers-huge": ("apply_offload", {"config": good, "mode": "activation", "num_layers": 10**30}),
        "apply-in-place-inline": (
            "apply_offload",
            {"config": "model:\n  num_layers: 4\n", "mode": "optimizer", "in_place": True},
        ),
        "apply-override-deep": ("apply_offload", {"config": good, "mode": "optimizer", "overrides": ["model.a.b=1"]}),
        "diagnose-nothing": ("diagnose_failure", {}),
        "diagnose-before-only": ("diagnose_failure", {"before": good}),
        "tests-bad-k": ("run_unit_tests", {"k": "a; rm -rf ~"}),
        "tests-path-outside": ("run_unit_tests", {"path": "../../etc/passwd"}),
        "tests-timeout-0": ("run_unit_tests", {"timeout_s": 0}),
        "tests-steps-1": ("run_unit_tests", {"suite": "parity", "steps": 1}),
        "plot-nothing": ("plot_offload", {"model": "llama3-8b"}),
        "plot-bad-kind": ("plot_offload", {"model": "llama3-8b", "kind": "bars"}),
        "plot-sweep-not-an-input": ("plot_offload", {"model": "llama3-8b", "sweep": "batchsize=1:4:1"}),
        "plot-sweep-empty": ("plot_offload", {"model": "llama3-8b", "sweep": "optimizer_offload_fraction=1:0:0.1"}),
        "plot-sweep-huge": ("plot_offload", {"model": "llama3-8b", "sweep": "num_layers=1:" + "9" * 40 + ":1"}),
        "plot-no-model": ("plot_offload", {"sweep": "micro_batch_size=1,2"}),
        "plot-bad-format": ("plot_offload", {"model": "llama3-8b", "kind": "options", "format": "jpeg"}),
    }
    out += [Case(f"tool:{name}", mcp=call) for name, call in tool_args.items()]
    return out


def _planner_cases(sandbox: Path) -> list[Case]:
    model_files = {
        "layers-1e12": "model:\n  num_layers: 1000000000000\n  hidden_size: 4096\n  num_attention_heads: 32\n",
        "no-vocab": "model:\n  num_layers: 32\n  hidden_size: 4096\n  num_attention_heads: 32\n",
        "layers-neg": "model:\n  num_layers: -4\n  hidden_size: 4096\n  num_attention_heads: 32\n",
        "heads-0": "model:\n  num_layers: 32\n  hidden_size: 4096\n  num_attention_heads: 0\n",
        "hidden-0": "model:\n  num_layers: 32\n  hidden_size: 0\n  num_attention_heads: 32\n",
        "seq-1e12": "model:\n  num_layers: 32\n  hidden_size: 4096\n  num_attention_heads: 32\n  seq_length: 1000000000000\n",  # noqa: E501
        "vocab-neg": "model:\n  num_layers: 32\n  hidden_size: 4096\n  num_attention_heads: 32\n  vocab_size: -1\n",
    }
    out = []
    for name, text in model_files.items():
        path = sandbox / f"planner_{name}.yaml"
        if name != "no-vocab" and "vocab_size" not in text:  # else the missing vocab, not the bound, is refused
            text += "  vocab_size: 32000\n"
        path.write_text(text, encoding="utf-8")
        out.append(
            Case(
                f"planner:{name}",
                cli=["estimate", "--model-config", str(path), "--gpu", "h100-80gb"],
                mcp=("recommend_mode", {"config": str(path), "gpu": "h100-80gb"}),
            )
        )
    flags = {
        "num-gpus-0": ["--num-gpus", "0"],
        "tp-neg": ["--tp", "-2"],
        "gpu-mem-0": ["--gpu-memory-gb", "0"],
        "gpu-mem-neg": ["--gpu-memory-gb", "-80"],
        "gpu-mem-nan": ["--gpu-memory-gb", "nan"],
        "gpu-mem-inf": ["--gpu-memory-gb", "inf"],
        "link-0": ["--link-gbps", "0"],
        "link-neg": ["--link-gbps", "-1"],
        "link-nan": ["--link-gbps", "nan"],
        "host-bw-0": ["--host-bw-gbps", "0"],
        "seq-1e12": ["--seq-length", "1000000000000"],
        "mbs-huge": ["--micro-batch-size", "1" + "0" * 30],
        "fraction-nan": ["--optimizer-offload-fraction", "nan"],
        "cpu-threads-0": ["--cpu-threads", "0"],
        "mfu-0": ["--mfu", "0"],
        "mfu-nan": ["--mfu", "nan"],
        "baseline-neg": ["--baseline-step-s", "-1"],
        "unknown-gpu": ["--gpu", "tpu-v9"],
        "unknown-model": ["--model", "gpt-9"],
    }
    for name, extra in flags.items():
        argv = ["estimate", *(["--model", "llama3-8b"] if "--model" not in extra else []), *extra]
        out.append(Case(f"estimate:{name}", cli=argv))
    tool_flags = {
        "gpu-mem-0": {"gpu_memory_gb": 0},
        "gpu-mem-neg": {"gpu_memory_gb": -1},
        "num-gpus-0": {"num_gpus": 0},
        "tp-0": {"tp": 0},
        "seq-1e12": {"seq_length": 10**12},
        "mbs-1e30": {"micro_batch_size": 10**30},
        "unknown-gpu": {"gpu": "tpu-v9"},
        "unknown-model": {"model": "gpt-9"},
        "no-model": {},
    }
    for name, args in tool_flags.items():
        call = {"model": "llama3-8b", **args} if "model" not in args and name != "no-model" else args
        out.append(Case(f"recommend-tool:{name}", mcp=("recommend_mode", call)))
    return out


def cases(sandbox: Path) -> list[Case]:
    """Every bad input, for a sandbox made by :func:`build_sandbox` (a case that only a deadline stops, last)."""
    generated = (
        _reading_cases(sandbox)
        + _inline_cases()
        + _output_cases(sandbox)
        + _usage_cases(sandbox)
        + _planner_cases(sandbox)
    )
    return sorted(generated, key=lambda c: c.id == "planner:layers-1e12")


# ---------------------------------------------------------------------------------------------- checking


def snapshot(root: Path) -> dict[str, str]:
    """``{relative path: what it is}`` for everything under ``root`` (file hashes; never opens a FIFO)."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            info = os.lstat(path)
            rel = str(path.relative_to(root))
            if stat.S_ISLNK(info.st_mode):
                out[rel] = "link:" + os.readlink(path)
            elif stat.S_ISREG(info.st_mode):
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                out[rel] = f"file:{stat.S_IMODE(info.st_mode):o}:{digest}"
            else:
                out[rel] = f"other:{stat.S_IFMT(info.st_mode):o}"
    return out


def check_error_json(stdout: str) -> str | None:
    """None when ``stdout`` is exactly one JSON error object; else what is wrong."""
    text = stdout.strip()
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        return f"stdout is not one JSON object: {text[:200]!r}"
    if not isinstance(payload, dict) or payload.get("ok") is not False or not isinstance(payload.get("error"), str):
        return f"not an error object: {text[:200]!r}"
    if not payload["error"].strip():
        return "empty error message"
    return None


def run_cli_inprocess(case: Case, cwd: Path) -> Outcome:
    """Run ``mbridge-offload`` in this process (main thread: its deadline alarm works) and judge the answer."""
    from mbridge_offload_tools.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    stdin = io.TextIOWrapper(io.BytesIO(case.stdin or b""), encoding="utf-8")
    old_cwd, old_stdin, old_deadline = os.getcwd(), sys.stdin, os.environ.get("MBRIDGE_OFFLOAD_DEADLINE_S")
    start = time.perf_counter()
    code: Any = None
    try:
        os.environ["MBRIDGE_OFFLOAD_DEADLINE_S"] = CALL_DEADLINE_S
        os.chdir(cwd)
        sys.stdin = stdin
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main([*(case.cli or []), "--json"])
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:
        code = f"raised {type(exc).__name__}: {exc}"
    finally:
        sys.stdin = old_stdin
        os.chdir(old_cwd)
        if old_deadline is None:
            os.environ.pop("MBRIDGE_OFFLOAD_DEADLINE_S", None)
        else:
            os.environ["MBRIDGE_OFFLOAD_DEADLINE_S"] = old_deadline
    return _judge(case, "cli", code, out.getvalue(), err.getvalue(), time.perf_counter() - start)


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=tree.pythonpath(inherit=True),
        MBRIDGE_OFFLOAD_DEADLINE_S=CALL_DEADLINE_S,
    )


def run_cli_subprocess(case: Case, cwd: Path) -> Outcome:
    """Run ``python -m mbridge_offload_tools`` as a user would and judge the answer."""
    env = _env()
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "mbridge_offload_tools", *(case.cli or []), "--json"],
            cwd=cwd,
            env=env,
            input=case.stdin or b"",
            capture_output=True,
            timeout=DEADLINE_S * 3,
        )
    except subprocess.TimeoutExpired:
        return Outcome(case.id, "cli-subprocess", False, time.perf_counter() - start, "no answer")
    out, err = proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
    return _judge(case, "cli-subprocess", proc.returncode, out, err, time.perf_counter() - start)


def _judge(case: Case, surface: str, code: Any, out: str, err: str, seconds: float) -> Outcome:
    problems = []
    if code != 2:
        problems.append(f"exit {code!r}, expected 2")
    problem = check_error_json(out)
    if problem:
        problems.append(problem)
    if "Traceback" in out + err:
        problems.append("traceback printed")
    if seconds > DEADLINE_S:
        problems.append(f"took {seconds:.1f} s")
    return Outcome(case.id, surface, not problems, seconds, "; ".join(problems)[:400])


async def run_mcp_cases(client: Any, cases: list[Case], normal: tuple[str, dict[str, Any]]) -> list[Outcome]:
    """Call each case's tool on one live session; after each, a normal call must still be answered."""
    import anyio

    outcomes = []
    for case in cases:
        if case.mcp is None:
            continue
        name, args = case.mcp
        start = time.perf_counter()
        problems = []
        try:
            with anyio.fail_after(DEADLINE_S):
                result = await client.call_tool(name, args)
            text = " ".join(getattr(c, "text", "") for c in result.content)
            if not result.is_error:
                problems.append("not an error")
            if not text.strip() or "Traceback" in text:
                problems.append(f"bad error text: {text[:200]!r}")
        except TimeoutError:
            problems.append("no answer within the deadline")
        except Exception as exc:
            problems.append(f"call raised {type(exc).__name__}: {exc}")
        seconds = time.perf_counter() - start
        try:
            with anyio.fail_after(DEADLINE_S):
                after = await client.call_tool(*normal)
            if after.is_error:
                problems.append("the normal call after it failed")
        except Exception as exc:
            problems.append(f"the server stopped answering ({type(exc).__name__})")
        outcomes.append(Outcome(case.id, "mcp", not problems, seconds, "; ".join(problems)[:400]))
    return outcomes


def server_params(sandbox: Path) -> Any:
    """A stdio server started the way a user starts it, contained to the sandbox."""
    from mcp import StdioServerParameters

    env = _env()
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "mbridge_offload_tools", "serve", "--root", str(sandbox)],
        cwd=str(sandbox),
        env=env,
    )
