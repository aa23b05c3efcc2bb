"""The ``parity`` suite: train a tiny GPT on a task it can learn, with a config's offload settings and without.

It answers the upstream skill's success criterion (loss within 0.001 of the non-offloaded baseline) and counts
the answer only when the model really learns: a flat loss is the same under any optimizer, a broken one included.
The task: ``start, start + s, start + 2s, ... (mod vocab)`` with a random stride in {1, 2, 3}, so the loss falls
from ln(vocab) within a few dozen AdamW steps. Runs: ``baseline`` (AdamW), ``optimizer_offload``
(HybridDeviceOptimizer), ``activation_offload`` (layer-level, when the config offloads layers) and ``offload``
(both). ``ok`` when every loss fell by :data:`MIN_RELATIVE_DROP`, every delta is below :data:`LOSS_BAR`, the
optimizer split is achieved and bytes really left the layers. No timing: on a CPU it says nothing about a GPU.

Run: ``python -m mbridge_offload.actions.testing.parity [--config FILE] [--steps N] [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

LOSS_BAR = 1e-3  # upstream's bar (skill "Success criteria")
MIN_RELATIVE_DROP = 1 / 3  # the loss must fall by a third or more, else the comparison proves nothing
END_WINDOW = 3  # the end loss is the mean of the last steps: single steps of this task are noisy
TINY_LAYERS = 4
MIN_TENSOR_SIZE = 1024  # tiny activations are far below TE's 256 Ki threshold; offload them anyway
# The task and the tiny model: small enough for seconds on 2 CPU cores, large enough to learn the strides.
VOCAB, SEQ_LENGTH, BATCH_SIZE, HIDDEN, HEADS = 32, 16, 8, 32, 4
STRIDES = (1, 2, 3)
HYPER: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}

ProgressFn = Callable[[int, int, str], None]


@dataclass
class Settings:
    """The offload settings under test, derived from a config (or defaults when it offloads nothing)."""

    optimizer_fraction: float
    overlap: bool
    activation_layers: int
    source: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "optimizer_offload_fraction": self.optimizer_fraction,
            "overlap_cpu_optimizer_d2h_h2d": self.overlap,
            "activation_offload_layers": self.activation_layers,
            "tiny_model_layers": TINY_LAYERS,
            "source": self.source,
            "notes": self.notes,
        }


def settings_from_config(config: Any | None) -> Settings:
    """Map a config's offload keys onto the tiny model (layer counts scale with ``num_layers``)."""
    if config is None:
        return Settings(0.5, True, 2, "default", ["no config: optimizer fraction 0.5 and 2 of 4 layers offloaded"])
    opt, model = config.optimizer, config.model
    notes: list[str] = []
    fraction = opt.optimizer_offload_fraction if opt.optimizer_cpu_offload else 0.0
    layers = 0
    if model.cpu_offloading and model.cpu_offloading_num_layers > 0:
        total = model.num_layers or TINY_LAYERS
        layers = max(1, min(TINY_LAYERS - 1, round(model.cpu_offloading_num_layers / total * TINY_LAYERS)))
        notes.append(f"{model.cpu_offloading_num_layers} of {total} layers → {layers} of {TINY_LAYERS} here")
    if fraction == 0.0 and layers == 0:
        notes.append(
            "the config offloads nothing (optimizer_cpu_offload off or fraction 0.0, cpu_offloading off): "
            "the runs differ only in the optimizer class"
        )
    return Settings(float(fraction), bool(opt.overlap_cpu_optimizer_d2h_h2d), layers, "config", notes)


# ---------------------------------------------------------------------------------------------- the task


def stride_batches(steps: int, seed: int, device: Any) -> list[dict[str, Any]]:
    """One batch per step of the stride task: ``GPTModel.forward`` keyword arguments (the fallback reads two).

    Each sequence is ``(start + s * i) mod vocab`` for i = 0..seq; inputs are the first ``seq`` tokens, labels
    the next ones. Deterministic in ``seed``, so every run trains on the same tokens.
    """
    import torch

    vocab, seq, batch = VOCAB, SEQ_LENGTH, BATCH_SIZE
    strides = torch.tensor(STRIDES)
    generator = torch.Generator().manual_seed(seed)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)  # True = hidden
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=generator)
        stride = strides[torch.randint(0, len(strides), (batch, 1), generator=generator)]
        tokens = (start + stride * torch.arange(seq + 1)) % vocab
        fields = {"input_ids": tokens[:, :-1], "position_ids": positions, "attention_mask": mask}
        out.append({k: v.to(device) for k, v in {**fields, "labels": tokens[:, 1:]}.items()})
    return out


# ---------------------------------------------------------------------------------------------- models


class _TorchTinyLM:
    """Fallback model: embedding → pre-norm MLP blocks → vocab projection, with TE-style offload driving."""

    def __init__(self, offload_layers: int, seed: int, device: Any) -> None:
        import torch

        from mbridge_offload_runtime.activation.context import get_cpu_offload_context

        hidden, vocab = HIDDEN, VOCAB
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, hidden).to(device)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(hidden),
                torch.nn.Linear(hidden, 4 * hidden),
                torch.nn.GELU(),
                torch.nn.Linear(4 * hidden, hidden),
            )
            for _ in range(TINY_LAYERS)
        ).to(device)
        self.head = torch.nn.Linear(hidden, vocab).to(device)
        self.context, self.sync = get_cpu_offload_context(
            offload_layers > 0, offload_layers, TINY_LAYERS, min_tensor_size=MIN_TENSOR_SIZE
        )

    def parameters(self) -> list[Any]:
        return [*self.embed.parameters(), *self.blocks.parameters(), *self.head.parameters()]

    def loss(self, batch: dict[str, Any]) -> Any:
        import torch

        x = self.embed(batch["input_ids"])
        for block in self.blocks:
            with self.context:
                x = x + block(x)
            x = self.sync(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    @property
    def stats(self) -> Any:
        return getattr(self.context, "stats", None)


class _MegatronTinyGPT:
    def __init__(self, offload_layers: int, seed: int, device: Any) -> None:
        from mbridge_offload_runtime.megatron import build_tiny_gpt

        self.model = build_tiny_gpt(
            num_layers=TINY_LAYERS,
            hidden=HIDDEN,
            heads=HEADS,
            vocab=VOCAB,
            seq=SEQ_LENGTH,
            cpu_offloading=offload_layers > 0,
            cpu_offloading_num_layers=offload_layers,
            min_tensor_size=MIN_TENSOR_SIZE,
            seed=seed,
        ).to(device)  # built on the CPU (use_cpu_initialization); train where the offload has somewhere to go

    def parameters(self) -> list[Any]:
        return list(self.model.parameters())

    def loss(self, batch: dict[str, Any]) -> Any:
        return self.model(**batch).float().mean()  # GPTModel returns the per-token loss when labels are given

    @property
    def stats(self) -> Any:
        context = getattr(self.model.decoder, "offload_context", None)
        return getattr(context, "stats", None)


def _megatron_available() -> tuple[bool, str]:
    try:
        import megatron.core  # noqa: F401
        from megatron.core.models.gpt import GPTModel  # noqa: F401
    except Exception as exc:  # ImportError, or a broken optional dependency
        return False, f"{exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return True, ""


def _choose_model(use_megatron: bool | None) -> tuple[bool, str]:
    """Whether to train megatron-core's GPTModel, and the model's name for the report."""
    available, why_not = _megatron_available() if use_megatron is not False else (False, "not requested")
    megatron = available if use_megatron is None else use_megatron
    if megatron and not available:
        raise ValueError(f"megatron-core is not importable here ({why_not})")
    if megatron:
        return True, "megatron-core GPTModel (tiny)"
    suffix = "" if use_megatron is False else f" (megatron-core not importable: {why_not})"
    return False, "torch MLP stack" + suffix


# ---------------------------------------------------------------------------------------------- the runs


def _train(
    make_model: Callable[[], Any],
    make_opt: Callable[[list[Any]], Any],
    batches: list[dict[str, Any]],
    progress: Callable[[str], None],
) -> dict[str, Any]:
    model = make_model()
    opt = make_opt(model.parameters())
    losses, offloaded = [], []
    for i, batch in enumerate(batches):
        loss = model.loss(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        stats = model.stats
        offloaded.append(int(stats.bytes_offloaded) if stats is not None else 0)
        progress(f"step {i + 1}/{len(batches)} loss {losses[-1]:.5f}")
    return {"losses": losses, "bytes_offloaded": offloaded, "optimizer": opt}


def _plan_runs(settings: Settings) -> list[tuple[str, bool, int]]:
    """(name, hybrid optimizer?, offloaded layers) of each run; the baseline first."""
    runs = [("baseline", False, 0), ("optimizer_offload", True, 0)]
    if settings.activation_layers:
        runs += [
            ("activation_offload", False, settings.activation_layers),
            ("offload", True, settings.activation_layers),
        ]
    return runs


def run_parity(
    config: Any | None = None,
    steps: int = 30,
    seed: int = 1234,
    use_megatron: bool | None = None,
    on_progress: ProgressFn | None = None,
    *,
    offload_optimizer_cls: type | None = None,
) -> dict[str, Any]:
    """Train with and without the config's offload settings on a learnable task, and compare.

    ``offload_optimizer_cls`` lets tests pass a broken optimizer to show the check fails; ``use_megatron`` None uses
    megatron-core's GPTModel when it imports. Raises ValueError for ``steps`` below 2.
    """
    import torch

    from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer

    if steps < 2:
        raise ValueError(f"steps is {steps}: parity needs at least 2 steps")
    settings = settings_from_config(config)
    megatron, model_name = _choose_model(use_megatron)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = stride_batches(steps, seed, device)
    plan = _plan_runs(settings)
    hybrid = offload_optimizer_cls or HybridDeviceOptimizer
    done = [0]

    def progress(message: str) -> None:
        done[0] += 1
        if on_progress:
            on_progress(done[0], len(plan) * steps, message)

    def make_model(layers: int) -> Callable[[], Any]:
        return lambda: (_MegatronTinyGPT if megatron else _TorchTinyLM)(layers, seed, device)

    def make_opt(offload: bool) -> Callable[[list[Any]], Any]:
        if not offload:
            return lambda ps: torch.optim.AdamW(ps, **HYPER)
        fraction, overlap = settings.optimizer_fraction, settings.overlap
        return lambda ps: hybrid(ps, offload_fraction=fraction, overlap_cpu_optimizer_d2h_h2d=overlap, **HYPER)

    with _shims(megatron)(), _one_cpu_thread(device):
        runs = {name: _train(make_model(layers), make_opt(opt), batches, progress) for name, opt, layers in plan}
    runs.setdefault("offload", runs["optimizer_offload"])
    report = _report(settings, runs, steps, model_name, str(device))
    # Whose optimizer and which megatron-core ran: the answer names the code under test (actions/testing/subject.py).
    report["optimizer"] = {"class": hybrid.__name__, "module": hybrid.__module__}
    report["megatron_core"] = _megatron_core_version() if megatron else None
    return report


def _megatron_core_version() -> str | None:
    try:
        from megatron.core import package_info
    except ImportError:
        return None
    return str(package_info.__version__)


@contextlib.contextmanager
def _one_cpu_thread(device: Any) -> Iterator[None]:
    """On the CPU, train with one intra-op thread (restored afterwards).

    Why: the tensors are tiny, so threads only add hand-offs, and on a shared machine OpenMP workers spin against
    other processes: measured on 2 cores under load, 20 steps of the tiny GPT took 99 s with 2 threads, 9 s with 1.
    Every run of one check trains under the same setting, so the comparison is unaffected.
    """
    import torch

    if device.type != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _shims(megatron: bool) -> Callable[[], Any]:
    """The context the model needs on this machine: megatron-core's two labelled CPU shims, or nothing."""
    if megatron:
        from mbridge_offload_runtime.megatron import cpu_compat_shims

        return cpu_compat_shims
    return contextlib.nullcontext


# ---------------------------------------------------------------------------------------------- the verdict


def loss_fall(losses: list[float]) -> dict[str, float]:
    """Start loss (the untrained model's), end loss (mean of the last :data:`END_WINDOW` steps), relative drop."""
    start = losses[0]
    tail = losses[-min(END_WINDOW, len(losses) - 1) :]
    end = sum(tail) / len(tail)
    return {"start": start, "end": end, "relative_drop": (start - end) / start if start > 0 else 0.0}


def _delta(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _delta_check(name: str, run: str, delta: float, steps: int) -> dict[str, Any]:
    return {
        "name": name,
        "ok": delta < LOSS_BAR,
        "detail": f"max |loss({run}) − loss(baseline)| = {delta:.2e} over {steps} steps (bar {LOSS_BAR:g})",
    }


def _checks(settings: Settings, runs: dict[str, Any], falls: dict[str, Any], deltas: dict[str, float]) -> list:
    """The pass/fail checks: the loss fell, loss parity per comparison, the split achieved, activations offloaded."""
    steps = len(runs["baseline"]["losses"])
    flat = sorted(name for name, fall in falls.items() if fall["relative_drop"] < MIN_RELATIVE_DROP)
    falls_text = ", ".join(
        f"{name} {f['start']:.3f} → {f['end']:.3f} ({100 * f['relative_drop']:.0f}%)" for name, f in falls.items()
    )
    checks = [
        {
            "name": "loss_fell",
            "ok": not flat,
            "detail": f"loss start → end (drop) over {steps} steps: {falls_text}; required drop "
            f"{100 * MIN_RELATIVE_DROP:.0f}%"
            + (
                f"; too flat: {', '.join(flat)} (a flat loss cannot tell a broken optimizer; raise --steps)"
                if flat
                else ""
            ),
        },
        _delta_check("loss_delta", "offload", deltas["offload"], steps),
        _delta_check("optimizer_loss_delta", "optimizer_offload", deltas["optimizer_offload"], steps),
    ]
    if "activation_offload" in deltas:
        checks.append(_delta_check("activation_loss_delta", "activation_offload", deltas["activation_offload"], steps))
    opt, baseline_opt = runs["offload"]["optimizer"], runs["baseline"]["optimizer"]
    achieved = float(opt.offloaded_fraction)
    numels = [p.numel() for group in baseline_opt.param_groups for p in group["params"]]
    largest_share = max(numels) / sum(numels) if numels else 0.0
    checks.append(
        {
            "name": "optimizer_split",
            "ok": abs(achieved - settings.optimizer_fraction) <= largest_share + 1e-9,
            "detail": f"requested {settings.optimizer_fraction:g}, achieved {achieved:.4f} (whole tensors: within "
            f"{largest_share:.3f})",
        }
    )
    if settings.activation_layers:
        act_bytes = _bytes_per_step(runs["offload"])
        checks.append(
            {
                "name": "activation_offloaded",
                "ok": act_bytes > 0,
                "detail": f"{act_bytes} bytes offloaded per step from {settings.activation_layers} layers",
            }
        )
    return checks


def _bytes_per_step(run: dict[str, Any]) -> int:
    per_step = run["bytes_offloaded"][1:] or run["bytes_offloaded"]
    return int(sum(per_step) / len(per_step))


def _report(settings: Settings, runs: dict[str, Any], steps: int, model: str, device: str) -> dict[str, Any]:
    """The parity result: verdict and checks, both loss curves of each comparison, the fall of each run."""
    base = runs["baseline"]["losses"]
    deltas = {name: _delta(run["losses"], base) for name, run in runs.items() if name != "baseline"}
    falls = {name: loss_fall(run["losses"]) for name, run in runs.items()}
    checks = _checks(settings, runs, falls, deltas)
    return {
        "ok": all(c["ok"] for c in checks),
        "checks": checks,
        "max_loss_delta": max(deltas.values()),
        "loss_bar": LOSS_BAR,
        "loss_deltas": deltas,
        "loss_fall": falls,
        "min_relative_drop": MIN_RELATIVE_DROP,
        "optimizer_split": {
            "requested": settings.optimizer_fraction,
            "achieved": round(float(runs["offload"]["optimizer"].offloaded_fraction), 6),
        },
        "activation_bytes_offloaded_per_step": _bytes_per_step(runs["offload"]),
        "steps": steps,
        "task": {
            "vocab": VOCAB,
            "seq_length": SEQ_LENGTH,
            "batch_size": BATCH_SIZE,
            "strides": list(STRIDES),
            "layers": TINY_LAYERS,
            "hidden": HIDDEN,
            "heads": HEADS,
            "lr": HYPER["lr"],
            "what": "sequences (start + s*i) mod vocab, random start and stride s per sequence; next-token loss",
        },
        "model": model,
        "device": device,
        "settings": settings.to_dict(),
        "losses": {name: run["losses"] for name, run in runs.items()},
    }


# ---------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mbridge_offload.actions.testing.parity", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--config", help="config whose offload settings to train (path or YAML text)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--torch-model", action="store_true", help="use the torch fallback model")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--progress", action="store_true", help="emit machine-readable progress lines")
    args = parser.parse_args(argv)

    from mbridge_offload.config.sources import ConfigError, load

    def progress(done: int, total: int, message: str) -> None:
        if args.progress:
            from mbridge_offload.actions.testing.run import MARK

            sys.stdout.write(
                "\n" + MARK + json.dumps({"event": "progress", "done": done, "total": total, "message": message}) + "\n"
            )
            sys.stdout.flush()

    try:
        config = load(args.config).config if args.config else None
        result = run_parity(
            config,
            steps=args.steps,
            seed=args.seed,
            use_megatron=False if args.torch_model else None,
            on_progress=progress,
        )
    except (ConfigError, ValueError) as exc:
        result = {"ok": False, "checks": [], "error": str(exc)}
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        for check in result.get("checks", []):
            sys.stdout.write(f"{'ok  ' if check['ok'] else 'FAIL'} {check['name']}: {check['detail']}\n")
        if result.get("error"):
            sys.stdout.write(f"error: {result['error']}\n")
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
