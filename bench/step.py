"""Per-step benchmark: our Trainer's step loop against a bare PyTorch loop on the same model and batches.

    python bench/step.py [--data DIR] [--rounds 5] [--scale 1] [--threads 1] [--json PATH]

Both loops train the same model (the digits CNN, a small MLP, then the digits CNN built from an import
path as a user's model is: the ``imported/built-in`` ratio of our loop should be 1 within noise) from the
same seed, on the batches of the same StagedLoader, with the same AdamW, warmup-cosine schedule, gradient
clipping and deterministic-algorithm setting, in this one process:
  bare   forward, cross-entropy, backward, clip, optimizer step, zero_grad, schedule step; nothing else
  ours   Trainer.train() with the digits preset's telemetry (metrics.jsonl, TensorBoard, a log line every 20
         steps), finite check, profiler hook, checkpoint rule and GC schedule; no validation during the run
A step's cost is the difference between a long and a short run of the same loop, divided by the extra steps:
what both runs share (set-up, the final validation and checkpoint) cancels. It is reported as process CPU
time (``cpu_ms``: the ratio, barely moved by other load on the machine; it includes our background threads)
and as wall time (``wall_ms``). Rows alternate bare/ours ``--rounds`` times after one untimed warm-up run
each. The ratio is the median over rounds of each round's ours/bare (the two ran back to back, so a slow
spell of this shared machine, which moves single runs by 10% and more, weighs on both); it is printed next
to the target (<= 1.05), not asserted.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout

from bench.tables import digits_and_scratch, write_results  # noqa: E402
from traincore.config.presets import preset  # noqa: E402
from traincore.config.schema import Config  # noqa: E402
from traincore.data.loader import StagedLoader, StagedSplit  # noqa: E402
from traincore.model.build import SmallCNN, build_model  # noqa: E402
from traincore.run.schedule import lr_factor  # noqa: E402
from traincore.run.steps import endless, seed_everything  # noqa: E402
from traincore.run.trainer import Trainer  # noqa: E402

TARGET_RATIO = 1.05
# small_cnn_imported: the same CNN from a factory, built as a user's model is ("<module>:<callable>").
MODELS = {"small_cnn": {"name": "small_cnn", "width": 32}, "mlp": {"name": "mlp", "width": 128},
          "small_cnn_imported": {"name": "bench.step:digits_cnn"}}
# (short run, extra steps of the long run): a few seconds per run on one CPU core.
STEPS = {"small_cnn": (20, 100), "mlp": (100, 1500), "small_cnn_imported": (20, 100)}
IMPORTED = ("small_cnn_imported", "small_cnn")  # ours on the imported model over ours on the built-in one


def digits_cnn(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    """The built-in small_cnn (width 32), built as an imported model factory is called."""
    return SmallCNN(in_channels, num_classes, width=32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="staged digits directory (default: stage it into a temporary one)")
    parser.add_argument("--rounds", type=int, default=5, help="bare/ours pairs per model")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the extra steps per model")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", help="also write the rows and ratios to this file")
    args = parser.parse_args(argv)
    for name in ("rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be >= 1")
    if args.scale <= 0:
        parser.error(f"--scale={args.scale} must be > 0")
    return args


def bench_config(model: str, steps: int) -> Config:
    """The digits preset with ``model`` for ``steps`` steps, no validation before the end, no progress bar."""
    return preset("digits").with_overrides({
        "model": MODELS[model], "train": {"max_steps": steps, "epochs": 0, "eval_every": 0},
        "checkpoint": {"every": 0, "resume": "none"}, "telemetry": {"progress": "off"}})


def bare(cfg: Config, data: Path, output: Path) -> None:
    """A plain PyTorch loop of ``cfg.train.max_steps`` steps over our loader's batches."""
    split = StagedSplit(data, "train")
    loader = StagedLoader(split, cfg.loader, rank=0, world_size=1, seed=cfg.train.seed,
                          device=torch.device("cpu"))
    seed_everything(cfg.train.seed)
    model = build_model(cfg.model, split.manifest.num_classes, split.manifest.shape)
    optim = cfg.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2),
                                  weight_decay=optim.weight_decay, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, cfg.train.max_steps))
    batches = endless(loader)
    model.train()
    for _ in range(cfg.train.max_steps):
        images, labels = next(batches)
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        if optim.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()


def ours(cfg: Config, data: Path, output: Path) -> None:
    """Trainer.train() of ``cfg`` into ``output``."""
    Trainer(cfg, data, output).train()


LOOPS: dict[str, Callable[[Config, Path, Path], None]] = {"bare": bare, "ours": ours}


def per_step(loop: str, model: str, data: Path, workdir: Path, short: int, extra: int) -> tuple[float, float]:
    """(CPU, wall) seconds per step of ``loop``: a run of ``short + extra`` steps minus one of ``short``."""
    spent = []
    for steps in (short, short + extra):
        output = workdir / f"{model}-{loop}-{time.monotonic_ns()}"
        cpu, wall = time.process_time(), time.perf_counter()
        LOOPS[loop](bench_config(model, steps), data, output)
        spent.append((time.process_time() - cpu, time.perf_counter() - wall))
    return (spent[1][0] - spent[0][0]) / extra, (spent[1][1] - spent[0][1]) / extra


def measure(data: Path, workdir: Path, rounds: int, scale: float, threads: int) -> list[dict]:
    """Rows of per-step CPU and wall milliseconds, bare and ours alternating, per model and round."""
    rows = []
    for model, (short, extra) in STEPS.items():
        extra = max(1, round(extra * scale))
        # Both loops run under the run's deterministic-algorithm setting, which is process-wide.
        torch.use_deterministic_algorithms(bench_config(model, short).train.deterministic, warn_only=True)
        for loop in LOOPS:  # untimed: first-use costs (imports, allocator growth) stay out of the rows
            LOOPS[loop](bench_config(model, short), data, workdir / f"{model}-{loop}-warmup")
        for round_ in range(rounds):
            for loop in LOOPS:
                cpu, wall = per_step(loop, model, data, workdir, short, extra)
                rows.append({"model": model, "loop": loop, "round": round_, "steps": extra,
                             "batch_size": preset("digits").loader.batch_size, "threads": threads,
                             "cpu_ms": round(1e3 * cpu, 4), "wall_ms": round(1e3 * wall, 4)})
    return rows


def paired_ratios(rows: list[dict], model: str) -> list[float]:
    """ours/bare CPU time per round of ``model``: each pair ran back to back, so a slower spell of the
    machine weighs on both sides of a ratio instead of on one loop's best."""
    by_round = {(r["round"], r["loop"]): r["cpu_ms"] for r in rows if r["model"] == model}
    rounds = sorted({round_ for round_, _ in by_round})
    return [by_round[round_, "ours"] / by_round[round_, "bare"] for round_ in rounds]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.disable(logging.INFO)  # the Trainer's per-interval lines would drown the table
    with digits_and_scratch(args.data, "bench-step-") as (data, tmp):
        rows = measure(data, tmp, args.rounds, args.scale, args.threads)
    median = {(model, loop, unit): statistics.median(r[unit] for r in rows if (r["model"], r["loop"]) ==
                                                     (model, loop))
              for model in STEPS for loop in LOOPS for unit in ("cpu_ms", "wall_ms")}
    ratios = {model: round(statistics.median(paired_ratios(rows, model)), 4) for model in STEPS}
    imported, builtin = IMPORTED
    ours_cpu = {model: median[model, "ours", "cpu_ms"] for model in IMPORTED}
    ratios["imported/built-in"] = round(ours_cpu[imported] / ours_cpu[builtin], 4)
    print(f"{'model':<20}{'bare cpu ms':>12}{'ours cpu ms':>12}{'ours/bare':>10}{'bare wall ms':>14}"
          f"{'ours wall ms':>14}  (medians over {args.rounds} rounds; target <= {TARGET_RATIO})")
    for model in STEPS:
        cpu = "".join(f"{median[model, loop, 'cpu_ms']:>12.3f}" for loop in LOOPS)
        wall = "".join(f"{median[model, loop, 'wall_ms']:>14.3f}" for loop in LOOPS)
        print(f"{model:<20}{cpu}{ratios[model]:>10.3f}{wall}")
    print(f"our step on the imported small_cnn over the built-in one: {ratios['imported/built-in']:.3f} "
          "(CPU ms, medians; target: equal within noise)")
    write_results(args.json, "step", rows, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
