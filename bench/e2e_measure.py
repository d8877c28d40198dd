"""What bench/end_to_end.py measures: commands run with their process tree's memory sampled, and the figures
read back from each run's own records (the naive loop's timing.json, our runs' metrics.jsonl and logs)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TIMING = "timing.json"  # written by bench/naive_loop.py
SAMPLE_EVERY_S = 0.2
STALL = re.compile(r"checkpoint step=\d+ mode=\S+ blocking=([0-9.]+)s")
RECORDS = re.compile(r"; records in (\S+); TensorBoard:")  # the train line names its attempt's records


@dataclass
class Workload:
    """One model's benchmark inputs: its image tree, preset and our config overrides."""

    model: str
    preset: str
    tree: Path
    channels: int
    overrides: dict
    log_every: int


@dataclass
class Run:
    """A finished command: when it started (epoch seconds), how long it ran, its output, its peak memory."""

    start: float
    wall_s: float
    output: str
    peak_rss_gib: float


def digits_tree(cache: Path) -> Path:
    """scikit-learn's bundled 8x8 digits as an ImageFolder of grayscale PNGs, written once."""
    from PIL import Image
    from sklearn.datasets import load_digits

    root = cache / "png-digits"
    if (root / ".complete").exists():
        return root
    digits = load_digits()
    pixels = np.round(digits.images * (255 / 16)).astype(np.uint8)
    for index, (image, label) in enumerate(zip(pixels, digits.target, strict=True)):
        folder = root / f"digit_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image, mode="L").save(folder / f"{index:04d}.png")
    (root / ".complete").write_text(str(len(pixels)))
    return root


def _tree_rss_bytes(root_pid: int) -> int:
    """Resident bytes of ``root_pid`` and all its descendants, from /proc (0 where /proc is missing)."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        parents[int(entry)] = int(fields[1])
        rss[int(entry)] = int(fields[21]) * page
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier += children
    return sum(rss.get(pid, 0) for pid in tree)


def run_command(command: list[str], workdir: Path, cwd: Path, check: bool) -> Run:
    """Run ``command`` (output to ``workdir``/output.log) while sampling its process tree's RSS."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "output.log"
    peak = 0
    start = time.time()
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT)
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(SAMPLE_EVERY_S):
                peak = max(peak, _tree_rss_bytes(process.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = process.wait()
        done.set()
        sampler.join()
    wall = time.time() - start
    output = log.read_text(errors="replace")
    if check and code:
        tail = "\n".join(output.splitlines()[-30:])
        raise RuntimeError(f"{' '.join(command[:6])} ... failed with exit code {code} (log {log}):\n{tail}")
    return Run(start=start, wall_s=wall, output=output, peak_rss_gib=peak / 2**30)


def _steady_rate(steps: list[int], times: list[float], first_step: int, global_batch: int) -> float | None:
    """Samples/s from the end of step ``first_step`` to the last step (None if there is no such interval)."""
    if first_step not in steps or steps[-1] <= first_step:
        return None
    begin = times[steps.index(first_step)]
    return (steps[-1] - first_step) * global_batch / (times[-1] - begin)


def _common(run: Run, first: float | None, last: float, stalls: list[float]) -> dict:
    return {"to_n_steps_s": last - run.start, "first_step_s": None if first is None else first - run.start,
            "command_s": run.wall_s, "stall_per_save_s": float(np.mean(stalls)) if stalls else None,
            "saves": len(stalls), "peak_rss_gib": run.peak_rss_gib}


def naive_figures(timing_path: Path, run: Run, global_batch: int, log_every: int) -> dict:
    """The naive loop's figures from its rank-0 timing.json."""
    timing = json.loads(Path(timing_path).read_text())
    ends = timing["step_end"]
    steps = list(range(1, len(ends) + 1))
    loop_s = ends[-1] - timing["loop_start"]
    return {**_common(run, ends[0], ends[-1], timing["save_s"]),
            "samples_per_s": _steady_rate(steps, ends, log_every, global_batch),
            "data_wait_share": sum(timing["data_wait_s"]) / loop_s, "mfu": None}


def our_figures(metrics_path: Path, run: Run, global_batch: int) -> dict:
    """Figures of a traincore run from its metrics.jsonl (train and start-up records) and rank 0's log."""
    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("kind") == "train"]
    startup = next((r for r in records if r.get("kind") == "startup"), None)
    first = startup["origin"] + startup["total_s"] if startup else None
    steps, times = [r["step"] for r in train], [r["time"] for r in train]
    intervals = np.diff([0] + steps)
    wait = sum(r["data_wait_s"] * n for r, n in zip(train, intervals, strict=True))
    loop = sum(r["step_time_s"] * n for r, n in zip(train, intervals, strict=True))
    mfu = [r["mfu"] for r in train[1:] if "mfu" in r]
    return {**_common(run, first, times[-1], [float(s) for s in STALL.findall(run.output)]),
            "samples_per_s": _steady_rate(steps, times, steps[0], global_batch),
            "data_wait_share": wait / loop if loop else None, "mfu": float(np.mean(mfu)) if mfu else None}


def pyflyte_metrics(run: Run) -> Path:
    """The train task's metrics.jsonl: in the attempt's records, which its summary line names."""
    found = RECORDS.findall(run.output)
    if not found:
        raise RuntimeError("pyflyte run printed no 'records in ...' in its train line: cannot find its "
                           "metrics.jsonl")
    return Path(found[-1]) / "metrics.jsonl"
