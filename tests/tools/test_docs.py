"""The skill and its docs tell the truth about the code: SKILL.md, card.yaml, the plugin manifest, docs/, evals/.

Every table that restates code is generated (``mbridge_offload_tools.docgen.registry``); these tests check that the
committed text is
fresh, that the values in it equal the code's, and that every command and tool the skill names really exists.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from mbridge_offload.config.schema import SECTIONS, field_default
from mbridge_offload_tools.docgen import registry as skilldocs
from mbridge_offload_tools.docgen.skill.catalogue import CLI_EQUIVALENTS
from mbridge_offload_tools.docgen.skill.params import SKILL_KEYS, all_keys
from tests.support import tree

ROOT = Path(__file__).resolve().parents[2]
SKILL = ROOT / "SKILL.md"
SPEC_KEYS = {"name", "description", "license", "compatibility", "metadata", "allowed-tools"}
CARD_KEYS = {
    "title",
    "validated_on",
    "summary",
    "validation_status",
    "evidence",
    "training_dimensions",
    "enable_when",
    "avoid_when",
    "interactions",
    "feature_meaning",
    "config_keys",
    "recommended_path",
    "expected_metric_change",
    "measured_results",
    "failure_modes",
    "known_constraints",
    "known_limitations",
    "follow_up_validation",
}
VALIDATION_TAGS = {"code_verified", "measured", "file_exists", "documented", "doc_only", "unclear"}


def _frontmatter_and_body(text: str) -> tuple[dict, str]:
    match = re.match(r"---\n(.*?)\n---\n(.*)", text, re.S)
    assert match, "SKILL.md must start with a YAML frontmatter block"
    return YAML(typ="safe").load(match[1]), match[2]


def _rows(text: str) -> list[list[str]]:
    """The cells of every Markdown table row (header and separator rows included)."""
    return [
        [c.strip() for c in line.strip().strip("|").split(" | ")] for line in text.splitlines() if line.startswith("|")
    ]


def _section(path: Path, name: str) -> str:
    return skilldocs.sections(path.read_text())[name]


# ---------------------------------------------------------------------------------------------- frontmatter


def test_frontmatter_follows_the_agent_skills_spec():
    meta, body = _frontmatter_and_body(SKILL.read_text())
    assert set(meta) <= SPEC_KEYS, f"non-spec top-level keys: {set(meta) - SPEC_KEYS}"
    name = meta["name"]
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name) and len(name) <= 64
    # The skill directory is the repository root, cloned as mbridge-offload (the distribution name).
    project = re.search(r'^name = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    assert name == project
    assert 1 <= len(meta["description"]) <= 1024
    assert "<" not in meta["description"] and ">" not in meta["description"]  # quick_validate rejects both
    assert "Use when" in meta["description"]
    assert 1 <= len(meta["compatibility"]) <= 500
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta["metadata"].items())
    assert len(body.splitlines()) < 500


def test_skill_body_is_lean_and_names_the_upstream_skill():
    meta, body = _frontmatter_and_body(SKILL.read_text())
    # The spec's budget is < 5k tokens for the body; 20,000 characters is about that. Long tables go to references/.
    assert len(body) <= 20_000, f"SKILL.md body is {len(body)} characters; move detail to references/"
    # People who know the upstream skill find this one by its name.
    assert "nemo-mbridge-perf-cpu-offloading" in meta["description"]
    for heading in ("## Quick decision", "## Constraints", "## Enablement", "## Verification", "## Failure diagnosis"):
        assert heading in body, heading
    assert "Moderate memory pressure" in body and "25–50 %" in body
    assert "train.train_iters=20" in body and "run_recipe.py --recipe qwen3_30b_a3b_pretrain_config" in body
    assert "PEFT" in body and "activation_offloading = True" in body
    assert "references/code-anchors.md" in body


LINKED_DOCS = ["SKILL.md", "README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("references/*.md"))]
LINKED_DOCS += sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md"))


@pytest.mark.parametrize("doc", LINKED_DOCS)
def test_links_point_at_files_that_exist(doc):
    path = ROOT / doc
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if not target.startswith(("http://", "https://", "mailto:")):
            assert (path.parent / target).exists(), f"{doc} links {target}, which does not exist"


# ---------------------------------------------------------------------------------------------- generated sections


def test_generated_sections_are_fresh():
    from mbridge_offload_tools.docgen.skill.card import render_card

    assert skilldocs.stale() == [], "run `make docs` (python -m mbridge_offload_tools.docgen)"
    card = (ROOT / "card.yaml").read_text()
    assert render_card(card) == card, "card.yaml measured_results is stale: run `make docs`"


def test_freshness_check_catches_a_changed_test_count(monkeypatch):
    from mbridge_offload_tools.docgen.docs import benchmarks

    # One test more (or one offload test fewer) than the docs say: both places that quote the counts are stale.
    monkeypatch.setattr(benchmarks, "COLLECTED", {**benchmarks.collected(), "tests/x.py::test_new": ["cpu_offload"]})
    assert set(skilldocs.stale(only={"test-counts"})) == {
        "README.md#test-counts",
        "docs/benchmarks-testtool.md#test-counts",
    }


def test_a_picture_not_drawn_from_the_current_numbers_is_stale(tmp_path):
    from mbridge_offload_tools.docgen.docs import plots

    values = plots.plot_values()
    assert plots.stale_images(ROOT, values) == [], "run `make docs`: a picture under docs/img is stale"
    assert plots.stale_images(tmp_path, values) == [f"docs/img/{n}.png" for n in plots.IMAGES]  # none drawn yet
    # The planner moves one bar; the picture drawn from the old numbers is stale, one drawn from the new ones is not.
    moved = json.loads(json.dumps(values))
    moved["memory_vs_offload"]["qwen3_30b_a3b"]["parts_gib"]["optimizer"][0] += 1.0
    png = tmp_path / "docs" / "img" / "memory_vs_offload.png"
    plots.draw("memory_vs_offload", values["memory_vs_offload"], png)
    assert "docs/img/memory_vs_offload.png" not in plots.stale_images(tmp_path, values)
    assert "docs/img/memory_vs_offload.png" in plots.stale_images(tmp_path, moved)
    # Drawn twice from the same numbers: the same bytes (no timestamp, no matplotlib version stamp).
    again = tmp_path / "again.png"
    plots.draw("memory_vs_offload", values["memory_vs_offload"], again)
    assert again.read_bytes() == png.read_bytes() and b"matplotlib" not in png.read_bytes()


def _reference_fresh(path: str) -> bool:
    return (ROOT / path).read_text() == skilldocs.WHOLE[path]()


def test_freshness_check_catches_a_changed_default(monkeypatch):
    assert skilldocs.stale(only={"parameters"}) == []
    assert _reference_fresh("references/parameters.md")
    # A default changes in the code but nobody regenerates: the check must say which files are stale.
    info = SECTIONS["optimizer"].model_fields["optimizer_offload_fraction"]
    monkeypatch.setattr(info, "default", 0.25)
    assert field_default("optimizer.optimizer_offload_fraction") == 0.25
    assert "docs/parameters.md#parameters" in skilldocs.stale(only={"parameters"})
    assert not _reference_fresh("references/parameters.md")
    with pytest.raises(AssertionError):
        test_parameter_defaults_match_the_config_model()


def test_fill_replaces_only_the_named_section():
    text = "a\n<!-- BEGIN GENERATED: x -->\nold\n<!-- END GENERATED: x -->\nb\n"
    out = skilldocs.fill(text, "x", "new")
    assert out.startswith("a\n") and out.endswith("b\n") and "new" in out and "old" not in out
    assert skilldocs.sections(out) == {"x": "new\n"}
    with pytest.raises(KeyError):
        skilldocs.fill(text, "y", "new")


REF_PARAMETERS = ROOT / "references/parameters.md"


def _documented_defaults(path: Path) -> dict[str, str]:
    text = path.read_text()
    rows = _rows(_section(path, "parameters") if path.suffix == ".md" and "BEGIN GENERATED" in text else text)
    return {r[0].strip("`"): r[1].strip("`") for r in rows if r[0].startswith("`")}


def test_parameter_defaults_match_the_config_model():
    for path in (REF_PARAMETERS, ROOT / "docs/parameters.md"):
        for key, text in _documented_defaults(path).items():
            assert json.loads(text) == field_default(key), f"{path.name}: {key} documents {text}"


def test_parameter_tables_cover_the_config_model():
    assert set(_documented_defaults(REF_PARAMETERS)) == set(SKILL_KEYS)
    assert set(_documented_defaults(ROOT / "docs/parameters.md")) == set(all_keys())


def test_every_field_has_a_meaning():
    from mbridge_offload_tools.docgen.skill.params import MEANINGS

    missing = [k for k in all_keys() if not MEANINGS.get(k)]
    assert missing == [], "add the meaning to mbridge_offload_tools.docgen.skill.params"
    assert [k for k in MEANINGS if k not in all_keys()] == [], "a documented field left the config model"


def test_skill_states_the_bridge_and_megatron_lm_fraction_defaults():
    text = SKILL.read_text()
    assert field_default("optimizer.optimizer_offload_fraction") == 0.0
    assert "defaults to **0.0**" in text and "defaults to **1.0**" in text


def test_constraints_match_the_rule_catalogue():
    from mbridge_offload.config.rules.catalogue import all_rules

    rules = list(all_rules())
    rows = [r for r in _rows((ROOT / "references/constraints.md").read_text()) if r[0].startswith("[")]
    documented = [(re.search(r"`(.+?)`", r[0])[1], r[1], r[2]) for r in rows]
    assert documented == [(rule.id, rule.severity, rule.origin) for rule in rules]
    # SKILL.md's short form: exactly the offloading rules upstream enforces (severity error), in catalogue order;
    # the general refusals that do not concern offloading (megatron-core's MC-*, Bridge's and Megatron-LM's CFG-*) are
    # counted there, listed in references/constraints.md.
    short = [(r[0].strip("`"), r[1]) for r in _rows(_section(SKILL, "constraints")) if r[0].startswith("`")]
    offload_errors = [r for r in rules if r.severity == "error" and not r.id.startswith(("MC-", "CFG-"))]
    assert short == [(rule.id, rule.origin) for rule in offload_errors]
    general = sum(r.id.startswith(("MC-", "CFG-")) for r in rules)
    assert f"All {len(rules)} rules" in _section(SKILL, "constraints")
    assert f"Plus {general} general refusals" in _section(SKILL, "constraints")


def test_failure_modes_match_the_diagnosis_catalogue():
    from mbridge_offload.actions.diagnose.diagnose import match_text
    from mbridge_offload.actions.diagnose.failures.catalogue import KNOWN

    for text in (_section(SKILL, "diagnosis"), (ROOT / "references/failures.md").read_text()):
        rows = [r for r in _rows(text) if r[0].startswith("`")]
        assert [r[0].strip("`") for r in rows] == [mode.id for mode in KNOWN]
    # The example in SKILL.md really diagnoses.
    found = match_text("Currently there is no support for Pipeline parallelism with CPU offloading")
    assert found and found[0].failure == "pp_constraint"


def test_bridge_selector_in_skill_is_covered_by_the_test_tool():
    from mbridge_offload.actions.testing import select as testselect

    text = SKILL.read_text()
    command = re.search(r"python -m pytest (\S+) -k \"([^\"]+)\" -q", text)
    assert command, "SKILL.md shows the Megatron Bridge pytest command"
    assert command[1] in testselect.BRIDGE_TEST_FILES
    tool_terms = set(testselect.BRIDGE_SELECTOR.split(" or "))
    assert set(command[2].split(" or ")) <= tool_terms
    assert "selects no test" in text


# ---------------------------------------------------------------------------------------------- tools and commands


def test_every_mcp_tool_is_in_the_skill_and_vice_versa():
    from mbridge_offload_tools.docgen.skill.catalogue import server_tools

    served = {tool.name for tool in server_tools()}
    table = {r[0].strip("`") for r in _rows(_section(SKILL, "tools")) if r[0].startswith("`")}
    text = SKILL.read_text() + (ROOT / "README.md").read_text()
    mentioned = set(re.findall(r"mcp__mbridge-offload__(\w+)", text))
    from mbridge_offload.actions.diagnose.failures.catalogue import KNOWN

    # Config fields and failure ids share the look of a tool name; they are not tools.
    fields = {f for section in SECTIONS.values() for f in section.model_fields} | {m.id for m in KNOWN}
    mentioned |= set(re.findall(r"`(\w+_(?:config|mode|offload|tests|failure))`", text)) - fields
    assert table == served == set(CLI_EQUIVALENTS)
    assert mentioned <= served, f"named in SKILL.md/README but not served: {mentioned - served}"


def _cli(argv: list[str], cwd: Path = ROOT) -> tuple[int, str]:
    """Run the CLI in this process from ``cwd`` (the repository root), as a reader of the docs would."""
    from mbridge_offload_tools.cli.main import main

    out = io.StringIO()
    before = Path.cwd()
    os.chdir(cwd)
    try:
        with redirect_stdout(out), redirect_stderr(io.StringIO()):
            main(argv)
    except SystemExit as exc:
        return int(exc.code or 0), out.getvalue()
    finally:
        os.chdir(before)
    return 0, out.getvalue()


def _commands(path: Path) -> list[list[str]]:
    """``mbridge-offload …`` command lines in the fenced code blocks of ``path``, as argv lists."""
    found, fenced = [], False
    for line in path.read_text().splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            continue
        line = line.strip().removeprefix("$ ")
        if line.startswith(("mbridge-offload ", ".venv/bin/mbridge-offload ", "$(BIN)/mbridge-offload ")):
            found.append(shlex.split(line, comments=True)[1:])
    return found


# Real runs are cheap (milliseconds, no torch) for these; the others are checked with --help.
_REAL = {"validate", "estimate", "recommend", "diagnose", "apply"}
DOCS_WITH_COMMANDS = ("SKILL.md", "README.md", "docs/walkthrough.md")
# The stand-in for a config the docs ask the reader to bring (``my_run.yaml``, ``run.yaml``): the shipped example.
STAND_IN = ROOT / "examples" / "qwen3_30b_a3b_pretrain.yaml"


def _shown_exit_codes(path: Path) -> dict[tuple[str, ...], int]:
    """argv → the exit code a captured block of ``path`` shows for it (``$ mbridge-offload …`` … ``(exit code N)``)."""
    shown, last = {}, None
    for line in path.read_text().splitlines():
        if line.startswith("$ mbridge-offload "):
            last = tuple(shlex.split(line, comments=True)[2:])
        elif (code := re.fullmatch(r"\(exit code (\d+)\)", line.strip())) and last is not None:
            shown[last], last = int(code.group(1)), None
    return shown


def _stage_files(argv: list[str], workdir: Path, root: Path = ROOT) -> bool:
    """Put the files ``argv`` reads into ``workdir``: the skill's own (a path inside one of its folders) copied from
    ``root``, a root-level config the reader brings as the shipped example. Never a file a user keeps in the
    repository root (the README's own ``my_run.yaml``), which would make the docs' check depend on it. False when a
    file is neither (the command is then only checked with --help)."""
    outputs = {argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--output"}
    for arg in argv[1:]:
        if arg.startswith("-") or not arg.endswith((".yaml", ".yml", ".json", ".log")) or arg in outputs:
            continue
        target = workdir / arg
        if target.exists():  # an earlier command of the same page wrote it (apply --output, then validate)
            continue
        if "/" in arg and (root / arg).is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes((root / arg).read_bytes())
        elif "/" not in arg and arg.endswith((".yaml", ".yml")):
            target.write_bytes((root / STAND_IN.relative_to(ROOT)).read_bytes())
        else:
            return False
    return True


def check_commands_shown(doc: str, workdir: Path, root: Path = ROOT) -> None:
    """Run each ``mbridge-offload`` command of ``root``'s page ``doc`` in ``workdir``, in the page's order: the
    subcommand's --help, and a real run of the cheap ones (the exit code a captured block shows, else 0 or 1)."""
    from mbridge_offload_tools.docgen.docs.walkthrough import prepare

    commands = _commands(root / doc)
    assert commands, f"no mbridge-offload command found in {doc}"
    if doc == "docs/walkthrough.md":
        prepare(workdir)  # the walkthrough's own files (run.yaml, run.pp1.yaml, qwen3.yaml), as its capture makes them
    unchecked, shown = [], _shown_exit_codes(root / doc)
    for argv in commands:
        code, _ = _cli([argv[0], "--help"])
        assert code == 0, f"{doc}: `mbridge-offload {argv[0]} --help` exits {code}"
        if argv[0] not in _REAL or "--in-place" in argv:
            continue
        if not _stage_files(argv, workdir, root):
            unchecked.append(shlex.join(argv))
            continue
        code, out = _cli(argv, cwd=workdir)
        expected = {shown[tuple(argv)]} if tuple(argv) in shown else {0, 1}  # a captured block shows its exit code
        assert code in expected, f"{doc}: `mbridge-offload {shlex.join(argv)}` exits {code}"
        if "--json" in argv:
            json.loads(out)
    assert not unchecked, f"{doc}: commands whose files neither the skill nor a stand-in provides: {unchecked}"


@pytest.mark.parametrize("doc", DOCS_WITH_COMMANDS)
def test_every_command_shown_runs(doc, tmp_path):
    # In a scratch folder: whatever a user keeps in the repository root changes nothing here (the next test).
    check_commands_shown(doc, tmp_path)


def test_walkthrough_blocks_are_captured_output():
    text = (ROOT / "docs/walkthrough.md").read_text()
    blocks = re.findall(r"<!-- BEGIN GENERATED: ([\w-]+) -->\n(.*?)<!-- END GENERATED: \1 -->", text, re.S)
    from mbridge_offload_tools.docgen.docs.walkthrough import CAPTURES

    assert sorted(name for name, _ in blocks) == sorted(CAPTURES)
    for name, body in blocks:
        assert "captured by `python -m mbridge_offload_tools.docgen.docs.walkthrough`" in body, name
        assert f"$ {CAPTURES[name][0]}" in body and "(exit code " in body, name
    from mbridge_offload_tools.docgen.docs.walkthrough import GUIDE_CAPTURES

    guide = skilldocs.sections((ROOT / "docs/cpu-offloading.md").read_text())
    for name, commands in GUIDE_CAPTURES.items():
        assert f"$ {commands[0]}" in guide[name] and "(exit code " in guide[name], name


def test_the_walkthroughs_prose_quotes_what_recommend_answers():
    """The figures the walkthrough's own sentences quote (the H100's budget, its margin, the 48 GB fraction) are
    the tool's, so a changed default cannot leave the prose behind the generated blocks beside it."""
    from mbridge_offload.plan.inputs.hardware import DEFAULT_MARGIN

    text = " ".join((ROOT / "docs/walkthrough.md").read_text().split())
    qwen = ["recommend", "--model", "qwen3-30b-a3b", "--gpu", "h100-80gb", "--num-gpus", "16", "--tp", "2", "--pp",
            "2", "--ep", "4", "--json"]  # fmt: skip
    _, out = _cli(qwen)
    assert f"That fits the {json.loads(out)['budget_gib']:.1f} GiB an H100 can allocate" in text
    assert f"a {DEFAULT_MARGIN:.0%} margin".replace("%", " %") in text
    _, out = _cli([*qwen, "--gpu-memory-gb", "48"])
    fraction = next(o for o in json.loads(out)["overrides"] if o.startswith("optimizer.optimizer_offload_fraction="))
    assert f"(`--gpu-memory-gb 48` gives optimizer offload at {fraction.split('=')[1]})" in text


def test_cli_equivalents_name_real_subcommands():
    for command in CLI_EQUIVALENTS.values():
        sub = command.split()[1]
        assert _cli([sub, "--help"])[0] == 0, command


def test_make_targets_named_in_readme_exist():
    makefile = (ROOT / "Makefile").read_text()
    for target in re.findall(r"^make (\w+)", (ROOT / "README.md").read_text(), re.M):
        assert re.search(rf"^{target}:", makefile, re.M), target


@pytest.fixture(scope="module")
def light_copy(tmp_path_factory) -> Path:
    from tests.support.skill_copy import light_skill_copy

    return light_skill_copy(tmp_path_factory.mktemp("skill"))


def test_skill_folder_runs_from_a_copy_without_installing(light_copy):
    # The folder as an installer copies it (no .venv), set up by its own scripts/setup --light on a Python that has
    # neither this package nor its dependencies: the CLI launcher and the venv's console script both work.
    from tests.support.skill_copy import clean_env

    example = "examples/qwen3_30b_a3b_pretrain.yaml"
    for argv in (["scripts/mbridge-offload"], [".venv/bin/mbridge-offload"]):
        result = subprocess.run(
            [*argv, "validate", example, "--json"],
            cwd=light_copy,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["ok"] is True
    # The installed package is the copy's, not this checkout's.
    where = subprocess.run(
        [".venv/bin/python", "-c", "import mbridge_offload; print(mbridge_offload.__file__)"],
        cwd=light_copy,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.stdout.strip().startswith(str(light_copy)), where.stdout
    # Idempotent: a second run does nothing and says so.
    again = subprocess.run(
        ["scripts/setup", "--light"], cwd=light_copy, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0 and "nothing to do" in again.stdout


def test_setup_check_reports_what_is_missing(light_copy):
    from tests.support.skill_copy import clean_env

    full = subprocess.run(
        ["scripts/setup", "--check"], cwd=light_copy, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert full.returncode == 3 and "scripts/setup" in full.stdout and "found: light" in full.stdout
    bad = subprocess.run(["scripts/setup", "--nope"], cwd=light_copy, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown option" in bad.stderr


# ---------------------------------------------------------------------------------------------- card.yaml


def _card() -> dict:
    return YAML(typ="safe").load((ROOT / "card.yaml").read_text())


def test_card_has_the_perf_card_keys():
    card = _card()
    assert set(card) == CARD_KEYS | {"upstream_published_results"}
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(card["validated_on"]))
    for claim, tags in card["validation_status"].items():
        assert tags and set(tags) <= VALIDATION_TAGS, claim
    for path in card["evidence"]:
        assert (ROOT / path).exists(), path


def test_card_config_keys_exist_in_the_config_model():
    card = _card()
    for key in card["config_keys"]:
        field_default(key)  # KeyError for a key the model lacks
    for key in list(card["feature_meaning"]) + list(card["recommended_path"]):
        field_default(key)


def test_card_measured_results_are_ours_and_quoted_from_their_source():
    card = _card()
    assert card["measured_results"], "at least the CPU benchmarks"
    for result in card["measured_results"]:
        assert result["measured_on"], result
        source = ROOT / result["source"]
        assert source.exists() and source.name.startswith("benchmarks-"), result
        text = source.read_text()
        # Every number is copied verbatim from the fragment the benchmark wrote: nothing invented or rounded.
        for value in result["values"].values():
            assert str(value) in text, f"{value!r} not found in {result['source']}"
    upstream = card["upstream_published_results"]
    assert upstream["source"] and upstream["results"]
    assert all("job" in r for r in upstream["results"])


def test_card_states_upstreams_memory_in_its_published_unit_and_calls_the_fit_a_fit():
    card = _card()
    # Upstream publishes Megatron's report (bytes / 1024**2 printed as MB) under "GB" keys: the card says they are GiB.
    assert "GiB" in card["upstream_published_results"]["memory_unit"]
    memory = card["training_dimensions"]["memory"]["rationale"]
    assert "GiB saved" in memory and " GB saved" not in memory
    speed = card["training_dimensions"]["speed"]["rationale"]
    assert "in-sample fit, not a validation" in speed and "held-out" in speed


def test_the_accuracy_tables_fitted_points_are_called_in_sample():
    from mbridge_offload_tools.evidence.published import render_accuracy_table

    table = render_accuracy_table()
    assert "in-sample fit, not a check" in table and "validat" not in table.lower()


def test_card_failure_modes_exist_in_the_diagnosis_catalogue():
    from mbridge_offload.actions.diagnose.failures.catalogue import KNOWN

    known = {mode.id for mode in KNOWN}
    for mode in _card()["failure_modes"]:
        assert mode["name"] in known, mode["name"]


# ---------------------------------------------------------------------------------------------- plugin, docs, evals


def test_plugin_manifest_points_at_the_skill_and_the_server():
    plugin = json.loads((ROOT / ".claude-plugin/plugin.json").read_text())
    assert re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", plugin["name"])
    for path in plugin["skills"]:
        assert path.startswith("./") and (ROOT / path / "SKILL.md").exists()
    # The plugin's server: the launcher in scripts/, found through ${CLAUDE_PLUGIN_ROOT} (Claude Code does not expand
    # ${VAR:-default} there: that form left the plugin's server at "./scripts/mcp-server" in the cwd).
    (server,) = plugin["mcpServers"].values()
    assert server["command"] == "${CLAUDE_PLUGIN_ROOT}/scripts/mcp-server"
    assert os.access(ROOT / "scripts/mcp-server", os.X_OK)
    # The project-scope .mcp.json (opened as a repository) starts the same launcher.
    (project,) = json.loads((ROOT / ".mcp.json").read_text())["mcpServers"].values()
    assert project["command"] == "./scripts/mcp-server"
    market = json.loads((ROOT / ".claude-plugin/marketplace.json").read_text())
    assert [p["name"] for p in market["plugins"]] == [plugin["name"]]
    # Claude Code refuses a plugin whose manifest and marketplace entry both declare components
    # ("conflicting manifests"): the entry declares none and stays strict (the default).
    components = {"skills", "commands", "agents", "hooks", "mcpServers", "lspServers", "outputStyles"}
    for entry in market["plugins"]:
        assert not components & set(entry), f"marketplace entry declares {components & set(entry)}"
        assert entry.get("strict", True) is True


def test_architecture_names_only_modules_that_exist():
    text = (ROOT / "docs/architecture.md").read_text()
    pathed = set(re.findall(r"\b((?:offload|tools|benchmarks|tests)/[\w/]+\.py)\b", text))
    dotted = {f"offload/{m}.py" for m in re.findall(r"`offload\.(\w+)`", text)}
    bare = set(re.findall(r"(?<![/\w])(\w+\.py)\b", text))
    assert len(pathed | dotted | bare) > 20
    missing = sorted(p for p in pathed | dotted if not (ROOT / p).exists())
    homes = ("offload", "tools", "benchmarks", "tests")
    missing += sorted(b for b in bare if not any(any((ROOT / home).rglob(b)) for home in homes))
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_architecture_says_truly_which_benchmark_writes_its_numbers_and_which_are_pasted():
    text = (ROOT / "docs/architecture.md").read_text()
    table = text.split("## Where the numbers come from", 1)[1]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "`benchmarks/" in line]
    assert len(rows) >= 5
    for _, produced, written in rows:
        sources = "".join((ROOT / p).read_text() for p in re.findall(r"`(benchmarks/\w+\.py)`", produced))
        targets = [Path(t).name for t in re.findall(r"`docs/([\w./-]+)`", written)]
        mentioned = [t for t in targets if t in sources]
        if "pasted by hand" in produced:
            assert not mentioned, f"{produced.strip()} writes {mentioned} itself: the table says it is pasted"
        else:
            assert mentioned == targets, f"{produced.strip()} does not write {sorted(set(targets) - set(mentioned))}"


def test_evals_have_the_nvidia_shape():
    evals = json.loads((ROOT / "evals/evals.json").read_text())
    keys = {"id", "question", "expected_skill", "expected_script", "ground_truth", "expected_behavior"}
    assert all(set(e) == keys for e in evals)
    assert len({e["id"] for e in evals}) == len(evals)
    assert any(e["expected_skill"] is None for e in evals), "negative cases"
    assert any("Qwen3-30B-A3B" in e["question"] and "PP" in e["question"] for e in evals)
    subcommands = {c.split()[1] for c in CLI_EQUIVALENTS.values()} | {"estimate", "serve"}
    for e in evals:
        assert e["expected_skill"] in (None, "mbridge-offload")
        assert e["expected_behavior"] and all(isinstance(b, str) for b in e["expected_behavior"])
        if e["expected_script"]:
            words = e["expected_script"].split()
            assert words[0] == "mbridge-offload" and words[1] in subcommands, e["id"]


def test_eval_scripts_run():
    # Each eval's expected script is a real command (``test`` is left out: it runs the suite itself).
    for e in json.loads((ROOT / "evals/evals.json").read_text()):
        if not e["expected_script"] or e["expected_script"].split()[1] == "test":
            continue
        argv = shlex.split(e["expected_script"])[1:]
        code, out = _cli(argv)
        assert code in (0, 1), f"{e['id']}: exit {code}"
        json.loads(out)


@pytest.mark.skipif(os.environ.get("MBRIDGE_OFFLOAD_NPX") != "1", reason="set MBRIDGE_OFFLOAD_NPX=1 to run npx skills")
def test_npx_skills_lists_the_skill():
    result = subprocess.run(
        ["npx", "-y", "skills@1.5.16", "add", "./", "--list"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert "Found 1 skill" in result.stdout and "mbridge-offload" in result.stdout


# ---------------------------------------------------------------------------------------------- what ships


def _shipped_files(root: Path = ROOT) -> list[Path]:
    """The files an installer takes (tests.support.tree.shipped: never a user's file in the root), text-like ones."""
    listed = tree.shipped(root)
    if listed is None:
        pytest.skip("not a git checkout")
    suffixes = {".md", ".py", ".yaml", ".yml", ".json", ".toml", ".txt", ""}
    return [
        root / rel
        for rel in listed
        if (root / rel).is_file() and (root / rel).suffix in suffixes and rel != "tests/tools/test_docs.py"
    ]


# Built from pieces so that this file does not match itself.
_SECTION_SIGN = "\u00a7"
_INTERNAL = [
    (re.compile("reference " + _SECTION_SIGN + r"|" + _SECTION_SIGN + r"\d"), "a section of an internal reference"),
    (re.compile(r"\.\./shared/|shared/reference"), "a path outside the repository"),
    (re.compile(r"megatron-(?:on-cpu|offload)\.md|peer-systems\.md|mcp-and-skills\.md"), "an internal reference file"),
    (re.compile(r"\b[Ii]ssues? #?\d+\b"), "an internal tracker reference"),
]
# "#123" may cite an upstream tracker only when it names it (MCore #4113, Megatron-LM PR #5929, Bridge#3949).
_UPSTREAM = re.compile(
    r"(PR|MCore|Bridge|Megatron-LM|Megatron-Bridge|Megatron Core|TE|TransformerEngine|NVIDIA/[\w-]+)\s?$"
)


def _citation_problems(root: Path = ROOT) -> list[str]:
    bad = []
    for path in _shipped_files(root):
        rel = path.relative_to(root)
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            bad += [f"{rel}:{n}: {why}: {line.strip()[:120]}" for pattern, why in _INTERNAL if pattern.search(line)]
            for m in re.finditer(r"""(?<![\w/&"'-])#(\d+)\b""", line):
                if not _UPSTREAM.search(line[max(0, m.start() - 30) : m.start()]):
                    bad.append(f"{rel}:{n}: a bare tracker number: {line.strip()[:120]}")
    return bad


def test_docs_and_code_cite_only_what_ships():
    bad = _citation_problems()
    assert not bad, "\n".join(bad)


def test_a_users_files_in_the_root_are_not_the_skills(tmp_path):
    # A copy of the tree as its own git checkout, with what a user leaves in the root after the README's commands
    # (their config, apply's output, a JSON): neither the shipped-files checks nor the skill copy see them, while a
    # new file inside the repository's folders is still checked before it is added.
    from tests.support.skill_copy import copy_tree

    repo = copy_tree(tmp_path / "repo")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "copy"]):
        subprocess.run([*git, *args], cwd=repo, check=True, capture_output=True, timeout=120)
    hostile = "# copied from issue #12 of our tracker, see ../shared/notes\nmodel: {num_layers: 4}\n"
    for name in ("my_run.yaml", "my_run.offload.yaml", "my_run.json"):
        (repo / name).write_text(hostile)
    assert _citation_problems(repo) == []
    listed = tree.shipped(repo) or []
    assert "SKILL.md" in listed and not [rel for rel in listed if rel.startswith("my_run")]
    assert not list(copy_tree(tmp_path / "copy", repo).glob("my_run*"))
    (repo / "docs" / "new.md").write_text(hostile)  # a developer's new doc, not yet added: still checked
    assert "docs/new.md" in tree.shipped(repo) and any(p.startswith("docs/new.md:1") for p in _citation_problems(repo))


def test_the_docs_commands_run_the_same_with_a_users_files_in_the_root(tmp_path):
    # The README tells a user to keep `my_run.yaml` in the root, `apply --output` writes `my_run.offload.yaml` there,
    # `calibrate` writes .mbridge-offload/, and a user keeps notes and logs: the docs' commands are checked all the
    # same (a user's config that `recommend` cannot size, exit 2, changes nothing), and nothing of theirs is touched.
    from tests.support.skill_copy import copy_tree

    repo = copy_tree(tmp_path / "repo")
    user = {
        "my_run.yaml": "model:\n  num_layers: 4\n",  # recommend: no model sizes -> exit 2 were it used
        "my_run.offload.yaml": "not: [valid\n",  # apply --output would refuse to overwrite it
        "run.yaml": "model: {pipeline_model_parallel_size: nope}\n",
        "qwen3.yaml": "{}\n",
        "notes.md": "# notes\n[a link to nowhere](nowhere.md), issue #12\n",
        "run.log": "torch.OutOfMemoryError: CUDA out of memory.\n",
        ".mbridge-offload/host-profiles/box.json": "{}\n",
    }
    for name, text in user.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    for doc in DOCS_WITH_COMMANDS:
        (tmp_path / doc).mkdir(parents=True)
        check_commands_shown(doc, tmp_path / doc, root=repo)
    assert {name: (repo / name).read_text() for name in user} == user


_CITED_PATH = re.compile(r"`((?:offload|tools|docs|scripts|references|tests|examples|benchmarks|evals)/[\w./-]+)`")


# Paths that look like ours but name something else: Megatron Bridge's own files, and MCP protocol methods.
_NOT_OURS = ("tests/unit_tests/", "scripts/training/", "scripts/performance/", "tools/list", "tools/call")


def test_repository_paths_cited_in_docs_exist():
    docs = [p for p in _shipped_files() if p.suffix in (".md", ".yaml") and p.name != "hosts-check.txt"]
    missing = []
    for path in docs:
        for cited in _CITED_PATH.findall(path.read_text()):
            target = cited.split("::")[0].rstrip(".")
            target = re.sub(r":\d+(-\d+)?$", "", target)
            if not target.startswith(_NOT_OURS) and not (ROOT / target).exists():
                missing.append(f"{path.relative_to(ROOT)} cites {cited}")
    assert len(docs) > 15
    assert not missing, "\n".join(missing)


def test_citation_check_catches_a_bad_citation(tmp_path):
    line = "see the notes (" + "reference " + _SECTION_SIGN + "5.4) and issue 12"
    assert [why for pattern, why in _INTERNAL if pattern.search(line)] == [
        "a section of an internal reference",
        "an internal tracker reference",
    ]
    assert not _UPSTREAM.search("fixed in ")
    assert _UPSTREAM.search("fixed by Megatron-LM PR ")


def test_readme_links_install_and_mcp_setup():
    text = (ROOT / "README.md").read_text()
    assert "(docs/install.md)" in text and "(docs/mcp.md)" in text
    assert "scripts/setup" in text
    assert re.search(r"^make run\b", text, re.M) and re.search(r"^make test\b", text, re.M)


# ---------------------------------------------------------------------------------------------- code anchors


def _installed(package: str, version: str) -> Path | None:
    """Where the released package of that version is installed here (its import root), if it is."""
    import importlib.metadata

    if package == "megatron-core":
        if version == "0.16.1":
            try:
                dist = importlib.metadata.distribution("megatron-core")
            except importlib.metadata.PackageNotFoundError:
                return None
            return Path(dist.locate_file("")) if dist.version == version else None
        folder = ROOT / ".mcore" / version
        return folder if (folder / "megatron/core").is_dir() else None
    folder = ROOT / ".bridge" / version
    return folder if (folder / "megatron/bridge").is_dir() else None


def test_code_anchors_point_at_the_quoted_upstream_lines():
    from mbridge_offload_tools.docgen.skill.anchors import ANCHORS

    checked, wrong = 0, []
    for anchor in ANCHORS:
        root = _installed(anchor.package, anchor.version)
        if root is None:
            continue
        lines = (root / anchor.path).read_text().splitlines()
        if anchor.needle not in lines[anchor.line - 1]:
            wrong.append(f"{anchor.package} {anchor.version} {anchor.path}:{anchor.line} lacks {anchor.needle!r}")
        checked += 1
    assert not wrong, "\n".join(wrong)
    # megatron-core 0.16.1 is a test dependency: its anchors are always checked.
    assert checked >= sum(a.version == "0.16.1" for a in ANCHORS)


# ---------------------------------------------------------------------------------------------- Claude.ai zip


def test_skill_zip_has_skill_md_at_its_root_and_nothing_built(tmp_path):
    import zipfile

    out = tmp_path / "skill.zip"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts/skill-zip"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    names = zipfile.ZipFile(out).namelist()
    assert "SKILL.md" in names and "references/constraints.md" in names and "scripts/setup" in names
    assert any(n.startswith("offload/") for n in names) and "pyproject.toml" in names
    banned = (".venv/", ".git/", "__pycache__", ".pytest_cache", ".ruff_cache", ".mcore/", ".bridge/", ".egg-info")
    assert not [n for n in names if any(b in n for b in banned) or n.endswith(".pyc")]
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "evals/"))]
    # Every link of SKILL.md resolves inside the zip.
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "SKILL.md").read_text()):
        if not target.startswith("http"):
            assert target.rstrip("/") in names or any(n.startswith(target.rstrip("/") + "/") for n in names), target
    assert zipfile.ZipFile(out).getinfo("scripts/setup").external_attr >> 16 & 0o111, "scripts stay executable"


# ---------------------------------------------------------------------------------------------- agent hosts


HOSTS_CHECK = ROOT / "docs/hosts-check.txt"


def test_committed_host_check_passed_for_the_plugin_and_every_client_it_ran():
    text = HOSTS_CHECK.read_text()
    # One report per run (the two hosts added last ran alone, --only opencode,windsurf): every run has 0 FAIL.
    summaries = re.findall(r"summary: (\d+) PASS, (\d+) FAIL, (\d+) SKIP", text)
    assert summaries and all(int(fail) == 0 for _p, fail, _s in summaries), summaries
    for needed in (
        "PASS  claude-code: plugin list --json: loaded without errors",
        "PASS  claude-code: mcp list (first start, sets up .venv): the plugin's server starts and connects",
        "PASS  claude-code: mcp list (next start, default timeout)",
        "PASS  npx skills@1.5.16",
        "PASS  gemini-cli",
        "PASS  codex",
        "PASS  opencode: npx skills@1.6.0 add --skill mbridge-offload -a opencode -y",
        "PASS  opencode: debug skill: mbridge-offload listed",
        "PASS  opencode: opencode.json mcp entry",
        "PASS  windsurf: npx skills@1.6.0 add --skill mbridge-offload -a windsurf -a devin -y",
        "PASS  windsurf: frontmatter",
    ):
        assert needed in text, needed
    # docs/install.md states the versions the check ran, and that Windsurf was checked by its layout, not a client.
    install = (ROOT / "docs/install.md").read_text()
    claude = re.search(r"^claude-code: (\S+) \(Claude Code\)", text, re.M)[1]
    opencode = re.search(r"^opencode: (\d\S*)", text, re.M)[1]
    assert claude in install and f"opencode {opencode}" in install
    windsurf = next(line for line in install.splitlines() if line.startswith("| Windsurf"))
    assert "file layout only: no client here" in windsurf and ".devin/skills/mbridge-offload/" in windsurf


@pytest.mark.skipif(os.environ.get("MBRIDGE_OFFLOAD_HOSTS") != "1", reason="set MBRIDGE_OFFLOAD_HOSTS=1 (npm, ~2 min)")
def test_hosts_load_the_skill_and_the_plugin(tmp_path):
    out = tmp_path / "hosts.txt"
    result = subprocess.run(
        [str(ROOT / "scripts/check-hosts"), "--out", str(out)], capture_output=True, text=True, timeout=1800
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 FAIL" in out.read_text()


# ---------------------------------------------------------------------------------------------- walkthrough


@pytest.mark.skipif(
    int(os.environ.get("MBRIDGE_OFFLOAD_TEST_DEPTH", "0") or 0) > 0, reason="reruns `test`: not inside run_unit_tests"
)
def test_walkthrough_output_matches_a_fresh_run():
    # Every command of the walkthrough and of the guide's worked examples runs again; its output must equal the
    # committed block (durations and the suite's size blanked). A change of behaviour shows up here until
    # `python -m mbridge_offload_tools.docgen.docs.walkthrough` is rerun and the prose checked against the new output.
    from mbridge_offload_tools.docgen.docs.walkthrough import CAPTURES, GUIDE_CAPTURES, capture, normalise

    for doc, captures in (("docs/walkthrough.md", CAPTURES), ("docs/cpu-offloading.md", GUIDE_CAPTURES)):
        committed = skilldocs.sections((ROOT / doc).read_text())
        fresh = capture(captures)
        for name in captures:
            assert normalise(fresh[name]) == normalise(committed[name]), f"{doc}#{name} differs from a fresh run"


def test_walkthrough_normalising_blanks_only_what_varies():
    from mbridge_offload_tools.docgen.docs.walkthrough import normalise

    a = '"duration_s": 7.045, "selected": 47, selected 47 of the 513 tests, 3 passed in 1.2 s'
    b = '"duration_s": 12.1, "selected": 47, selected 47 of the 520 tests, 3 passed in 9.9 s'
    assert normalise(a) == normalise(b)
    assert normalise(a) != normalise(a.replace('"selected": 47', '"selected": 46'))
