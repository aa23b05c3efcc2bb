"""offload/mbridge_offload/config/reading.py and errors.py: the bounded reader and the one error shape."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from mbridge_offload.config import reading
from mbridge_offload.config.errors import InputError, as_input_error, internal_error
from mbridge_offload.config.sources import ConfigError, load, parse_text


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    start = time.perf_counter()
    with pytest.raises(InputError, match="FIFO"):
        reading.read_text_file(fifo)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/null"])
def test_devices_are_refused(path: str) -> None:
    with pytest.raises(InputError, match="character device"):
        reading.read_text_file(path)


def test_a_directory_and_a_missing_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="directory"):
        reading.read_text_file(tmp_path)
    with pytest.raises(InputError, match="no such file"):
        reading.read_text_file(tmp_path / "nope.yaml")


def test_the_size_cap_is_configurable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  num_layers: 4\n" + "# pad\n" * 100)
    assert "num_layers" in reading.read_text_file(path)
    monkeypatch.setenv(reading.MAX_BYTES_ENV, "64")
    with pytest.raises(InputError, match="over the 64-byte limit") as info:
        reading.read_text_file(path)
    assert reading.MAX_BYTES_ENV in info.value.fix
    with pytest.raises(InputError, match="over the 64-byte limit"):
        parse_text("model:\n" + "  k: 1\n" * 50, "<text>")
    monkeypatch.setenv(reading.MAX_BYTES_ENV, "lots")
    with pytest.raises(InputError, match="not an integer"):
        reading.max_bytes()


def test_a_log_keeps_its_tail_instead_of_being_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"x" * 1000 + b"\xff the end")
    monkeypatch.setenv(reading.MAX_BYTES_ENV, "100")
    text = reading.read_text_file(log, what="log", tail=True)
    assert len(text.encode()) <= 103 and text.endswith("the end")


def test_alias_expansion_and_depth_are_limited(monkeypatch: pytest.MonkeyPatch) -> None:
    bomb = 'a: &a ["x", "x", "x", "x"]\nb: &b [*a, *a, *a, *a]\nc: &c [*b, *b, *b, *b]\nmodel: {k: *c}\n'
    data, _ = parse_text(bomb, "<text>")
    assert len(data["model"]["k"]) == 4  # small: fine
    monkeypatch.setenv(reading.MAX_NODES_ENV, "50")
    with pytest.raises(ConfigError, match="more than 50 values after expanding YAML aliases"):
        parse_text(bomb, "<text>")
    monkeypatch.setenv(reading.MAX_DEPTH_ENV, "3")
    with pytest.raises(ConfigError, match="nested deeper than 3 levels"):
        parse_text("model:\n  a:\n    b:\n      c:\n        d: 1\n", "<text>")
    monkeypatch.delenv(reading.MAX_DEPTH_ENV)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="nested deeper than 32 levels"):  # counted before the parser recurses
        parse_text("model: " + "[" * 5000 + "]" * 5000, "<text>")
    assert time.perf_counter() - start < 1.0
    with pytest.raises(ConfigError, match="nested too deeply"):
        parse_text("{" + '"a": {' * 5000 + "}" * 5001, "<text>")


@pytest.mark.parametrize(
    "text",
    [
        '{"model": {"num_layers": NaN}}',
        '{"model": {"num_layers": Infinity}}',
        '{"optimizer": {"lr": -Infinity}}',
        "model:\n  num_layers: .nan\n",
        "model:\n  cpu_offloading_num_layers: -.inf\n",
        "optimizer:\n  optimizer_offload_fraction: 1e999\n",
    ],
)
def test_non_finite_numbers_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match=r"(JSON constant|not a finite number)"):
        load(text)


@pytest.mark.parametrize(
    "text", ['{"model": {"num_layers": ' + "9" * 5000 + "}}", "model:\n  num_layers: " + "9" * 5000]
)
def test_huge_numbers_are_refused_not_crashed_on(text: str) -> None:
    with pytest.raises(ConfigError, match="realistic size"):
        load(text)


def test_an_empty_config_is_a_warning_not_a_silent_ok() -> None:
    from mbridge_offload.config.validate import validate

    for text in ("# only a comment\n", "{}", "unknown_section: {a: 1}\n"):
        loaded = load(text) if text.strip() != "{}" else load("{}")
        report = validate(loaded.config, loaded.raw)
        assert [f.rule for f in report.findings] == ["CFG-EMPTY"] and report.ok
    loaded = load("model:\n  num_layers: 4\n")
    assert "CFG-EMPTY" not in [f.rule for f in validate(loaded.config, loaded.raw).findings]


@pytest.mark.parametrize(
    ("exc", "words"),
    [
        (RecursionError("maximum recursion depth exceeded"), "nested too deeply"),
        (ZeroDivisionError("float division by zero"), "is 0"),
        (OverflowError("cannot convert float infinity to integer"), "too large"),
        (IsADirectoryError(21, "Is a directory", "/x"), "is a directory"),
        (PermissionError(13, "Permission denied", "/x"), "permission denied"),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), "not UTF-8"),
        (MemoryError(), "too large to process"),
        (OSError(28, "No space left on device"), "no space left"),
        (yaml.YAMLError("mapping values are not allowed here"), "mapping values"),
    ],
)
def test_every_failure_the_input_can_provoke_becomes_one_input_error(exc: BaseException, words: str) -> None:
    error = as_input_error(exc, "config")
    assert isinstance(error, InputError) and words in str(error)
    payload = error.to_dict()
    assert payload["ok"] is False and payload["error"] == str(error) and "\n" not in payload["error"]


@pytest.mark.parametrize(
    "exc",
    [
        KeyError("x"),
        AttributeError("'NoneType' object has no attribute 'x'"),
        TypeError("bad operand"),
        ValueError("zip() argument 2 is shorter"),
        RuntimeError("boom"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_bug_is_not_translated_into_an_input_error(exc: BaseException) -> None:
    assert as_input_error(exc, "config") is None
    payload = internal_error(exc, "config")
    assert (
        payload["kind"] == "internal"
        and "internal error" in payload["error"]
        and type(exc).__name__ in payload["error"]
    )
