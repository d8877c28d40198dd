"""Validation benchmark: what periodic validation (``train.eval_every``) costs a run, against the same run
validated only at its end.

    python bench/validation.py [--data DIR] [--steps 352] [--eval-every 44] [--repeats 3] [--json PATH]

Both rows train the digits preset (one process, this machine's threads) for ``--steps`` steps; the
``eval_every`` row validates on the whole val split every ``--eval-every`` steps, and saves each validated
step so that its checkpoint records the metrics (what the digits preset does), while the baseline validates
and saves at the last step only (checkpoint.every_s off in both). Runs are interleaved, so load on the
machine hits both alike; the ratio is the median wall time of the training (Trainer.train) over the
baseline's median, measured in the same run.

What it costs scales with val samples / (eval_every x global batch) x (a forward's share of a step): the
digits preset validates 180 images every 1,408 trained (an eighth, a worst case); ImageNet's preset
validates 50,000 every 5,000 steps of 1,024 per GPU node (a hundredth), so under 1% there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout

from bench.tables import digits_and_scratch, write_results  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="staged digits directory (default: stage it into a temporary one)")
    parser.add_argument("--steps", type=int, default=352, help="steps of each run (digits: 8 epochs)")
    parser.add_argument("--eval-every", type=int, default=44,
                        help="the validated row's train.eval_every (the digits preset's: once an epoch)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row (the median counts)")
    parser.add_argument("--json", help="also write the results as JSON to this file")
    return parser.parse_args(argv)


def timed_run(data: Path, steps: int, eval_every: int) -> dict:
    """One digits run in this process: its wall time, validations and saves."""
    from traincore.config import preset
    from traincore.run import Trainer

    cfg = preset("digits").with_overrides({
        "train.max_steps": steps, "train.eval_every": eval_every, "checkpoint.every_s": 0,
        "telemetry.tensorboard": False, "telemetry.progress": "off", "telemetry.level": "WARNING"})
    with tempfile.TemporaryDirectory(prefix="bench-validation-") as tmp:
        start = time.perf_counter()
        summary = Trainer(cfg, data, Path(tmp)).train()
        wall = time.perf_counter() - start
        saves = len(list((Path(tmp) / "checkpoints").glob("step-*")))
    validations = steps // eval_every + (steps % eval_every != 0) if eval_every else 1
    return {"case": f"eval_every={eval_every}" if eval_every else "end only", "steps": summary.steps,
            "validations": validations, "kept_checkpoints": saves, "wall_s": round(wall, 3),
            "val_accuracy": round(summary.val_accuracy, 4)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with digits_and_scratch(args.data, "bench-validation-") as (data, _):
        timed_run(data, 2, 0)  # warm: imports and first-use costs belong to neither row
        rows = [timed_run(data, args.steps, every) for _ in range(args.repeats)
                for every in (0, args.eval_every)]
    medians = {case: statistics.median(r["wall_s"] for r in rows if r["case"] == case)
               for case in dict.fromkeys(r["case"] for r in rows)}
    baseline, validated = medians["end only"], medians[f"eval_every={args.eval_every}"]
    ratio = round(validated / baseline, 3)
    for case, median in medians.items():
        print(f"{case:<16}{median:>8.2f} s (median of {args.repeats})")
    print(f"eval_every={args.eval_every}/end only: {ratio:.3f}x")
    write_results(args.json, "validation", rows, {f"eval_every={args.eval_every}/end only": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
