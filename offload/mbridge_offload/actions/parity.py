"""The ``parity`` suite: train a tiny GPT with a config's offload settings and without, and compare.

It answers the upstream skill's success criterion — "loss matches the non-offloaded baseline (max delta <
0.001)" — before any cluster time is spent. Two identical tiny models (same seed, same batches) train for a few
dozen steps: the baseline with plain AdamW and no activation offload; the offload run with
``HybridDeviceOptimizer`` at the config's ``optimizer_offload_fraction`` and, when the config turns it on,
layer-level activation offload of a proportional number of layers. Reported: the max loss delta, the achieved
optimizer split, the activation bytes offloaded per step, and the step-time ratio.

The model is megatron-core's real ``GPTModel`` (``runtime.megatron.build_tiny_gpt``, our runtime installed in its
``TransformerBlock``) when megatron-core imports here; otherwise a small pre-norm MLP stack driven through
``get_cpu_offload_context`` the way ``TransformerBlock`` drives it. CPU by default, the GPU when present.

Run: ``python -m mbridge_offload.actions.parity [--config FILE] [--steps N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

LOSS_BAR = 1e-3  # upstream's bar (skill "Success criteria")
TINY_LAYERS = 4
MIN_TENSOR_SIZE = 1024  # tiny activations are far below TE's 256 Ki threshold; offload them anyway

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
            "both runs are identical"
        )
    return Settings(float(fraction), bool(opt.overlap_cpu_optimizer_d2h_h2d), layers, "config", notes)


# ---------------------------------------------------------------------------------------------- models


class _TorchTinyLM:
    """Fallback model: embedding → pre-norm MLP blocks → vocab projection, with TE-style offload driving."""

    def __init__(self, layers: int, hidden: int, vocab: int, offload_layers: int, seed: int, device: Any) -> None:
        import torch

        from mbridge_offload.runtime.activation import get_cpu_offload_context

        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, hidden).to(device)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(hidden),
                torch.nn.Linear(hidden, 4 * hidden),
                torch.nn.GELU(),
                torch.nn.Linear(4 * hidden, hidden),
            )
            for _ in range(layers)
        ).to(device)
        self.head = torch.nn.Linear(hidden, vocab).to(device)
        self.context, self.sync = get_cpu_offload_context(
            offload_layers > 0, offload_layers, layers, min_tensor_size=MIN_TENSOR_SIZE
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
        from mbridge_offload.runtime.megatron import build_tiny_gpt

        self.model = build_tiny_gpt(
            num_layers=TINY_LAYERS,
            hidden=64,
            heads=4,
            vocab=128,
            seq=32,
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


# ---------------------------------------------------------------------------------------------- the run


def _train(
    make_model: Callable[[], Any],
    make_opt: Callable[[list[Any]], Any],
    batches: list[dict[str, Any]],
    progress: Callable[[str], None],
) -> dict[str, Any]:
    model = make_model()
    opt = make_opt(model.parameters())
    losses, times, offloaded = [], [], []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        loss = model.loss(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
        stats = model.stats
        offloaded.append(int(stats.bytes_offloaded) if stats is not None else 0)
        progress(f"step {i + 1}/{len(batches)} loss {losses[-1]:.5f}")
    return {"losses": losses, "times": times, "bytes_offloaded": offloaded, "optimizer": opt}


def _batches(megatron: bool, steps: int, seed: int, device: Any) -> tuple[list[dict[str, Any]], Callable[[], Any]]:
    """The same token batches for both runs, and the context the model needs on this machine."""
    import contextlib

    import torch

    if megatron:
        from mbridge_offload.runtime.megatron import cpu_compat_shims, tiny_batch

        batches = [{k: v.to(device) for k, v in tiny_batch(2, 32, 128, seed=seed + i).items()} for i in range(steps)]
        return batches, cpu_compat_shims
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(0, 128, (2, 33), generator=generator)
        batches.append({"input_ids": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device)})
    return batches, contextlib.nullcontext


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


def _checks(settings: Settings, max_delta: float, steps: int, opt: Any, baseline_opt: Any, act_bytes: int) -> list:
    """The pass/fail checks of a parity run: loss parity, the optimizer split achieved, activations offloaded."""
    achieved = float(opt.offloaded_fraction)
    numels = [p.numel() for group in baseline_opt.param_groups for p in group["params"]]
    largest_share = max(numels) / sum(numels) if numels else 0.0
    checks = [
        {
            "name": "loss_delta",
            "ok": max_delta < LOSS_BAR,
            "detail": f"max |loss(offload) − loss(baseline)| = {max_delta:.2e} over {steps} steps (bar {LOSS_BAR:g})",
        },
        {
            "name": "optimizer_split",
            "ok": abs(achieved - settings.optimizer_fraction) <= largest_share + 1e-9,
            "detail": f"requested {settings.optimizer_fraction:g}, achieved {achieved:.4f} (whole tensors: within "
            f"{largest_share:.3f})",
        },
    ]
    if settings.activation_layers:
        checks.append(
            {
                "name": "activation_offloaded",
                "ok": act_bytes > 0,
                "detail": f"{act_bytes} bytes offloaded per step from {settings.activation_layers} layers",
            }
        )
    return checks


def run_parity(
    config: Any | None = None,
    steps: int = 30,
    seed: int = 1234,
    use_megatron: bool | None = None,
    on_progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Train with and without the config's offload settings and compare.

    Args:
        config: an ``OffloadConfig`` (or None for the default settings).
        steps: optimizer steps per run.
        seed: weights and data seed (both runs share it).
        use_megatron: force (True) or forbid (False) megatron-core's GPTModel; None = use it when it imports.
        on_progress: ``fn(done, total, message)`` after each step of either run.

    Returns:
        A dict with ``ok``, ``checks`` (name, ok, detail), ``max_loss_delta``, ``optimizer_split``,
        ``activation_bytes_offloaded_per_step``, ``step_time_ratio``, ``model``, ``device`` and the ``settings``.

    Raises:
        ValueError: ``steps`` below 2.
    """
    import torch

    from mbridge_offload.runtime.optimizer.hybrid import HybridDeviceOptimizer

    if steps < 2:
        raise ValueError(f"steps is {steps}: parity needs at least 2 steps")
    settings = settings_from_config(config)
    megatron, model_name = _choose_model(use_megatron)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches, shim = _batches(megatron, steps, seed, device)
    done = [0]

    def progress(message: str) -> None:
        done[0] += 1
        if on_progress:
            on_progress(done[0], 2 * steps, message)

    def make(offload_layers: int) -> Callable[[], Any]:
        if megatron:
            return lambda: _MegatronTinyGPT(offload_layers, seed, device)
        return lambda: _TorchTinyLM(TINY_LAYERS, 64, 128, offload_layers, seed, device)

    hyper: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}
    with shim():
        baseline = _train(make(0), lambda ps: torch.optim.AdamW(ps, **hyper), batches, progress)
        offload = _train(
            make(settings.activation_layers),
            lambda ps: HybridDeviceOptimizer(
                ps,
                offload_fraction=settings.optimizer_fraction,
                overlap_cpu_optimizer_d2h_h2d=settings.overlap,
                **hyper,
            ),
            batches,
            progress,
        )
    return _report(settings, baseline, offload, steps, model_name, str(device))


def _report(
    settings: Settings, baseline: dict[str, Any], offload: dict[str, Any], steps: int, model: str, device: str
) -> dict[str, Any]:
    """The parity result: checks, loss delta, split achieved, activation bytes per step, step-time ratio."""
    max_delta = max(abs(a - b) for a, b in zip(baseline["losses"], offload["losses"], strict=True))
    per_step = offload["bytes_offloaded"][1:] or offload["bytes_offloaded"]
    act_bytes = int(sum(per_step) / len(per_step))
    checks = _checks(settings, max_delta, steps, offload["optimizer"], baseline["optimizer"], act_bytes)
    # Medians: the first steps of whichever run goes first pay one-off warm-up costs.
    ratio = statistics.median(offload["times"]) / max(statistics.median(baseline["times"]), 1e-12)
    return {
        "ok": all(c["ok"] for c in checks),
        "checks": checks,
        "max_loss_delta": max_delta,
        "loss_bar": LOSS_BAR,
        "optimizer_split": {
            "requested": settings.optimizer_fraction,
            "achieved": round(float(offload["optimizer"].offloaded_fraction), 6),
        },
        "activation_bytes_offloaded_per_step": act_bytes,
        "step_time_ratio": round(ratio, 3),
        "steps": steps,
        "model": model,
        "device": device,
        "settings": settings.to_dict(),
        "losses": {"baseline": baseline["losses"], "offload": offload["losses"]},
    }


# ---------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mbridge_offload.actions.parity", description=__doc__.splitlines()[0]
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
            from mbridge_offload.actions.testsuite import MARK

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
