"""Reading configs: Bridge YAML/JSON, stdin, Hydra overrides, Megatron-LM argv; one-line bad-input errors."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from mbridge_offload.config.sources import ConfigError, apply_overrides, load, parse_megatron_argv
from mbridge_offload.config.validate import validate
from tests.support import tree

ROOT = Path(__file__).resolve().parents[2]


def test_bundled_example_loads():
    loaded = load(str(ROOT / "examples" / "qwen3_30b_a3b_pretrain.yaml"))
    assert loaded.config.model.num_layers == 48
    assert loaded.config.optimizer.optimizer_offload_fraction == 0.5
    assert loaded.config.env["frontend"] == "bridge"


def test_partial_yaml_and_json(tmp_path):
    (tmp_path / "a.yaml").write_text("optimizer:\n  optimizer_cpu_offload: true\n")
    assert load(str(tmp_path / "a.yaml")).config.optimizer.optimizer_cpu_offload is True
    (tmp_path / "b.json").write_text(json.dumps({"model": {"cpu_offloading": True}}))
    assert load(str(tmp_path / "b.json")).config.model.cpu_offloading is True


def test_stdin():
    loaded = load("-", stdin=io.StringIO("model:\n  num_layers: 4\n"))
    assert loaded.config.model.num_layers == 4 and loaded.source == "<stdin>"


def test_hydra_overrides_set_add_delete_and_null():
    raw = {"model": {"recompute_granularity": "full", "num_layers": 4}}
    apply_overrides(
        raw, ["model.recompute_granularity=null", "+optimizer.optimizer_offload_fraction=0.5", "~model.num_layers"]
    )
    assert raw == {"model": {"recompute_granularity": None}, "optimizer": {"optimizer_offload_fraction": 0.5}}


def test_override_errors_are_one_line():
    with pytest.raises(ConfigError) as exc:
        apply_overrides({"model": {"num_layers": 4}}, ["+model.num_layers=8"])
    assert "already set" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="nothing to delete"):
        apply_overrides({}, ["~model.cpu_offloading"])


def test_megatron_lm_argv_derivations():
    raw = parse_megatron_argv(
        [
            "--optimizer-cpu-offload",
            "--cpu-offloading-num-layers",
            "4",
            "--num-layers",
            "8",
            "--bf16",
            "--use-distributed-optimizer",
            "--some-unknown-flag",
        ]
    )
    assert raw["model"]["cpu_offloading"] is True  # derived from --cpu-offloading-num-layers > 0
    assert raw["optimizer"]["optimizer_offload_fraction"] == 1.0  # Megatron-LM CLI default
    assert raw["optimizer"]["bf16"] is True
    assert raw["ddp"]["use_distributed_optimizer"] is True
    loaded = load(argv=["--optimizer-cpu-offload"])
    assert loaded.config.env["frontend"] == "megatron-lm"
    assert raw["unknown_arguments"] == ["--some-unknown-flag"]


def test_megatron_lm_full_argument_set_and_unknown_flags_warn():

    argv = "--num-layers 4 --recompute-activations --fp8-param-gather --fp8-recipe tensorwise"
    argv += " --use-distributed-optimizer --optimizer-cpu-offload --use-precision-aware-optimizer --no-such"
    loaded = load(argv=argv.split())
    assert loaded.config.model.recompute_granularity == "selective"  # validate_args: --recompute-activations
    assert loaded.config.ddp.fp8_param_gather is True
    assert loaded.config.optimizer.fp8_recipe == "tensorwise"
    report = validate(loaded.config, loaded.raw)
    assert "OPT-MLM-FP8-PARAM-GATHER" in {f.rule for f in report.errors}
    unknown = report.by_rule("CFG-UNKNOWN-ARGUMENT")
    assert [f.message.split()[0] for f in unknown] == ["--no-such"]
    # A flag every release knows but no rule reads is kept, not dropped.
    assert load(argv=["--data-path", "x", "--seed", "3"]).raw["megatron_lm"] == {"data_path": ["x"], "seed": 3}


def test_megatron_lm_parser_refuses_bad_choices_in_one_line():
    with pytest.raises(ConfigError, match="invalid choice") as exc:
        load(argv=["--recompute-granularity", "none"])
    assert "\n" not in str(exc.value)


def test_wrong_type_names_key_value_and_line(tmp_path):
    # Outside megatron-core's sections (there a wrong type is kept as written for the rules: test_schema.py).
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  num_layers: 4\ntrain:\n  micro_batch_size: one\n")
    with pytest.raises(ConfigError) as exc:
        load(str(path))
    message = str(exc.value)
    assert message.startswith(f"{path}:4: train.micro_batch_size = 'one'")
    assert "\n" not in message


def _upstream_errors(text: str, target: str) -> list[tuple[str | None, str | None]]:
    """validate as it answers by default: megatron-core itself (the upstream run) judges the model section."""
    from mbridge_offload_tools.interface.calls import validate_answer
    from mbridge_offload_tools.interface.tools import TOOLS

    v = {p.name: p.default for p in TOOLS["validate_config"].params}
    report = validate_answer({**v, "config": text, "target": target, "exact": True})
    return [(f.exception, f.upstream_message) for f in report.errors]


@pytest.mark.megatron
@pytest.mark.parametrize(
    "value,message",
    [
        ("abc", "can't multiply sequence by non-int of type 'float'"),
        ("[1, 2]", "can't multiply sequence by non-int of type 'float'"),
        ('"4"', "can't multiply sequence by non-int of type 'float'"),
        ("{a: 1}", "unsupported operand type(s) for *: 'float' and 'dict'"),
    ],
)
def test_wrong_type_in_megatron_core_section_gets_pythons_own_type_error(value, message):
    # What megatron-core 0.16.1 / 0.19.2 raise for these (the output layer's init method multiplies num_layers): no
    # rule of ours restates it; the upstream run returns it verbatim.
    text = f"model:\n  num_layers: {value}\n  hidden_size: 64\n  num_attention_heads: 4\n"
    for target in ("megatron-core==0.16.1", "megatron-core==0.19.2"):
        assert _upstream_errors(text, target) == [("TypeError", message)]


def test_malformed_and_missing_inputs(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        load(str(bad))
    with pytest.raises(ConfigError, match="no such file"):
        load(str(tmp_path / "missing.yaml"))
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load(str(top))


def test_section_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: 3\n")
    with pytest.raises(ConfigError, match="section 'model' must be a mapping"):
        load(str(path))


def test_config_container_wrapper_is_read_at_the_right_level(tmp_path):
    import io

    from ruamel.yaml import YAML

    from mbridge_offload.config.sources import document_root, parse_text

    text = "# perf recipe\nConfigContainer:\n  model:\n    num_layers: 4\n    cpu_offloading: true\n"
    text += "    cpu_offloading_num_layers: 4\n  optimizer:\n    lr: 0.001\n"
    path = tmp_path / "perf.yaml"
    path.write_text(text)
    loaded = load(str(path))
    assert loaded.config.model.num_layers == 4 and loaded.config.model.cpu_offloading is True
    assert "ACT-NUM-LAYERS" in {f.rule for f in validate(loaded.config, loaded.raw).errors}
    # Edited in place at the inner level, dumped back whole: the wrapper and the comment stay.
    _raw, tree = parse_text(text)
    tree["model"]["cpu_offloading_num_layers"] = 2
    out = io.StringIO()
    YAML(typ="rt").dump(document_root(tree), out)
    assert out.getvalue().startswith("# perf recipe\nConfigContainer:\n  model:")
    assert "cpu_offloading_num_layers: 2" in out.getvalue()


def test_recipe_config_works_twice_in_one_process(tmp_path):
    """A second ``recipe_config`` call in one process (the MCP server's case) reuses the imported recipe module."""
    import subprocess
    import sys
    import textwrap

    pkg = tmp_path / "megatron" / "bridge" / "recipes"
    pkg.mkdir(parents=True)
    for init in (tmp_path / "megatron", tmp_path / "megatron" / "bridge"):
        (init / "__init__.py").write_text("")
    # The real package __init__ imports every model family; recipe_config must not need it.
    (pkg / "__init__.py").write_text("raise ImportError('heavy optional dependencies')\n")
    (pkg / "toy.py").write_text(
        textwrap.dedent(
            """
            CALLS = []

            class _Container:
                def to_yaml(self, path):
                    open(path, "w").write("model:\\n  num_layers: 4\\n")

            def toy_pretrain_config():
                CALLS.append(1)
                return _Container()
            """
        )
    )
    code = textwrap.dedent(
        """
        import sys
        from mbridge_offload.config.sources import recipe_config
        first = recipe_config("toy_pretrain_config")
        second = recipe_config("toy_pretrain_config")
        assert first == second == {"model": {"num_layers": 4}}, (first, second)
        assert len(sys.modules["megatron.bridge.recipes.toy"].CALLS) == 2
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": tree.pythonpath(tmp_path)},
    )
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]
