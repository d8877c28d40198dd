"""End-to-end benchmark: a naive training loop vs `torchrun -m traincore.train` vs `pyflyte run`.

    python bench/end_to_end.py [--dir runs/bench] [--steps 200] [--batch-size 32] [--nproc 2]
        [--checkpoint-every 50] [--models vit_tiny small_cnn] [--json PATH] [--tiny]

The same images (PNG ImageFolder trees generated once under --dir: synthetic 64x64 RGB images for
vit_tiny, scikit-learn's 8x8 digits for small_cnn; both trained at 32x32), the same model, steps, global
batch, checkpoint interval and world size run through:
  naive     torchrun bench/naive_loop.py: ImageFolder + PIL + transforms per sample, DataLoader defaults,
            DDP, rank-0 torch.save every --checkpoint-every steps, SummaryWriter defaults
  torchrun  torchrun -m traincore.train on the staged tree (staged before timing)
  pyflyte   pyflyte run workflows/pipeline.py training_pipeline (the staging task is a cache hit: run once
            before timing); the command also exports and evaluates the model
Timed: each command from its start. "to N steps" ends at rank 0's timestamp of step N, "first step" at
that of step 1 (our runs: the start-up record in metrics.jsonl), "command" when the command exits; the
"timed" column of each row says what its command does in that time. Not timed: generating the images and
staging (pyflyte: its cache hit is timed, the staging itself is not, except with --tiny). samples/s is the
steady rate after the first logging interval; data-wait is the share of the loop spent waiting for
batches; stall is the time one checkpoint save blocks rank 0; peak RSS sums the resident memory of the
command's whole process tree (sampled).

Ratios: "naive/torchrun" compares the time to N steps (the training loops); "pyflyte/torchrun" the whole
commands (the workflow with its export and evaluation against the torchrun command, as a user waits for
them); "pyflyte/torchrun to N steps" compares the times to N steps, which tells the start-up part of that
gap from the part after training (export, evaluation, exit).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout

from bench.e2e_measure import (  # noqa: E402
    TIMING,
    Workload,
    digits_tree,
    naive_figures,
    our_figures,
    pyflyte_metrics,
    run_command,
)
from bench.loader import image_folder  # noqa: E402
from bench.tables import markdown_table  # noqa: E402
from traincore.config.presets import preset  # noqa: E402
from traincore.data.staging import stage  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"naive/torchrun": 3.0, "pyflyte/torchrun": 1.1}  # naive at least 3x slower; pyflyte within 1.1x
MODELS = ("vit_tiny", "small_cnn")
# What each row's command does between its start and its exit (the "timed" column).
TIMED = {"naive": "torchrun launch, PIL decode per sample, training, rank-0 torch.save",
         "torchrun": "torchrun launch, training, checkpoints, final validation",
         "pyflyte": "pyflyte CLI, plan, staging cache hit, the torchrun row's training, export, evaluation "
                    "+ Deck"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="runs/bench", help="cache of image trees and stagings, and run dirs")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank; global = this x --nproc")
    parser.add_argument("--nproc", type=int, default=2, help="world size (processes on this machine)")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--checkpoint-mode", default="sync", choices=("sync", "dcp", "async"),
                        help="our runs' checkpoint.mode (the naive loop always torch.saves on rank 0)")
    parser.add_argument("--images", type=int, default=4000, help="synthetic images for vit_tiny")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--json", help="also write the results as JSON to this file")
    parser.add_argument("--tiny", action="store_true",
                        help="a smoke run: vit_tiny only, 200 images, 4 steps of 8 per rank, and no "
                             "untimed warm-up of pyflyte's staging cache (its row includes staging)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.steps, args.batch_size, args.checkpoint_every, args.images = 4, 8, 2, 200
        args.models = ["vit_tiny"]
    for name in ("steps", "batch_size", "nproc", "checkpoint_every", "images"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args


def workload(model: str, cache: Path, args: argparse.Namespace) -> Workload:
    """The image tree and training config for ``model``; the tree is generated on first use."""
    if model == "vit_tiny":
        tree, name, channels = image_folder(cache, args.images, 64, 10, suffix="png"), "vit_tiny", 3
    else:
        tree, name, channels = digits_tree(cache), "digits", 1
    overrides = {"loader": {"batch_size": args.batch_size}, "train": {"eval_every": 0},
                 "checkpoint": {"mode": args.checkpoint_mode, "every": args.checkpoint_every},
                 "data": {"source": f"imagefolder:{tree}"}}
    log_every = preset(name).with_overrides(overrides).telemetry.log_every
    return Workload(model=model, preset=name, tree=tree, channels=channels, overrides=overrides,
                    log_every=min(log_every, args.steps))


def naive_command(work: Workload, args: argparse.Namespace, output: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
            str(ROOT / "bench" / "naive_loop.py"), "--data", str(work.tree), "--output", str(output),
            "--model", work.model, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
            "--checkpoint-every", str(args.checkpoint_every), "--channels", str(work.channels)]


def torchrun_command(work: Workload, args: argparse.Namespace, staged: Path, output: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
            "-m", "traincore.train", "--data", str(staged), "--output", str(output), "--preset", work.preset,
            "--config", json.dumps(work.overrides), "--max-steps", str(args.steps)]


def pyflyte_command(work: Workload, args: argparse.Namespace, output: Path) -> list[str]:
    return [str(Path(sys.executable).parent / "pyflyte"), "run", str(ROOT / "workflows" / "pipeline.py"),
            "training_pipeline", "--source", work.overrides["data"]["source"], "--preset", work.preset,
            "--config_overrides", json.dumps(work.overrides), "--max_steps", str(args.steps),
            "--nproc_per_node", str(args.nproc), "--checkpoint_uri", str(output / "checkpoints")]


def warm_staging_cache(work: Workload, args: argparse.Namespace, scratch: Path) -> None:
    """An untimed one-step run of the same workflow: its staging task caches the staged data for the timed run
    (the staging's cache key does not depend on the number of steps)."""
    command = pyflyte_command(work, args, scratch / "warm-staging")
    command[command.index("--max_steps") + 1] = "1"
    run_command(command, scratch / "warm-staging", ROOT, check=True)


def bench_model(model: str, args: argparse.Namespace, cache: Path) -> list[dict]:
    """The three rows for one model; each run gets a fresh directory (no resume from an earlier run)."""
    work = workload(model, cache, args)
    scratch = cache / "end-to-end" / f"{model}-{time.strftime('%Y%m%d-%H%M%S')}"
    staged = cache / "staged" / f"{model}-{work.tree.name}"
    stage(preset(work.preset).with_overrides(work.overrides).data, staged, replace_unusable=True)
    if not args.tiny:
        warm_staging_cache(work, args, scratch)
    global_batch = args.batch_size * args.nproc
    runs = {"naive": naive_command(work, args, scratch / "naive"),
            "torchrun": torchrun_command(work, args, staged, scratch / "torchrun"),
            "pyflyte": pyflyte_command(work, args, scratch / "pyflyte")}
    rows = []
    for variant, command in runs.items():
        (scratch / variant).mkdir(parents=True, exist_ok=True)
        run = run_command(command, scratch / variant, ROOT, check=True)
        if variant == "naive":
            figures = naive_figures(scratch / variant / TIMING, run, global_batch, work.log_every)
        else:
            metrics = scratch / variant / "metrics.jsonl" if variant == "torchrun" else pyflyte_metrics(run)
            figures = our_figures(metrics, run, global_batch)
        print(f"{model} {variant}: {figures['to_n_steps_s']:.1f} s to {args.steps} steps "
              f"({run.wall_s:.1f} s command)", flush=True)
        rows.append({"model": model, "variant": variant, **figures, "timed": TIMED[variant]})
    return rows


def ratios(rows: list[dict]) -> dict[str, float]:
    """Per model: naive over torchrun to N steps; pyflyte over torchrun, whole commands and to N steps."""
    out = {}
    for model in dict.fromkeys(row["model"] for row in rows):
        by_variant = {row["variant"]: row for row in rows if row["model"] == model}
        naive, ours, flyte = by_variant["naive"], by_variant["torchrun"], by_variant["pyflyte"]
        out[f"{model} naive/torchrun"] = naive["to_n_steps_s"] / ours["to_n_steps_s"]
        out[f"{model} pyflyte/torchrun"] = flyte["command_s"] / ours["command_s"]
        out[f"{model} pyflyte/torchrun to N steps"] = flyte["to_n_steps_s"] / ours["to_n_steps_s"]
    return out


def target_of(ratio_name: str) -> str:
    """The target a ratio is held to, as text: naive/torchrun >= 3 (ViT), pyflyte/torchrun <= 1.1 (whole
    commands); the to-N-steps split of the pyflyte ratio has none."""
    model, kind = ratio_name.split(" ")[:2]
    if kind not in TARGETS or ratio_name != f"{model} {kind}":
        return "(none)"
    if kind == "naive/torchrun":
        return f">= {TARGETS[kind]:g}" if model == "vit_tiny" else "(none)"
    return f"<= {TARGETS[kind]:g}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cache = Path(args.dir).resolve()
    rows = [row for model in args.models for row in bench_model(model, args, cache)]
    found = ratios(rows)
    print(markdown_table(rows))
    print(markdown_table([{"ratio": name, "value": value, "target": target_of(name)}
                          for name, value in found.items()]))
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "end_to_end", "results": rows, "ratios": found,
                                               "targets": {name: target_of(name) for name in found}},
                                              indent=2))


if __name__ == "__main__":
    main()
