"""offload/mbridge_offload/actions/apply/apply.py: round-trip edits of real Bridge-style YAML files."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from mbridge_offload.actions.apply.apply import apply_offload
from mbridge_offload.actions.apply.result import ApplyError
from mbridge_offload.config.sources import ConfigError, load
from mbridge_offload.config.validate import validate

BRIDGE_YAML = """\
# Qwen3-style pretraining, partial ConfigContainer dump.
model:
  _target_: megatron.bridge.models.qwen.qwen_provider.Qwen3ModelProvider
  num_layers: 28  # keep in sync with the checkpoint
  hidden_size: 1024
  num_attention_heads: 16
  pipeline_model_parallel_size: 1
  recompute_granularity: selective  # saves activation memory
  recompute_modules: [layernorm]
  cuda_graph_impl: transformer_engine
  bf16: true
optimizer:
  optimizer: adam
  lr: 0.0003   # peak LR
  use_distributed_optimizer: true
  # the optimizer offload knobs go here
ddp:
  use_distributed_optimizer: true
train:
  micro_batch_size: 1
"""


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "pretrain.yaml"
    path.write_text(BRIDGE_YAML, encoding="utf-8")
    return path


@pytest.fixture(autouse=True)
def _cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Writes are allowed under the working directory; run each test from its own tmp dir.
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)


def test_optimizer_mode_sets_switch_and_fraction_with_reasons(config_file: Path) -> None:
    result = apply_offload(str(config_file), "optimizer")
    changed = {c.key: c.new for c in result.changes}
    assert changed == {"optimizer.optimizer_cpu_offload": True, "optimizer.optimizer_offload_fraction": 0.5}
    assert all(c.why for c in result.changes)
    assert result.overrides == ["optimizer.optimizer_cpu_offload=true", "optimizer.optimizer_offload_fraction=0.5"]
    assert "+  optimizer_cpu_offload: true" in result.diff
    assert result.ok and result.written is None


def test_dry_run_writes_nothing(config_file: Path) -> None:
    before = config_file.read_text()
    result = apply_offload(str(config_file), "optimizer", fraction=0.25)
    assert result.written is None
    assert config_file.read_text() == before
    assert sorted(p.name for p in config_file.parent.iterdir()) == ["pretrain.yaml", "work"]


def test_output_keeps_comments_order_and_untouched_values_and_validates(config_file: Path) -> None:
    out = config_file.parent / "pretrain_offload.yaml"
    result = apply_offload(str(config_file), "optimizer", fraction=0.75, output=out)
    assert result.written == str(out)
    text = out.read_text()
    for line in (
        "# Qwen3-style pretraining, partial ConfigContainer dump.",
        "num_layers: 28  # keep in sync",
        "lr: 0.0003   # peak LR",
        "# the optimizer offload knobs go here",
        "recompute_granularity: selective  # saves activation memory",
    ):
        assert line in text
    # Untouched lines are byte-identical and in the same order.
    original = [line for line in BRIDGE_YAML.splitlines()]
    kept = [line for line in text.splitlines() if line in original]
    assert kept == original
    # The section comment stays directly above the next section.
    lines = text.splitlines()
    assert lines[lines.index("ddp:") - 1] == "  # the optimizer offload knobs go here"
    loaded = load(str(out))
    assert loaded.config.optimizer.optimizer_offload_fraction == 0.75
    assert validate(loaded.config, loaded.raw).ok


def test_activation_mode_resolves_recompute_and_cuda_graph_conflicts(config_file: Path) -> None:
    result = apply_offload(str(config_file), "activation", num_layers=4)
    changed = {c.key: (c.old, c.new) for c in result.changes}
    assert changed["model.cpu_offloading"] == (False, True)
    assert changed["model.cpu_offloading_num_layers"] == (0, 4)
    assert changed["model.recompute_granularity"] == ("selective", None)
    assert changed["model.cuda_graph_impl"] == ("transformer_engine", "none")
    assert "model.recompute_granularity=null" in result.overrides
    assert "recompute_granularity: null  # saves activation memory" in result.text  # the line keeps its separator
    assert result.ok, result.findings


def test_activation_refused_with_pipeline_parallelism(tmp_path: Path) -> None:
    path = tmp_path / "pp2.yaml"
    path.write_text(BRIDGE_YAML.replace("pipeline_model_parallel_size: 1", "pipeline_model_parallel_size: 2"))
    with pytest.raises(ApplyError, match=r"pipeline_model_parallel_size=1, but it is 2.*mode=optimizer"):
        apply_offload(str(path), "activation", num_layers=4, output=tmp_path / "out.yaml")
    assert not (tmp_path / "out.yaml").exists()


def test_num_layers_must_leave_one_layer_on_the_gpu(config_file: Path) -> None:
    with pytest.raises(ApplyError, match="at most 27"):
        apply_offload(str(config_file), "activation", num_layers=28)


def test_mode_argument_mismatches_are_refused(config_file: Path) -> None:
    with pytest.raises(ApplyError, match="fraction applies to optimizer"):
        apply_offload(str(config_file), "activation", fraction=0.5)
    with pytest.raises(ApplyError, match="num_layers applies to activation"):
        apply_offload(str(config_file), "optimizer", num_layers=3)
    with pytest.raises(ApplyError, match=r"must be in \(0, 1\]"):
        apply_offload(str(config_file), "optimizer", fraction=1.5)
    with pytest.raises(ApplyError, match="not one of"):
        apply_offload(str(config_file), "everything")


def test_in_place_keeps_a_backup_and_second_run_is_a_no_op(config_file: Path) -> None:
    first = apply_offload(str(config_file), "both", fraction=0.5, num_layers=4, in_place=True)
    assert first.written == str(config_file)
    backup = Path(first.backup)
    assert backup.name == "pretrain.yaml.bak" and backup.read_text() == BRIDGE_YAML
    after_first = config_file.read_text()
    mtime = os.stat(config_file).st_mtime_ns

    second = apply_offload(str(config_file), "both", fraction=0.5, num_layers=4, in_place=True)
    assert second.changes == [] and second.diff == "" and second.written is None
    assert config_file.read_text() == after_first
    assert os.stat(config_file).st_mtime_ns == mtime
    assert not (config_file.parent / "pretrain.yaml.bak.1").exists()


def test_refuses_to_write_a_config_the_validator_rejects(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        BRIDGE_YAML.replace(
            "  bf16: true\n",
            "  bf16: true\n  fine_grained_activation_offloading: true\n  offload_modules: [core_attn]\n",
        )
    )
    # Optimizer mode does not touch the fine-grained + layer-level conflict once activation offload is on.
    bad.write_text(
        bad.read_text().replace(
            "pipeline_model_parallel_size: 1",
            "pipeline_model_parallel_size: 1\n  cpu_offloading: true\n  cpu_offloading_num_layers: 2",
        )
    )
    out = tmp_path / "out.yaml"
    result = apply_offload(str(bad), "optimizer", fraction=0.5, output=out)
    assert not result.ok
    assert result.refused and "ACT-FINE-GRAINED" in result.refused
    assert not out.exists()


def test_never_writes_outside_the_allowed_roots(config_file: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    with pytest.raises(ApplyError, match="outside the directories writes may go to"):
        apply_offload(str(config_file), "optimizer", output=elsewhere / "x.yaml")
    assert not (elsewhere / "x.yaml").exists()
    with pytest.raises(ApplyError, match="outside"):
        apply_offload(str(config_file), "optimizer", output=config_file.parent / ".." / "escape.yaml")
    result = apply_offload(str(config_file), "optimizer", output=elsewhere / "x.yaml", allowed_root=elsewhere)
    assert Path(result.written).is_file()


def test_overrides_format_writes_the_override_list(config_file: Path) -> None:
    out = config_file.parent / "offload.overrides"
    result = apply_offload(str(config_file), "optimizer", fraction=1.0, output=out, output_format="overrides")
    assert out.read_text().splitlines() == result.overrides
    assert "optimizer.optimizer_offload_fraction=1.0" in result.overrides


def test_inline_text_and_json_inputs(tmp_path: Path) -> None:
    inline = apply_offload("model:\n  num_layers: 8\noptimizer:\n  lr: 0.001\n", "optimizer", fraction=0.25)
    assert "optimizer_offload_fraction: 0.25" in inline.text
    assert "optimizer.overlap_cpu_optimizer_d2h_h2d=true" not in inline.overrides  # low fraction: no overlap
    with pytest.raises(ApplyError, match="in_place needs a config file"):
        apply_offload("model:\n  num_layers: 8\n", "optimizer", in_place=True)
    src = tmp_path / "c.json"
    src.write_text(json.dumps({"model": {"num_layers": 8}, "optimizer": {"lr": 0.001}}))
    result = apply_offload(str(src), "optimizer", output=tmp_path / "c2.json")
    data = json.loads((tmp_path / "c2.json").read_text())
    assert data["optimizer"] == {
        "lr": 0.001,
        "optimizer_cpu_offload": True,
        "optimizer_offload_fraction": 0.5,
    }
    assert result.ok


def test_none_mode_switches_both_off(tmp_path: Path) -> None:
    path = tmp_path / "on.yaml"
    path.write_text(
        "model:\n  num_layers: 8\n  cpu_offloading: true  # on\n  cpu_offloading_num_layers: 2\n"
        "optimizer:\n  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 0.5\n"
    )
    result = apply_offload(str(path), "none")
    assert {c.key: c.new for c in result.changes} == {
        "optimizer.optimizer_cpu_offload": False,
        "model.cpu_offloading": False,
    }
    assert re.search(r"^  cpu_offloading: false +# on$", result.text, re.MULTILINE)


def test_malformed_yaml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  num_layers: [8\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        apply_offload(str(path), "optimizer")


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (
            "optimizer:\n  lr: 0.0001  # peak\n\n# ddp section\nddp:\n  x: 1\n",
            "optimizer:\n  lr: 0.0001  # peak\n  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 0.25\n\n"
            "# ddp section\nddp:\n  x: 1\n",
        ),
        (
            "optimizer:\n  lr: 0.0001\n  # block\nddp:\n  x: 1\n",
            "optimizer:\n  lr: 0.0001\n  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 0.25\n  # block\n"
            "ddp:\n  x: 1\n",
        ),
        (
            "optimizer:\n  lr: 0.0001\n\nddp:\n  x: 1\n",
            "optimizer:\n  lr: 0.0001\n  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 0.25\n"
            "\nddp:\n  x: 1\n",
        ),
    ],
)
def test_comments_and_blank_lines_between_sections_stay_above_the_next_section(before: str, after: str) -> None:
    assert apply_offload(before, "optimizer", fraction=0.25).text == after


def test_recommended_mode_applies_the_planners_choice(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "qwen3_30b_a3b_pretrain.yaml"
    result = apply_offload(str(example), "recommended", planner={"gpu_memory_gb": 40})
    assert result.mode == "optimizer"
    assert "the planner chose mode=optimizer" in result.notes
    # The example is the card's 50 % run without overlap; apply's optimizer mode switches overlap on.
    assert result.overrides == [
        "optimizer.optimizer_offload_fraction=1.0",
        "optimizer.overlap_cpu_optimizer_d2h_h2d=true",
    ]
    assert result.ok


def test_recommended_mode_needs_model_sizes(config_file: Path) -> None:
    with pytest.raises(ApplyError, match="planner cannot size this config"):
        apply_offload("optimizer:\n  lr: 0.001\n", "recommended")
    with pytest.raises(ApplyError, match="only apply to mode=recommended"):
        apply_offload(str(config_file), "optimizer", planner={"gpu": "h100-80gb"})


def test_requested_overrides_are_written_so_the_file_validates_alone(tmp_path: Path) -> None:
    path = tmp_path / "pp2.yaml"
    path.write_text(BRIDGE_YAML.replace("pipeline_model_parallel_size: 1", "pipeline_model_parallel_size: 2"))
    out = tmp_path / "out.yaml"
    result = apply_offload(
        str(path),
        "activation",
        num_layers=4,
        overrides=["model.pipeline_model_parallel_size=1"],
        output=str(out),
        allowed_root=tmp_path,
    )
    assert result.written == str(out)
    assert {c.key: c.new for c in result.changes}["model.pipeline_model_parallel_size"] == 1
    written = load(str(out))
    assert written.config.model.pipeline_model_parallel_size == 1
    assert validate(written.config, written.raw).ok
    assert "# keep in sync with the checkpoint" in out.read_text()


def test_an_override_the_mode_must_undo_is_reported(config_file: Path) -> None:
    result = apply_offload(
        str(config_file), "activation", num_layers=4, overrides=["model.recompute_granularity=selective"]
    )
    assert {c.key: c.new for c in result.changes}["model.recompute_granularity"] is None
    assert any("conflicts with mode=activation" in note for note in result.notes)


def test_deleting_overrides_are_refused(config_file: Path) -> None:
    with pytest.raises(ApplyError, match="remove or edit other keys by hand"):
        apply_offload(str(config_file), "optimizer", overrides=["~train.micro_batch_size"])


def test_a_config_container_perf_yaml_keeps_its_wrapper_and_comments(tmp_path: Path) -> None:
    # Bridge's perf YAMLs hold the sections under one `ConfigContainer:` key: the edit lands inside it.
    src = tmp_path / "perf.yaml"
    src.write_text(
        "# perf recipe\nConfigContainer:\n  model:\n    num_layers: 8   # keep\n    pipeline_model_parallel_size: 1\n"
        "  optimizer:\n    optimizer: adam\n    use_distributed_optimizer: true\n",
        encoding="utf-8",
    )
    out = tmp_path / "perf.offload.yaml"
    result = apply_offload(str(src), mode="optimizer", fraction=0.5, output=str(out))
    text = out.read_text(encoding="utf-8")
    assert result.ok and text.startswith("# perf recipe\nConfigContainer:\n")
    assert "    num_layers: 8   # keep\n" in text and "    optimizer_offload_fraction: 0.5\n" in text
    loaded = load(str(out))
    assert loaded.config.optimizer.optimizer_cpu_offload and loaded.config.optimizer.optimizer_offload_fraction == 0.5


@pytest.mark.parametrize("fraction", [0.5, 0.7, 0.75, 1.0])
def test_apply_turns_overlap_on_exactly_where_validate_advises_it(config_file: Path, fraction: float) -> None:
    from mbridge_offload.config.rules.optimizer.offload import overlap_advised

    result = apply_offload(str(config_file), "optimizer", fraction=fraction)
    turned_on = any(c.key == "optimizer.overlap_cpu_optimizer_d2h_h2d" for c in result.changes)
    assert turned_on == overlap_advised(fraction)
    # the edited config never draws the overlap hint: one threshold for both
    assert "OPT-OVERLAP" not in {f["rule"] for f in result.findings}


def test_requested_overrides_are_written_even_when_they_equal_the_schema_default(tmp_path: Path) -> None:
    path = tmp_path / "layered.yaml"  # a Bridge YAML layered on a recipe: the recipe may set other values
    path.write_text("model:\n  num_layers: 8\noptimizer:\n  lr: 0.001\n")
    wanted = ["model.pipeline_model_parallel_size=1", "model.cuda_graph_impl=none"]
    result = apply_offload(str(path), "optimizer", overrides=wanted)
    assert set(wanted) <= set(result.overrides)
    assert "+  pipeline_model_parallel_size: 1" in result.diff
    assert "+  cuda_graph_impl: none" in result.diff


def test_a_requested_value_the_file_already_has_is_not_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  num_layers: 8\n  pipeline_model_parallel_size: 1\n")
    result = apply_offload(str(path), "none", overrides=["model.pipeline_model_parallel_size=1"])
    assert "model.pipeline_model_parallel_size" not in {c.key for c in result.changes}


# ---------------------------------------------------------------------------------------------- NVTE_CPU_OFFLOAD_V1

DENSE_TE = "model:\n  num_layers: 8\n  transformer_impl: transformer_engine\n"


def test_fine_grained_on_te_2_10_or_newer_writes_the_variable_and_says_to_export_it_before_te_is_imported(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fg.yaml"
    path.write_text(DENSE_TE)
    result = apply_offload(str(path), "fine-grained")
    assert "env_vars.NVTE_CPU_OFFLOAD_V1" in {c.key for c in result.changes} and result.ok
    (note,) = [n for n in result.notes if "NVTE_CPU_OFFLOAD_V1" in n]
    # TE reads it at import: Bridge's env_vars satisfy Bridge's check; any other launcher exports it itself.
    assert "when transformer_engine.pytorch is imported" in note and "launcher other than Bridge's" in note
    assert "export NVTE_CPU_OFFLOAD_V1=1 in the job's environment before Python starts" in note
    assert "assumed" in result.env["te_version_source"]


def test_fine_grained_on_te_before_2_10_writes_no_variable(tmp_path: Path) -> None:
    path = tmp_path / "fg.yaml"
    path.write_text(DENSE_TE)
    result = apply_offload(str(path), "fine-grained", env={"te_version": "2.9"})
    assert "env_vars.NVTE_CPU_OFFLOAD_V1" not in {c.key for c in result.changes}  # only the v1 path exists there
    assert not any("NVTE_CPU_OFFLOAD_V1" in n for n in result.notes)
    assert result.ok and result.env == {"te_version": "2.9"}


# ---------------------------------------------------------------------------------------------- fine-grained refusals


def test_fine_grained_refuses_what_the_catalogue_refuses_beside_the_runs_recompute(tmp_path: Path) -> None:
    # One home (config.validate.fine_grained_errors): MoE-inside modules while the whole MoE layer is recomputed.
    path = tmp_path / "moe.yaml"
    path.write_text(DENSE_TE + "  recompute_granularity: selective\n  recompute_modules: [moe]\n")
    with pytest.raises(ApplyError, match=r"\(MC-FG-MOE-RECOMPUTE\)"):
        apply_offload(str(path), "fine-grained", modules=["expert_fc1"])
    assert apply_offload(str(path), "fine-grained", modules=["core_attn", "attn_proj"]).ok


def test_fine_grained_refuses_an_unknown_module_with_the_catalogues_rule(tmp_path: Path) -> None:
    path = tmp_path / "fg.yaml"
    path.write_text(DENSE_TE)
    with pytest.raises(ApplyError, match=r"\(ACT-FG-MODULES-INVALID\)"):
        apply_offload(str(path), "fine-grained", modules=["dense_mlp"])
