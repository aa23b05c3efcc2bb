"""The skill and its docs tell the truth about the code: SKILL.md, card.yaml, the plugin manifest, docs/, evals/.

Every table that restates code is generated (``tools/docgen/registry.py``); these tests check that the committed text is
fresh, that the values in it equal the code's, and that every command and tool the skill names really exists.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from mbridge_offload.config.schema import SECTIONS, field_default
from mbridge_offload_tools.docgen import registry as skilldocs
from mbridge_offload_tools.docgen.catalogue import CLI_EQUIVALENTS
from mbridge_offload_tools.docgen.params import SKILL_KEYS, all_keys

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


def test_links_in_skill_point_at_files_that_exist():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", SKILL.read_text()):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


# ---------------------------------------------------------------------------------------------- generated sections


def test_generated_sections_are_fresh():
    from mbridge_offload_tools.docgen.card import render_card

    assert skilldocs.stale() == [], "run `make docs` (python -m mbridge_offload_tools.docgen)"
    card = (ROOT / "card.yaml").read_text()
    assert render_card(card) == card, "card.yaml measured_results is stale: run `make docs`"


def test_freshness_check_catches_a_changed_default(monkeypatch):
    assert skilldocs.stale(only={"parameters"}) == []
    # A default changes in the code but nobody regenerates: the check must say which sections are stale.
    info = SECTIONS["optimizer"].model_fields["optimizer_offload_fraction"]
    monkeypatch.setattr(info, "default", 0.25)
    assert field_default("optimizer.optimizer_offload_fraction") == 0.25
    stale = skilldocs.stale(only={"parameters"})
    assert "SKILL.md#parameters" in stale and "docs/parameters.md#parameters" in stale
    with pytest.raises(AssertionError):
        test_parameter_defaults_match_the_config_model()


def test_fill_replaces_only_the_named_section():
    text = "a\n<!-- BEGIN GENERATED: x -->\nold\n<!-- END GENERATED: x -->\nb\n"
    out = skilldocs.fill(text, "x", "new")
    assert out.startswith("a\n") and out.endswith("b\n") and "new" in out and "old" not in out
    assert skilldocs.sections(out) == {"x": "new\n"}
    with pytest.raises(KeyError):
        skilldocs.fill(text, "y", "new")


def _documented_defaults(path: Path) -> dict[str, str]:
    rows = _rows(_section(path, "parameters"))
    return {r[0].strip("`"): r[1].strip("`") for r in rows if r[0].startswith("`")}


def test_parameter_defaults_match_the_config_model():
    for path in (SKILL, ROOT / "docs/parameters.md"):
        for key, text in _documented_defaults(path).items():
            assert json.loads(text) == field_default(key), f"{path.name}: {key} documents {text}"


def test_parameter_tables_cover_the_config_model():
    assert set(_documented_defaults(SKILL)) == set(SKILL_KEYS)
    assert set(_documented_defaults(ROOT / "docs/parameters.md")) == set(all_keys())


def test_every_field_has_a_meaning():
    from mbridge_offload_tools.docgen.params import MEANINGS

    assert [k for k in all_keys() if not MEANINGS.get(k)] == [], "add the meaning to tools/docgen/params.py"
    assert [k for k in MEANINGS if k not in all_keys()] == [], "a documented field left the config model"


def test_skill_states_the_bridge_and_megatron_lm_fraction_defaults():
    text = SKILL.read_text()
    assert field_default("optimizer.optimizer_offload_fraction") == 0.0
    assert "defaults to **0.0**" in text and "defaults to **1.0**" in text


def test_constraints_match_the_rule_catalogue():
    from mbridge_offload.config.rules.catalogue import all_rules

    rows = [r for r in _rows(_section(SKILL, "constraints")) if r[0].startswith("[")]
    documented = [(re.search(r"`(.+?)`", r[0])[1], r[1], r[2]) for r in rows]
    assert documented == [(rule.id, rule.severity, rule.origin) for rule in all_rules()]


def test_failure_modes_match_the_diagnosis_catalogue():
    from mbridge_offload.actions.diagnose import KNOWN, match_text

    rows = [r for r in _rows(_section(SKILL, "diagnosis")) if r[0].startswith("`")]
    assert [r[0].strip("`") for r in rows] == [mode.id for mode in KNOWN]
    # The example in SKILL.md really diagnoses.
    found = match_text("Currently there is no support for Pipeline parallelism with CPU offloading")
    assert found and found[0].failure == "pp_constraint"


def test_bridge_selector_in_skill_is_covered_by_the_test_tool():
    from mbridge_offload.actions import testsuite

    text = SKILL.read_text()
    command = re.search(r"python -m pytest (\S+) -k \"([^\"]+)\" -q", text)
    assert command, "SKILL.md shows the Megatron Bridge pytest command"
    assert command[1] in testsuite.BRIDGE_TEST_FILES
    tool_terms = set(testsuite.BRIDGE_SELECTOR.split(" or "))
    assert set(command[2].split(" or ")) <= tool_terms
    assert "selects no test" in text


# ---------------------------------------------------------------------------------------------- tools and commands


def test_every_mcp_tool_is_in_the_skill_and_vice_versa():
    from mbridge_offload_tools.docgen.catalogue import server_tools

    served = {tool.name for tool in server_tools()}
    table = {r[0].strip("`") for r in _rows(_section(SKILL, "tools")) if r[0].startswith("`")}
    text = SKILL.read_text() + (ROOT / "README.md").read_text()
    mentioned = set(re.findall(r"mcp__mbridge-offload__(\w+)", text))
    from mbridge_offload.actions.diagnose import KNOWN

    # Config fields and failure ids share the look of a tool name; they are not tools.
    fields = {f for section in SECTIONS.values() for f in section.model_fields} | {m.id for m in KNOWN}
    mentioned |= set(re.findall(r"`(\w+_(?:config|mode|offload|tests|failure))`", text)) - fields
    assert table == served == set(CLI_EQUIVALENTS)
    assert mentioned <= served, f"named in SKILL.md/README but not served: {mentioned - served}"


def _cli(argv: list[str]) -> tuple[int, str]:
    from mbridge_offload_tools.cli import main

    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit as exc:
            return int(exc.code or 0), out.getvalue()
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


@pytest.mark.parametrize("doc", ["SKILL.md", "README.md", "docs/walkthrough.md"])
def test_every_command_shown_runs(doc):
    commands = _commands(ROOT / doc)
    assert commands, f"no mbridge-offload command found in {doc}"
    for argv in commands:
        code, _ = _cli([argv[0], "--help"])
        assert code == 0, f"{doc}: `mbridge-offload {argv[0]} --help` exits {code}"
        files = [a for a in argv[1:] if a.endswith((".yaml", ".yml", ".json", ".log")) and not a.startswith("-")]
        writes = "--in-place" in argv or "--output" in argv
        if argv[0] in _REAL and not writes and all((ROOT / f).exists() for f in files):
            cwd = Path.cwd()
            os.chdir(ROOT)
            try:
                code, out = _cli(argv)
            finally:
                os.chdir(cwd)
            assert code in (0, 1), f"{doc}: `mbridge-offload {shlex.join(argv)}` exits {code}"
            if "--json" in argv:
                json.loads(out)


def test_walkthrough_blocks_are_captured_output():
    text = (ROOT / "docs/walkthrough.md").read_text()
    blocks = re.findall(r"<!-- BEGIN GENERATED: ([\w-]+) -->\n(.*?)<!-- END GENERATED: \1 -->", text, re.S)
    from mbridge_offload_tools.docgen.walkthrough import CAPTURES

    assert sorted(name for name, _ in blocks) == sorted(CAPTURES)
    for name, body in blocks:
        assert "captured by `python -m mbridge_offload_tools.docgen.walkthrough`" in body, name
        assert f"$ {CAPTURES[name][0]}" in body and "(exit code " in body, name
    from mbridge_offload_tools.docgen.walkthrough import GUIDE_CAPTURES

    guide = skilldocs.sections((ROOT / "docs/cpu-offloading.md").read_text())
    for name, commands in GUIDE_CAPTURES.items():
        assert f"$ {commands[0]}" in guide[name] and "(exit code " in guide[name], name


def test_cli_equivalents_name_real_subcommands():
    for command in CLI_EQUIVALENTS.values():
        sub = command.split()[1]
        assert _cli([sub, "--help"])[0] == 0, command


def test_make_targets_named_in_readme_exist():
    makefile = (ROOT / "Makefile").read_text()
    for target in re.findall(r"^make (\w+)", (ROOT / "README.md").read_text(), re.M):
        assert re.search(rf"^{target}:", makefile, re.M), target


def test_skill_folder_runs_from_a_copy_without_installing(tmp_path):
    # The folder copied into .claude/skills/<name>/ (or .agents/skills/) runs
    # `python -m mbridge_offload_tools` from its root.
    skill = tmp_path / "mbridge-offload"
    skill.mkdir()
    for part in ("offload", "tools"):
        shutil.copytree(ROOT / part, skill / part, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("SKILL.md", "pyproject.toml"):
        shutil.copy(ROOT / name, skill / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-m", "tools", "--help"], cwd=skill, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "validate" in result.stdout


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


def test_card_failure_modes_exist_in_the_diagnosis_catalogue():
    from mbridge_offload.actions.diagnose import KNOWN

    known = {mode.id for mode in KNOWN}
    for mode in _card()["failure_modes"]:
        assert mode["name"] in known, mode["name"]


# ---------------------------------------------------------------------------------------------- plugin, docs, evals


def test_plugin_manifest_points_at_the_skill_and_the_server():
    plugin = json.loads((ROOT / ".claude-plugin/plugin.json").read_text())
    assert re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", plugin["name"])
    for path in plugin["skills"]:
        assert path.startswith("./") and (ROOT / path / "SKILL.md").exists()
    assert plugin["mcpServers"].startswith("./")
    servers = json.loads((ROOT / plugin["mcpServers"]).read_text())
    assert servers, ".mcp.json declares the server"
    market = json.loads((ROOT / ".claude-plugin/marketplace.json").read_text())
    assert [p["name"] for p in market["plugins"]] == [plugin["name"]]


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
        cwd = Path.cwd()
        os.chdir(ROOT)
        try:
            code, out = _cli(argv)
        finally:
            os.chdir(cwd)
        assert code in (0, 1), f"{e['id']}: exit {code}"
        json.loads(out)


@pytest.mark.skipif(os.environ.get("MBRIDGE_OFFLOAD_NPX") != "1", reason="set MBRIDGE_OFFLOAD_NPX=1 to run npx skills")
def test_npx_skills_lists_the_skill():
    result = subprocess.run(
        ["npx", "-y", "skills@1.5.16", "add", "./", "--list"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert "Found 1 skill" in result.stdout and "mbridge-offload" in result.stdout
