"""Collect Megatron-LM example command lines (``examples/**/*.sh``) as test data for the argv reader.

    .venv/bin/python tests/support/collect_mlm_examples.py GIT_DIR COMMIT

reads every ``examples/**/*.sh`` of a Megatron-LM checkout (a bare git directory is enough) and writes
``tests/config/data/megatron_lm_examples.json``: per script, its source (repository, commit, path) and the argv of
Megatron-LM flags found in it. Shell is not executed: comments are dropped, continuations joined, words split
with ``shlex``; a flag whose value is a shell expansion (``$TP``, ``${NUM_LAYERS}``) is recorded under
``expanded`` instead of being guessed. Scripts with fewer than three Megatron-LM flags (data tools, launchers) are
skipped.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mbridge_offload.config.megatron_lm.flags import arguments

OUT = Path(__file__).resolve().parents[2] / "tests" / "config" / "data" / "megatron_lm_examples.json"
TAKES_VALUE = {opt: row[2] in ("store", "append") for row in arguments() for opt in row[0]}
NARGS = {opt: row[3] for row in arguments() for opt in row[0]}


def _words(text: str) -> list[str]:
    lines = [ln for ln in text.replace("\\\n", " ").splitlines() if not ln.lstrip().startswith("#")]
    words: list[str] = []
    for line in lines:
        try:
            words += shlex.split(line, comments=True)
        except ValueError:
            words += line.split()
    flat: list[str] = []
    for word in words:  # a quoted "--flag value" inside an array, and "--flag)" closing a bash array
        parts = word.split() if word.startswith("--") and " " in word else [word]
        flat += [p.rstrip(")") if p.startswith("--") else p for p in parts]
    return flat


def _is_flag(word: str) -> bool:
    return word.startswith("--") and len(word) > 2 and word[2].isalpha()


def extract(text: str) -> tuple[list[str], list[str]]:
    """``(argv, expanded flags)`` of one script."""
    words, argv, expanded = _words(text), [], []
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not _is_flag(word):
            continue
        flag = word.split("=", 1)[0]
        if "=" in word or not TAKES_VALUE.get(flag, False):  # a switch, --flag=value, or a flag we do not know
            if "$" in word or "`" in word:
                expanded.append(flag)
            else:
                argv.append(word)
            continue
        values = []
        many = NARGS.get(flag) in ("+", "*")
        while i < len(words) and not _is_flag(words[i]) and words[i] not in (")", "&&", "||", "|", ";"):
            values.append(words[i])
            i += 1
            if not many:
                break
        if not values or any("$" in v or "`" in v for v in values):
            expanded.append(flag)
        else:
            argv += [flag, *values]
    return argv, expanded


def main(git_dir: str, commit: str) -> None:
    names = subprocess.run(
        ["git", "--git-dir", git_dir, "ls-tree", "-r", "--name-only", commit],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    rows = []
    for path in sorted(n for n in names if n.startswith("examples/") and n.endswith(".sh")):
        text = subprocess.run(
            ["git", "--git-dir", git_dir, "show", f"{commit}:{path}"], capture_output=True, text=True, timeout=60
        ).stdout
        argv, expanded = extract(text)
        known = [a for a in argv if _is_flag(a) and a.split("=", 1)[0] in TAKES_VALUE]
        if len(known) >= 3:
            rows.append({"source": f"NVIDIA/Megatron-LM@{commit[:10]}:{path}", "argv": argv, "expanded": expanded})
    OUT.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(rows)} command lines to {OUT}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
