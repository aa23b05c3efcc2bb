"""Transformer Engine's activation-offload size threshold per release, as ``mbridge_offload_runtime.upstream`` says.

TE cannot be installed here; its source can be read. Set ``MBRIDGE_OFFLOAD_TE_SRC`` to a TransformerEngine git
checkout (or bare mirror) with its release tags: every row of ``TE_OFFLOAD_THRESHOLDS`` is then checked at every
release tag it claims (its exact line inside its function, and whether that function compares ``numel()`` at all).
Without it those tests skip and say so; the table's own shape and the lookups are checked either way.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import subprocess

import pytest

from mbridge_offload.config.rules.base import TE_VERSION_ASSUMED
from mbridge_offload.plan.memory.activations import te_offload_min_numel
from mbridge_offload.plan.model.run import Setup
from mbridge_offload_runtime.activation.schedule import DEFAULT_MIN_TENSOR_SIZE
from mbridge_offload_runtime.upstream import (
    TE_MIN_OFFLOAD_NUMEL,
    TE_OFFLOAD_THRESHOLDS,
    TeOffloadThreshold,
    te_min_offload_numel,
    te_offload_threshold,
)

TE_SRC = os.environ.get("MBRIDGE_OFFLOAD_TE_SRC")
needs_source = pytest.mark.skipif(TE_SRC is None, reason="set MBRIDGE_OFFLOAD_TE_SRC to a TransformerEngine checkout")


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    assert TE_SRC is not None
    return subprocess.run(["git", "-C", TE_SRC, *args], capture_output=True, text=True, check=False)


def _release_tags() -> dict[str, tuple[int, int]]:
    """Every release tag ``vX.Y`` / ``vX.Y.Z`` (no release candidates) with its minor."""
    tags = {}
    for tag in _git("tag").stdout.split():
        m = re.fullmatch(r"v(\d+)\.(\d+)(?:\.\d+)*", tag)
        if m:
            tags[tag] = (int(m.group(1)), int(m.group(2)))
    return tags


def _function_body(text: str, name: str) -> str:
    """The source of ``def name(`` up to the next line indented no deeper than the ``def``."""
    m = re.search(rf"^( *)def {re.escape(name)}\(", text, re.M)
    assert m, name
    indent, lines = len(m.group(1)), []
    for line in text[m.start() :].splitlines()[1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        lines.append(line)
    return "\n".join(lines)


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)  # v1.3 predates TE's formatter: `hasattr(tensor,"activation_offloading")`


@needs_source
@pytest.mark.parametrize("row", TE_OFFLOAD_THRESHOLDS, ids=lambda r: f"{r.path}-{r.first}-{r.last}")
def test_each_row_holds_at_every_release_it_claims(row: TeOffloadThreshold) -> None:
    tags = [t for t, v in _release_tags().items() if row.first <= v <= row.last]
    assert tags, f"no release tag between {row.first} and {row.last} in {TE_SRC}"
    for tag in tags:
        shown = _git("show", f"{tag}:transformer_engine/pytorch/{row.file}")
        assert shown.returncode == 0, (tag, row.file, shown.stderr)
        body = _function_body(shown.stdout, row.function)
        assert _squash(row.line) in _squash(body), (tag, row.function)
        assert ("numel()" in body) == row.numel_check, (tag, row.function)
        if row.min_numel == 0:  # no size floor anywhere in the file either (a view check ``==`` is not one)
            assert not re.search(r"numel\(\)\s*(<|>)", shown.stdout), (tag, row.file)


def _first_release_with(tags: dict[str, tuple[int, int]], file: str) -> tuple[int, int]:
    path = f"transformer_engine/pytorch/{file}"
    return min(v for t, v in tags.items() if _git("cat-file", "-e", f"{t}:{path}").returncode == 0)


@needs_source
def test_offload_came_with_1_3_and_the_v1_file_with_2_10() -> None:
    tags = _release_tags()
    assert _first_release_with(tags, "cpu_offload.py") == (1, 3)
    assert _first_release_with(tags, "cpu_offload_v1.py") == (2, 10)


def test_rows_cover_each_path_without_gap_or_overlap() -> None:
    for path, start in (("v1", (1, 3)), ("v2", (2, 10))):
        rows = [r for r in TE_OFFLOAD_THRESHOLDS if r.path == path]
        assert rows[0].first == start
        for before, after in itertools.pairwise(rows):
            assert (after.first[0], after.first[1] - 1) == before.last or after.first == (before.last[0] + 1, 0)
        assert rows[-1].last == (2, 18)


def test_each_rows_floor_is_the_number_on_its_line() -> None:
    for row in TE_OFFLOAD_THRESHOLDS:
        m = re.fullmatch(r"if t\.numel\(\) < ([\d *]+):", row.line)
        assert (m is not None) == row.numel_check, row
        floor = math.prod(int(f) for f in m.group(1).split("*")) if m else 0
        assert floor == row.min_numel, row  # "skip when numel < N" is "offload when numel >= N"


def test_te_2_18_v2_offloads_from_256_ki_elements() -> None:
    assert te_min_offload_numel("2.18.0") == 256 * 1024 == TE_MIN_OFFLOAD_NUMEL


def test_te_2_10_and_2_11_v2_have_no_size_floor() -> None:
    assert te_min_offload_numel("2.10") == te_min_offload_numel("2.11.0") == 0


def test_the_floor_arrived_in_2_12() -> None:
    assert te_min_offload_numel("2.12") == 256 * 1024


def test_nvte_cpu_offload_v1_takes_the_path_with_no_size_check() -> None:
    row = te_offload_threshold("2.18", v1=True)
    assert (row.path, row.file, row.min_numel) == ("v1", "cpu_offload_v1.py", 0)


def test_before_2_10_the_v1_path_is_the_only_one() -> None:
    assert te_offload_threshold("2.9").path == te_offload_threshold("1.13").path == "v1"


def test_a_release_newer_than_the_table_takes_its_newest_row() -> None:
    assert te_offload_threshold("2.30") == TE_OFFLOAD_THRESHOLDS[-1]


@pytest.mark.parametrize("bad", ["1.2", "0.13", "two", "2"])
def test_no_offload_or_no_version_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        te_offload_threshold(bad)


def test_planner_and_runtime_use_the_assumed_releases_threshold() -> None:
    assumed = te_min_offload_numel(TE_VERSION_ASSUMED)
    assert te_offload_min_numel(Setup()) == DEFAULT_MIN_TENSOR_SIZE == TE_MIN_OFFLOAD_NUMEL == assumed


@pytest.mark.parametrize(("te", "floor"), [("2.11", 0), ("v2.12.0", 256 * 1024), ("2.9.0+cu12", 0), ("3", 256 * 1024)])
def test_the_planner_reads_the_floor_of_the_runs_release(te: str, floor: int) -> None:
    assert te_offload_min_numel(Setup(te_version=te)) == floor
