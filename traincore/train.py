"""CLI: train on a staged dataset, single process or under torchrun.

    torchrun --nproc-per-node N -m traincore.train --data DIR --output DIR [--max-steps N | --epochs N]
        [--checkpoint-every N] [--checkpoint-mode sync|dcp|async] [--seed S] [--preset NAME] [--config JSON]

``--output`` receives ``checkpoints/step-*/``, ``tensorboard/`` and ``metrics.jsonl``. Running the same
command again resumes from the latest complete checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from traincore.config import PRESETS, Config, ConfigError, preset
from traincore.data import StagingError
from traincore.loop import TrainSummary, prepare, train

run = train  # the name the Flyte task calls: ``traincore.train.run(cfg, data_dir, output_dir)``
validate = prepare


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchrun -m traincore.train", description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="staged dataset directory (python -m traincore.stage)")
    parser.add_argument("--output", required=True, help="run directory: checkpoints, TensorBoard, metrics.jsonl")
    parser.add_argument("--preset", default="digits", choices=sorted(PRESETS), help="starting config")
    parser.add_argument("--config", default="", help='JSON overrides, e.g. \'{"optim": {"lr": 0.01}}\' or a .json file')
    steps = parser.add_mutually_exclusive_group()
    steps.add_argument("--max-steps", type=int, help="train for exactly N optimizer steps")
    steps.add_argument("--epochs", type=int, help="train for N epochs")
    parser.add_argument("--checkpoint-every", type=int, help="save every N steps (0 = only at the end)")
    parser.add_argument("--checkpoint-mode", choices=("sync", "dcp", "async"))
    parser.add_argument("--checkpoint-dir", help="checkpoint root (default <output>/checkpoints)")
    parser.add_argument("--resume", help="'latest' (default), 'none' or a step number")
    parser.add_argument("--seed", type=int, help="training seed (model init and data order)")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    """Preset, then --config overrides, then the explicit flags."""
    cfg = preset(args.preset)
    if args.config:
        text = Path(args.config).read_text() if args.config.endswith(".json") else args.config
        cfg = cfg.with_overrides(text)
    flags = {
        "train.max_steps": args.max_steps, "checkpoint.every": args.checkpoint_every,
        "checkpoint.mode": args.checkpoint_mode, "checkpoint.resume": args.resume, "train.seed": args.seed,
    }
    if args.epochs is not None:
        flags.update({"train.epochs": args.epochs, "train.max_steps": 0})
    return cfg.with_overrides({key: value for key, value in flags.items() if value is not None})


def format_summary(summary: TrainSummary) -> str:
    """The one line a user reads at the end of training."""
    val = f"{summary.val_accuracy:.3f}" if summary.val_accuracy is not None else "n/a"
    if summary.resumed_from == summary.steps:
        return (f"nothing to train: step {summary.steps} was already reached (checkpoints in "
                f"{summary.checkpoint_dir}); val accuracy {val}. Raise --max-steps/--epochs to train on")
    resumed = f", resumed from step {summary.resumed_from}" if summary.resumed_from else ""
    return (f"trained {summary.steps} steps in {summary.wall_s:.1f} s{resumed}: {summary.samples_per_s:,.0f} "
            f"samples/s, data-wait {100 * summary.data_wait_share:.1f}%, final loss {summary.final_loss:.4f}, "
            f"val accuracy {val}; checkpoints in {summary.checkpoint_dir}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = build_config(args)
        prepare(cfg, args.data)
    except (ConfigError, StagingError, ValueError, json.JSONDecodeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = train(cfg, args.data, args.output, args.checkpoint_dir)
    if int(os.environ.get("RANK", 0)) == 0:
        print(format_summary(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
