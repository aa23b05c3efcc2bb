"""``python -m mbridge_offload_tools.docgen.docs.walkthrough``: capture the real CLI output shown in
docs/walkthrough.md.

Each block is the output of its command, run in a scratch folder with the bundled example; ``test``'s durations make
this a step run on purpose (not ``make docs``), and ``tests/tools/test_docs.py`` compares after :func:`normalise`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from mbridge_offload_tools.docgen.registry import ROOT, fill

DOC = ROOT / "docs/walkthrough.md"
GUIDE = ROOT / "docs/cpu-offloading.md"
EXAMPLE = ROOT / "examples/qwen3_30b_a3b_pretrain.yaml"
MAX_LINES = 80
NOTE = (
    "<!-- real output, captured by `python -m mbridge_offload_tools.docgen.docs.walkthrough`; "
    "rerun it, do not edit by hand -->\n"
)

# section name → the command lines to run, in order (all in the same scratch folder; see prepare()).
CAPTURES: dict[str, list[str]] = {
    "opt-naive": ["mbridge-offload validate run.yaml --set optimizer.optimizer_cpu_offload=true"],
    "opt-apply": ["mbridge-offload apply run.yaml --mode optimizer --fraction 0.5 --output run.opt.yaml"],
    "opt-validate": ["mbridge-offload validate run.opt.yaml --json"],
    "act-naive": [
        "mbridge-offload validate run.pp1.yaml --set model.cpu_offloading=true --set model.cpu_offloading_num_layers=4"
    ],
    "act-apply": ["mbridge-offload apply run.pp1.yaml --mode activation --num-layers 4 --output run.act.yaml"],
    "act-validate": ["mbridge-offload validate run.act.yaml"],
    "act-pp2": ["mbridge-offload apply run.yaml --mode activation --num-layers 4 --output run.act2.yaml"],
    "tests-ours": ["mbridge-offload test -k cpu_offload --json"],
    "tests-bridge": ["mbridge-offload test --bridge-repo . --json"],
    "qwen-recommend-default": [
        "mbridge-offload recommend --model qwen3-30b-a3b --gpu h100-80gb --num-gpus 16 --tp 2 --pp 2 --ep 4"
    ],
    "qwen-activation": [
        "mbridge-offload validate qwen3.yaml --set optimizer.optimizer_cpu_offload=false "
        "--set model.cpu_offloading=true --set model.cpu_offloading_num_layers=24"
    ],
    "qwen-activation-pp1": [
        "mbridge-offload estimate --model qwen3-30b-a3b --gpu h100-80gb --num-gpus 16 --tp 2 --pp 1 --ep 4 "
        "--recompute none --activation-offload-layers 24"
    ],
    "qwen-diagnose": [
        'mbridge-offload diagnose --error "ValueError: Currently there is no support for Pipeline parallelism '
        'with CPU offloading"'
    ],
}

_QWEN = "mbridge-offload estimate --model qwen3-30b-a3b --gpu h100-80gb --num-gpus 16 --tp 2 --pp 2 --ep 4"
_LLAMA = "mbridge-offload estimate --model llama3-8b --gpu h100-80gb --num-gpus 8 --tp 2 --seq-length 16384"

# The worked examples of docs/cpu-offloading.md (its appended part).
GUIDE_CAPTURES: dict[str, list[str]] = {
    "guide-qwen-0": [_QWEN],
    "guide-qwen-50": [f"{_QWEN} --optimizer-offload-fraction 0.5"],
    "guide-qwen-100": [f"{_QWEN} --optimizer-offload-fraction 1.0"],
    "guide-llama-0": [_LLAMA],
    "guide-llama-3": [f"{_LLAMA} --activation-offload-layers 3"],
}

# The scratch folder: the bundled example (qwen3.yaml), the same without its three optimizer-offload lines
# (run.yaml: a run that offloads nothing yet), and a PP=1 variant with the recipe's recompute and local CUDA graphs on
# (run.pp1.yaml: what a user who wants activation offloading typically starts from).
_OFFLOAD_LINES = (
    "optimizer_cpu_offload",
    "optimizer_offload_fraction",
    "overlap_cpu_optimizer",
    "Optimizer offloading:",
)
_PP1_EDITS = (
    ("pipeline_model_parallel_size: 2  # activation offloading needs 1", "pipeline_model_parallel_size: 1"),
    ("cuda_graph_impl: none", "cuda_graph_impl: local"),
)


def prepare(cwd: Path) -> None:
    text = EXAMPLE.read_text()
    (cwd / "qwen3.yaml").write_text(text)
    base = "".join(line for line in text.splitlines(keepends=True) if not any(k in line for k in _OFFLOAD_LINES))
    (cwd / "run.yaml").write_text(base)
    pp1 = base
    for old, new in _PP1_EDITS:
        assert old in pp1, old
        pp1 = pp1.replace(old, new)
    (cwd / "run.pp1.yaml").write_text(pp1)


def _shorten_tests_json(text: str) -> str:
    """A ``test --json`` answer lists every test id; keep the counts and the first few ids."""
    try:
        data = json.loads(text)
    except ValueError:
        return text
    tests = data.get("tests")
    if isinstance(tests, list) and len(tests) > 6:
        data["tests"] = [*tests[:6], f"… {len(tests) - 6} more entries left out here"]
    return json.dumps(data, indent=2)


def run(command: str, cwd: Path) -> str:
    argv = shlex.split(command)
    # This tree's source roots (as pytest's pythonpath), never an installed copy of another checkout.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / d) for d in ("offload", "tools", "."))}
    result = subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools", *argv[1:]],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = result.stdout
    if argv[1] == "test":
        out = _shorten_tests_json(out)
    if result.stderr.strip() and not out.strip():
        out = result.stderr
    out = out.replace(str(cwd), ".").replace(str(ROOT), "<repo>").rstrip("\n")
    lines = out.splitlines()
    if len(lines) > MAX_LINES:
        lines = [*lines[:MAX_LINES], f"… {len(lines) - MAX_LINES} more lines left out here"]
    return "\n".join(["```console", f"$ {command}", *lines, f"(exit code {result.returncode})", "```"])


_VARYING = (
    (re.compile(r'"duration_s": [0-9.e-]+'), '"duration_s": <t>'),
    (re.compile(r"\bin [0-9.]+ ?s\b"), "in <t> s"),
    (re.compile(r"of the \d+ tests"), "of the <n> tests"),
    (re.compile(r"the \d+ other test files \([^)]*\)"), "the <n> other test files (<per folder>)"),
    (re.compile(r"\b[0-9a-f]{40}\b"), "<commit>"),  # the checkout's commit (test's under_test)
    (re.compile(r"at commit [0-9a-f]{12}\b"), "at commit <commit>"),
)


def normalise(block: str) -> str:
    """``block`` without what changes from run to run: durations, the size of the whole test suite, the commit."""
    text = block.removeprefix(NOTE)
    for pattern, repl in _VARYING:
        text = pattern.sub(repl, text)
    return text.rstrip("\n")


def capture(captures: dict[str, list[str]]) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        prepare(cwd)
        return {name: "\n".join(run(c, cwd) for c in commands) for name, commands in captures.items()}


def main() -> None:
    for doc, captures in ((DOC, CAPTURES), (GUIDE, GUIDE_CAPTURES)):
        text = doc.read_text()
        for name, body in capture(captures).items():
            text = fill(text, name, body, NOTE)
        doc.write_text(text)
        print(f"captured {len(captures)} blocks into {doc.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
