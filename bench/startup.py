"""Start-up benchmark: time from the command to the first training step, against ``import torch``.

    python bench/startup.py [--data DIR] [--repeats 3] [--max-steps 2] [--json PATH]

Rows, each run ``--repeats`` times, interleaved so that load on the machine hits every row alike:
  import torch             ``python -c "import torch"``: the baseline, the whole process's wall time
  bare PyTorch script      ``python -c`` a script that imports torch, builds a linear model and AdamW and
                           takes one step: what any PyTorch training pays (torch.optim's constructors
                           import torch._dynamo), for reference
  1 process                ``python -m traincore.train --preset digits``
  2 processes              ``python -m traincore.train --nproc-per-node 2 --preset digits``: workers forked
                           from the command's process, which checked the run once
  2 processes (torchrun)   ``torchrun --standalone --nproc-per-node 2 -m traincore.train --preset digits``,
                           for comparison: every worker a fresh interpreter
For the training rows, the first step's time comes from the "startup" record that rank 0 writes to
metrics.jsonl (the start of its clock plus the phases up to the first step), measured from the moment this
script started the command; ``launcher`` is the part before that clock started: torchrun and the worker's
spawn, about 0 for the rows whose clock starts with the command's process (a forked worker's phases hold
its launcher's imports and preflight, then "launch").
Ratios are medians against the baseline's median in the same run; the target (<= 1.5x) is printed, not
asserted. ``--data`` defaults to the digits data staged once into a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout

from bench.tables import digits_and_scratch, write_results  # noqa: E402

TARGET_RATIO = 1.5
TRAIN = ["-m", "traincore.train", "--preset", "digits"]
# Prints the epoch time its first step ended at: the whole first-step time of a minimal training script.
BARE_SCRIPT = ("import time, torch; model = torch.nn.Linear(1024, 10); "
               "optimizer = torch.optim.AdamW(model.parameters()); "
               "model(torch.zeros(32, 1024)).sum().backward(); optimizer.step(); print(time.time())")
CASES = {
    "import torch": [sys.executable, "-c", "import torch"],
    "bare PyTorch script": [sys.executable, "-c", BARE_SCRIPT],
    "1 process": [sys.executable, *TRAIN],
    "2 processes": [sys.executable, *TRAIN, "--nproc-per-node", "2"],
    "2 processes (torchrun)": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node=2", *TRAIN],
}
BASELINES = ("import torch", "bare PyTorch script")  # rows that are not our training runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="staged digits directory (default: stage it into a temporary one)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row (the median counts)")
    parser.add_argument("--max-steps", type=int, default=2, help="steps each training run takes")
    parser.add_argument("--json", help="also write the rows and ratios to this file")
    args = parser.parse_args(argv)
    for name in ("repeats", "max_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args


def startup_record(metrics: Path) -> dict:
    """The last "startup" record in a metrics.jsonl."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    found = [record for record in records if record.get("kind") == "startup"]
    if not found:
        raise RuntimeError(f"{metrics} holds no startup record: did the run reach its first step?")
    return found[-1]


def run_case(name: str, data: Path, max_steps: int, workdir: Path) -> dict:
    """Run one row once; its wall time and, for training rows, the first step's time and phases."""
    command = list(CASES[name])
    output = workdir / f"{name.replace(' ', '-')}-{time.monotonic_ns()}"
    if name not in BASELINES:
        command += ["--data", str(data), "--output", str(output), "--max-steps", str(max_steps),
                    "--resume", "none", "--config", '{"telemetry": {"progress": "off"}}']
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    wall = time.time() - started
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    row = {"case": name, "wall_s": round(wall, 3)}
    if name == "import torch":
        return {**row, "to_first_step_s": round(wall, 3)}
    if name == "bare PyTorch script":
        return {**row, "to_first_step_s": round(float(done.stdout.split()[-1]) - started, 3)}
    record = startup_record(output / "metrics.jsonl")
    phases = {key: value for key, value in record.items() if key.endswith("_s") and key != "total_s"}
    return {**row, "to_first_step_s": round(record["origin"] + record["total_s"] - started, 3),
            "launcher_s": round(record["origin"] - started, 3), **phases}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with digits_and_scratch(args.data, "bench-startup-") as (data, tmp):
        rows = [run_case(name, data, args.max_steps, tmp) for _ in range(args.repeats) for name in CASES]
    medians = {name: statistics.median(r["to_first_step_s"] for r in rows if r["case"] == name)
               for name in CASES}
    baseline = medians["import torch"]
    ratios = {name: round(medians[name] / baseline, 3) for name in CASES if name != "import torch"}
    width = max(map(len, CASES)) + 2
    print(f"{'case':<{width}}{'first step s':>14}{'launcher s':>12}  phases (median run)")
    for name in CASES:
        runs = sorted((r for r in rows if r["case"] == name), key=lambda r: r["to_first_step_s"])
        mid = runs[len(runs) // 2]
        phases = ", ".join(f"{k[:-2]} {v:.2f}" for k, v in mid.items()
                           if k.endswith("_s") and k not in ("wall_s", "to_first_step_s", "launcher_s"))
        launcher = f"{mid['launcher_s']:.2f}" if "launcher_s" in mid else "-"
        print(f"{name:<{width}}{medians[name]:>14.2f}{launcher:>12}  {phases}")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x import torch (target <= {TARGET_RATIO}x)")
    write_results(args.json, "startup", rows, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
