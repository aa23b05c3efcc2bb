"""The house rules of the code base, checked from the source (``mbridge_offload_tools.docgen.house``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib

from mbridge_offload_tools.docgen import house

ROOT = house.ROOT


def test_no_import_circles_counting_function_level_and_type_checking_imports():
    assert house.import_cycles() == []


def test_imports_point_one_way_and_the_config_side_never_imports_torch():
    assert house.wrong_arrows() == []


def test_the_runtime_imports_no_agent_code_only_the_shared_upstream_facts():
    assert house.ROOMS["mbridge_offload_runtime"] == (house.UPSTREAM,)
    runtime = [m for m in house.modules().values() if house.room_of(m.name) == "mbridge_offload_runtime"]
    reached = {house.room_of(t) for m in runtime for t in m.imports if t != "torch"}
    assert reached - {None, "mbridge_offload_runtime"} <= {house.UPSTREAM}


def test_the_upstream_room_imports_nothing_of_ours_and_no_torch():
    upstream = house.modules()[house.UPSTREAM]
    assert upstream.imports == frozenset() and house.UPSTREAM in house.TORCH_FREE_ROOMS


def test_the_package_docstring_names_only_modules_that_exist():
    import mbridge_offload

    named = set(re.findall(r"``([a-z_.]+)``", mbridge_offload.__doc__ or ""))
    assert named, "the docstring names the rooms"
    missing = sorted(n for n in named if f"mbridge_offload.{n}" not in house.modules())
    assert missing == []
    rooms = {r.removeprefix("mbridge_offload.") for r in house.ROOMS if r.startswith("mbridge_offload.")}
    assert rooms <= named, rooms - named  # and it names every room


MAX_MODULES_PER_FOLDER = 10
MAX_MODULE_LINES = 650


def _folders():
    """Every package folder of both packages (the folder path is the import path)."""
    for folder in house.PACKAGES.values():
        yield from (p for p in (ROOT / folder).rglob("*") if (p / "__init__.py").is_file())
        yield ROOT / folder


def test_every_folder_of_both_packages_holds_at_most_ten_modules():
    # A folder shows its job: past ten modules, the second job gets a folder of its own (``__init__`` not counted).
    crowded = {
        str(f.relative_to(ROOT)): n
        for f in _folders()
        if (n := len([p for p in f.glob("*.py") if p.name != "__init__.py"])) > MAX_MODULES_PER_FOLDER
    }
    assert crowded == {}


def test_no_module_is_longer_than_650_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for folder in house.PACKAGES.values()
        for p in (ROOT / folder).rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_the_planner_shows_the_model_in_its_rooms():
    plan = ROOT / house.PACKAGES["mbridge_offload"] / "plan"
    rooms = {p.name for p in plan.iterdir() if (p / "__init__.py").is_file()}
    assert rooms >= {"model", "memory", "time", "inputs", "search", "evidence"}
    assert "spec" not in rooms  # read as "the tests" in many ecosystems: the model and the run live in plan/model/


def test_one_import_path_per_name():
    # No module re-exports another's names: each name is imported from the module that defines it (a package's
    # __init__ may gather a public API). mypy's implicit_reexport = false holds attribute access to the same rule.
    extra = tuple(p for d in ("tests", "benchmarks") for p in sorted((ROOT / d).rglob("*.py")))
    assert house.reexports(extra=extra) == []


def test_published_evidence_is_outside_the_librarys_import_path():
    plan = ROOT / house.PACKAGES["mbridge_offload"] / "plan"
    assert not any(
        p.stem in {"published", "published_fine_grained", "perf_check", "step_fit"} for p in plan.rglob("*.py")
    )
    offload = [m for m in house.modules().values() if m.name.startswith("mbridge_offload.")]
    assert not any("mbridge_offload_tools" in t for m in offload for t in m.imports)


def test_no_function_is_longer_than_80_lines():
    assert house.long_functions() == []


def test_the_folder_path_is_the_import_path_and_every_package_is_found():
    # No package-dir remapping: an editor or a type checker given the two source roots resolves every import.
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert "package-dir" not in setup and isinstance(setup["packages"], dict), "packages are found, not listed"
    roots = setup["packages"]["find"]["where"]
    for name, folder in house.PACKAGES.items():
        assert Path(folder).parts[-1] == name and Path(folder).parent.as_posix() in roots
    on_disk = {m for m, mod in house.modules().items() if mod.path.name == "__init__.py"}
    found = {
        ".".join(p.relative_to(ROOT / root).parts)
        for root in roots
        for p in (ROOT / root).rglob("*")
        if (p / "__init__.py").is_file()
    }
    assert found == on_disk


def test_tests_mirror_the_rooms():
    package = ROOT / house.PACKAGES["mbridge_offload"]
    rooms = {p.name for p in package.iterdir() if (p / "__init__.py").exists()} | {"tools"}
    test_rooms = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert rooms <= test_rooms, rooms - test_rooms


def test_the_validate_path_imports_no_torch():
    code = (
        "import sys, json\n"
        "from mbridge_offload_tools.cli.main import main\n"
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


_DOTTED = re.compile(r"\b(mbridge_offload(?:_tools)?(?:\.[A-Za-z_]\w*)+)")
_PATH = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)+[\w-]+\.py)\b")


def _names_that_exist(dotted: str, modules: set[str]) -> bool:
    """``dotted`` is a module of ours, or a name defined in one (``mbridge_offload.config.validate.first_error``)."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            obj = importlib.import_module(".".join(parts[:i]))
            for name in parts[i:]:
                if not hasattr(obj, name):
                    return False
                obj = getattr(obj, name)
            return True
    return False


def test_docstrings_and_comments_name_only_modules_that_exist():
    # After a rename a docstring keeps the old name: every dotted name of ours, and every path into one of
    # our folders (``plan/time/terms.py``; ``megatron/...`` is upstream's tree), names a module that exists.
    sources = [p for folder in house.PACKAGES.values() for p in (ROOT / folder).rglob("*.py")]
    ours = [p.relative_to(ROOT).as_posix() for p in sources]
    folders = {p.parent.name for p in sources} - {"megatron"}
    modules = set(house.modules())
    stale = []
    for path in sources:
        text = path.read_text(encoding="utf-8")
        stale += [f"{path.name}: {d}" for d in _DOTTED.findall(text) if not _names_that_exist(d.rstrip("."), modules)]
        for ref in _PATH.findall(text):
            if ref.split("/")[0] in folders and not any(p.endswith("/" + ref) for p in ours):
                stale.append(f"{path.name}: {ref}")
    assert stale == []
