"""The user's log read as evidence: PyTorch's OOM message (a bound), memory reports and peak prints (points), step
times; every format and unit generated and each parsed figure checked against what was printed.

The generators print the way upstream prints: ``format_size`` of PyTorch's caching allocator
(``c10/cuda/CUDACachingAllocator.cpp``), Megatron-LM's ``report_memory`` (MB = bytes / 1024²), Megatron Bridge's
``report_memory`` (decimal GB, five significant digits), and the launchers' line prefixes.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest

from mbridge_offload.config.errors import InputError
from mbridge_offload.plan.evidence.ranks import DEFAULT_ORDER, TP_PP_DP_ORDER, RankLayout, rank_of
from mbridge_offload.plan.evidence.read import parse_log, read_evidence
from mbridge_offload.plan.evidence.steps import steady_step_s

GiB = 2**30
UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
CASES = 200


def format_size(size: int) -> str:
    """PyTorch's ``format_size``: bytes up to 1024, then KiB / MiB / GiB with two decimals."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"


def printed_gib(text: str) -> float:
    """What a printed size says, in GiB (the figure a reader takes from the message)."""
    number, unit = text.split(" ")
    return float(number) * UNITS[unit] / GiB


def random_size(rng: random.Random, top_gib: float = 200.0) -> int:
    """A size in bytes over every unit's range (log-uniform from 0 bytes to ``top_gib``)."""
    if rng.random() < 0.05:
        return rng.choice([0, 1, 512, 1024])
    return int(math.exp(rng.uniform(0, math.log(top_gib * GiB))))


PREFIXES = [
    ("", None),
    ("[rank{r}]: ", "global"),
    ("[default{r}]:", "local"),
    ("{r}: ", "global"),
    ("[trainer{r}]:", "local"),
]
LEADS = ["", "torch.OutOfMemoryError: ", "torch.cuda.OutOfMemoryError: ", "RuntimeError: ", "ERROR: "]


def oom_message(rng: random.Random) -> tuple[str, dict[str, float | int]]:
    """One OOM message in the current or the pre-2.1 form, with the sizes it prints."""
    req, total, free, alloc, unalloc = (format_size(random_size(rng)) for _ in range(5))
    device = rng.randrange(8)
    kind = rng.choice(["CUDA", "HIP"])
    expected = {
        "requested": printed_gib(req),
        "capacity": printed_gib(total),
        "free": printed_gib(free),
        "allocated": printed_gib(alloc),
        "device": device,
    }
    if rng.random() < 0.7:
        capacity = rng.choice(["capacity", "capacty"])
        middle = ""
        for _ in range(rng.randrange(3)):
            middle += f"Process {rng.randrange(1, 99999)} has {format_size(random_size(rng))} memory in use. "
        if rng.random() < 0.7:
            this = format_size(random_size(rng))
            middle += f"Including non-PyTorch memory, this process has {this} memory in use. "
            expected["process"] = printed_gib(this)
        if rng.random() < 0.2:
            middle += f"{format_size(random_size(rng))} allowed; "
        private = f"with {format_size(random_size(rng))} allocated in private pools (e.g., CUDA Graphs), "
        tail = rng.choice(
            [
                " If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:"
                "True to avoid fragmentation.  See documentation for Memory Management  "
                "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
                " If reserved but unallocated memory is large try setting max_split_size_mb to avoid fragmentation.  "
                "See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF",
                "",
            ]
        )
        text = (
            f"{kind} out of memory. Tried to allocate {req}. GPU {device} has a total {capacity} of {total} of which "
            f"{free} is free. {middle}Of the allocated memory {alloc} is allocated by PyTorch, "
            f"{private if rng.random() < 0.2 else ''}and {unalloc} is reserved by PyTorch but unallocated.{tail}"
        )
        expected["unallocated"] = printed_gib(unalloc)
    else:
        reserved = format_size(random_size(rng))
        allowed = f"{format_size(random_size(rng))} allowed; " if rng.random() < 0.2 else ""
        text = (
            f"{kind} out of memory. Tried to allocate {req} (GPU {device}; {total} total capacity; {alloc} already "
            f"allocated; {free} free; {allowed}{reserved} reserved in total by PyTorch) If reserved memory is >> "
            "allocated memory try setting max_split_size_mb to avoid fragmentation."
        )
        expected["unallocated"] = max(0.0, printed_gib(reserved) - printed_gib(alloc))
    return text, expected


def wrapped(rng: random.Random, text: str, launcher: str, lead: str) -> list[str]:
    """The message on one line, or re-flowed over several (each line carrying the launcher's prefix, or not)."""
    prefix = launcher + lead
    if rng.random() < 0.6:
        return [prefix + text]
    words, lines, line = text.split(" "), [], []
    for word in words:
        line.append(word)
        if rng.random() < 0.15:
            lines.append(" ".join(line))
            line = []
    lines.append(" ".join(line))
    again = launcher if rng.random() < 0.5 else ""
    return [prefix + lines[0]] + [again + rest for rest in lines[1:]]


NOISE = [
    " [2026-03-30 10:01:01] iteration        3/      20 | consumed samples:           24 | learning rate: 3.0E-06 |",
    "Theoretical memory footprints: weight and optimizer=12345.67 MB, activation=2345.12 MB, total=14690.79 MB",
    "> building train, validation, and test datasets ...",
    "[rank0]:[W330 10:01:01.123 ProcessGroupNCCL.cpp:1234] Warning: allocated 1234 bytes of something",
    "number of parameters on (tensor, pipeline) model parallel rank (0, 1): 8030261248",
    "Traceback (most recent call last):",
]


@pytest.mark.parametrize("seed", range(CASES))
def test_every_oom_message_reads_as_its_printed_bound(seed):
    rng = random.Random(seed)
    text, want = oom_message(rng)
    template, kind = rng.choice(PREFIXES)
    rank = rng.randrange(4096)
    before = rng.sample(NOISE, rng.randrange(len(NOISE)))
    lines = before + wrapped(rng, text, template.format(r=rank), rng.choice(LEADS)) + rng.sample(NOISE, 2)
    ev = parse_log("\n".join(lines))
    (fig,) = ev.memory
    assert fig.kind == "bound" and fig.source == "pytorch_oom"
    assert fig.line_number == len(before) + 1
    assert fig.requested_gib == pytest.approx(want["requested"], abs=1e-12)
    assert fig.allocated_gib == pytest.approx(want["allocated"], abs=1e-12)
    assert fig.value_gib == pytest.approx(want["allocated"] + want["requested"], abs=1e-12)
    assert fig.reserved_unallocated_gib == pytest.approx(want["unallocated"], abs=1e-9)
    assert fig.capacity_gib == pytest.approx(want["capacity"], abs=1e-12)
    assert fig.free_gib == pytest.approx(want["free"], abs=1e-12)
    assert fig.device == want["device"]
    assert fig.process_gib == (pytest.approx(want["process"]) if "process" in want else None)
    assert fig.rank == (rank if kind else None)
    assert not ev.points and not ev.steps and ev.ooms


def test_the_issues_oom_message_is_allocated_plus_requested_with_its_fragmentation():
    text = (
        "[rank12]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 4 has a total "
        "capacity of 79.11 GiB of which 1.20 GiB is free. Including non-PyTorch memory, this process has 77.90 GiB "
        "memory in use. Of the allocated memory 74.12 GiB is allocated by PyTorch, and 2.05 GiB is reserved by "
        "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )
    (fig,) = parse_log(text).bounds
    assert (fig.value_gib, fig.reserved_unallocated_gib, fig.rank) == (pytest.approx(77.12), 2.05, 12)


def test_an_oom_without_sizes_is_a_failure_without_a_bound_unless_a_sized_one_is_there():
    cut = parse_log("[rank1]: RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously")
    (fig,) = cut.memory
    assert fig.source == "pytorch_oom_unsized" and fig.value_gib is None and cut.ooms and fig.rank == 1
    sized, _ = oom_message(random.Random(7))
    both = parse_log("RuntimeError: CUDA error: out of memory\n" + sized)
    assert [f.source for f in both.memory] == ["pytorch_oom"]


def megatron_report(rng: random.Random, rank: int, peak_mib: float) -> str:
    fmt = rng.choice(["{:.2f}", "{}"])  # current Megatron-LM prints .2f; older releases the raw float
    names = rng.choice([("reserved", "max reserved"), ("cached", "max cached")])
    values = [fmt.format(v) for v in (peak_mib * 0.7, peak_mib, peak_mib * 1.1, peak_mib * 1.2)]
    return (
        f"[Rank {rank}] (after {rng.randrange(1, 5)} iterations) memory (MB) | allocated: {values[0]} | "
        f"max allocated: {values[1]} | {names[0]}: {values[2]} | {names[1]}: {values[3]}"
    )


def bridge_report(rng: random.Random, rank: int, peak_bytes: int) -> tuple[str, float]:
    def gb(v: float) -> float:  # Bridge: bytes / 1e9 rounded to five significant digits
        g = v / 1e9
        return round(g, -math.floor(math.log10(abs(g))) + 4) if g else 0.0

    peak = gb(peak_bytes)
    text = (
        f"[Rank {rank}] (after 2 iterations) memory (GB) | mem-allocated-gigabytes: {gb(peak_bytes * 0.7)} | "
        f"mem-active-gigabytes: {gb(peak_bytes * 0.7)} | mem-inactive-gigabytes: 0.12345 | mem-reserved-gigabytes: "
        f"{gb(peak_bytes * 1.1)} | mem-max-allocated-gigabytes: {peak} | mem-max-active-gigabytes: {peak} | "
        f"mem-max-inactive-gigabytes: 1.2345 | mem-max-reserved-gigabytes: {gb(peak_bytes * 1.2)} | "
        "mem-alloc-retires: 0 | mem-allocated-count: 12345"
    )
    return text, peak * 1e9 / GiB


@pytest.mark.parametrize("seed", range(60))
def test_every_memory_report_reads_as_its_printed_max_allocated(seed):
    rng = random.Random(1000 + seed)
    lines, want = [], []
    for rank in sorted(rng.sample(range(64), rng.randrange(1, 6))):
        prefix = rng.choice(["", f"[default{rank % 8}]:", f"{rank}: "])
        if rng.random() < 0.5:
            peak_mib = rng.uniform(1000, 190_000)
            line = megatron_report(rng, rank, peak_mib)
            value = float(line.split("max allocated: ")[1].split(" ")[0]) / 1024
        else:
            line, value = bridge_report(rng, rank, int(rng.uniform(1e9, 200e9)))
        lines += [rng.choice(NOISE), prefix + line]
        want.append((rank, value, len(lines)))
    ev = parse_log("\n".join(lines))
    assert [(f.rank, f.line_number) for f in ev.points] == [(r, n) for r, _, n in want]
    for fig, (_, value, _) in zip(ev.points, want, strict=True):
        assert fig.kind == "point" and fig.value_gib == pytest.approx(value, rel=1e-12)
    assert not ev.bounds


# A user's print of the peak: (template, the number's format, GiB per printed unit, the rank when it names one).
PRINTS = [
    ("max_memory_allocated: {v}", "{:d}", 1 / GiB),
    ("rank {rank}: torch.cuda.max_memory_allocated() = {v} GiB", "{:.2f}", 1.0),
    ("[rank{rank}]: max memory allocated: {v} MiB", "{:.1f}", 1 / 1024),
    ("rank={rank} max_memory_allocated (GB): {v}", "{:.3f}", 1.0),
    ("Max memory allocated {v} GB", "{:.2f}", 1.0),
    ("peak: torch.cuda.max_memory_allocated()={v}", "{:d}", 1 / GiB),
]


@pytest.mark.parametrize("seed", range(36))
def test_prints_of_max_memory_allocated_read_in_their_unit(seed):
    rng = random.Random(5000 + seed)
    template, fmt, per_unit = PRINTS[seed % len(PRINTS)]
    peak, rank = int(rng.uniform(2**30, 190 * 2**30)), rng.randrange(128)
    value = peak if fmt == "{:d}" else peak * GiB / GiB**2 / per_unit
    printed = fmt.format(value)
    ev = parse_log("\n".join([rng.choice(NOISE), template.format(v=printed, rank=rank)]))
    (fig,) = ev.points
    assert fig.value_gib == pytest.approx(float(printed) * per_unit, rel=1e-12) and fig.source == "max_memory_allocated"
    assert fig.rank == (rank if "{rank}" in template else None)
    assert any("read as binary" in n for n in ev.notes) == ("GB" in template)


def test_a_bare_number_below_a_mebibyte_is_not_read_as_a_peak():
    ev = parse_log("max_memory_allocated: 74.12")
    assert ev.empty and "no unit" in ev.notes[0]


@pytest.mark.parametrize("seed", range(40))
def test_step_times_are_the_median_after_the_warm_up_line(seed):
    rng = random.Random(9000 + seed)
    n = rng.randrange(1, 12)
    seconds = [rng.uniform(0.2, 30.0) for _ in range(n)]
    lines = []
    for i, s in enumerate(seconds):
        if seed % 2:
            lines.append(
                f" [2026-03-30 10:01:{i:02d}] iteration {i + 1:8d}/{n:8d} | consumed samples: {8 * i:12d} | "
                f"elapsed time per iteration (ms): {s * 1000:.1f} | throughput per GPU (TFLOP/s/GPU): 412.3 |"
            )
        else:
            sep = rng.choice([": ", "=", '": '])
            lines.append(f"Training epoch 0, iteration {i}/{n} | lr: 1.9e-06 | train_step_timing in s{sep}{s:.3f}")
    ev = parse_log("\n".join(lines))
    # what each line printed: milliseconds to one decimal (Megatron), seconds to three (NeMo)
    printed = [round(s * 1000, 1) / 1000 if seed % 2 else round(s, 3) for s in seconds]
    got = [f.value_s for f in ev.steps]
    assert got == pytest.approx(printed)
    step, count = steady_step_s(ev.steps)
    steady = got[1:] if n > 1 else got
    assert step == pytest.approx(statistics.median(steady)) and count == len(steady)


def test_a_log_with_no_figure_is_bad_input_naming_what_is_accepted(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("\n".join(NOISE))
    with pytest.raises(InputError) as err:
        read_evidence(str(log))
    for words in ("nothing measured", "Tried to allocate", "max allocated", "elapsed time per iteration"):
        assert words in str(err.value)
    with pytest.raises(InputError, match="no such file"):
        read_evidence(str(tmp_path / "missing.log"))


def test_a_log_path_and_its_text_read_the_same(tmp_path):
    text, _ = oom_message(random.Random(3))
    log = tmp_path / "run.log"
    log.write_text("noise\n" + text + "\n")
    by_path, by_text = read_evidence(str(log)), read_evidence("noise\n" + text)
    assert by_path.memory[0].value_gib == by_text.memory[0].value_gib
    assert read_evidence(text).memory[0].line_number == 1  # one line holding a figure is the text, not a path


# ------------------------------------------------------------------------------------------- ranks → stages


def test_line_prefixes_name_the_rank_and_whether_it_is_global():
    assert rank_of("[rank12]: boom").rank == 12 and not rank_of("[rank12]: boom").local
    assert rank_of("[default3]:[Rank 19] (after 2 iterations) memory (MB)").rank == 19  # Megatron's global wins
    assert rank_of("[default3]: boom").local
    assert rank_of("7: [rank7]: boom").rank == 7
    assert rank_of("loss 3.2 at rank 3") is None and rank_of("loss at rank 3", inline=True).rank == 3


@pytest.fixture(scope="module")
def rank_generator():
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    return parallel_state.RankGenerator


@pytest.mark.parametrize("seed", range(40))
def test_rank_to_stage_is_megatron_cores_rank_order(seed, rank_generator):
    rng = random.Random(seed)
    tp, cp, dp, pp = (rng.choice([1, 2, 4, 8]) for _ in range(4))
    order = rng.choice([DEFAULT_ORDER, TP_PP_DP_ORDER])
    world = tp * cp * dp * pp
    groups = rank_generator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order).get_ranks("pp")
    upstream = {rank: stage for group in groups for stage, rank in enumerate(group)}
    ours = RankLayout(world, tp, cp, pp, order)
    assert {rank: ours.stage_of_rank(rank) for rank in range(world)} == upstream


def test_a_local_rank_places_a_stage_only_on_one_node():
    one_node = RankLayout(8, 2, 1, 4)
    assert one_node.stage(rank_of("[default5]: x"))[0] == 2
    two_nodes = RankLayout(16, 2, 1, 4)
    stage, why = two_nodes.stage(rank_of("[default5]: x"))
    assert stage is None and "unknown node" in why
    assert two_nodes.stage(rank_of("[rank13]: x"))[0] == 3
    assert two_nodes.stage(rank_of("[rank99]: x"))[0] is None
