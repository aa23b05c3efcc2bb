"""The house rules of the code base, checked from the source (``mbridge_offload_tools.docgen.house``)."""

from __future__ import annotations

import subprocess
import sys

import tomllib

from mbridge_offload_tools.docgen import house

ROOT = house.ROOT


def test_no_import_circles_counting_function_level_and_type_checking_imports():
    assert house.import_cycles() == []


def test_imports_point_one_way_and_the_config_side_never_imports_torch():
    assert house.wrong_arrows() == []


def test_offload_holds_at_most_ten_modules_directly():
    direct = sorted(p.name for p in (ROOT / "offload").glob("*.py"))
    assert len(direct) <= 10, direct


def test_no_function_is_longer_than_80_lines():
    assert house.long_functions() == []


def test_every_package_folder_is_installed_under_its_project_import_name():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed = set(setup["packages"])
    on_disk = {m for m, mod in house.modules().items() if mod.path.name == "__init__.py"}
    assert listed == on_disk
    assert setup["package-dir"] == house.PACKAGES


def test_tests_mirror_the_rooms():
    rooms = {p.name for p in (ROOT / "offload").iterdir() if (p / "__init__.py").exists()} | {"tools"}
    test_rooms = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert rooms <= test_rooms, rooms - test_rooms


def test_the_validate_path_imports_no_torch():
    code = (
        "import sys, json\n"
        "from mbridge_offload_tools.cli import main\n"
        "try:\n"
        "    main(['validate', 'examples/qwen3_30b_a3b_pretrain.yaml', '--json'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'transformer_engine'))\n"
        "print(json.dumps(heavy), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr


def test_a_foreign_tools_package_does_not_shadow_ours(tmp_path):
    # Megatron-LM has its own tools/ at its root, where users run things: our CLI must still be ours there.
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "__init__.py").write_text("raise SystemExit('foreign tools package imported')\n")
    out = subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools", "--version"], cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 0 and "foreign" not in out.stderr, out.stderr
