"""Staging benchmark: the wall time of one staging in 1, 2 and 4 partitions (traincore.data.partitions), in
processes of this machine, as ``python -m traincore.stage --partitions P`` and a local run stage them.

    python bench/staging.py [--samples 48000] [--size 64] [--partitions 1 2 4] [--repeats 2] [--json PATH]

The source is the synthetic one (generated, CPU-bound in one thread per partition: the case partitions are
for; an ImageFolder's decoding already runs in data.decode_workers processes, which partitions share).
Every row stages the same bytes, which the benchmark checks (the manifests must be equal); the ratios are
the one-partition time over each partition count's, medians measured in the same run, interleaved. On a
cluster each partition is a pod of its own, so the staging time falls with the pods, not this machine's
cores: here the speed-up is bounded by the cores (``cores`` in the results' header).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout

from bench.tables import scratch_directory, write_results  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=48_000,
                        help="synthetic samples (all splits; 48,000 at 64 px: 565 MiB)")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels (3 channels)")
    parser.add_argument("--partitions", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=2, help="stagings per row (the median counts)")
    parser.add_argument("--scratch", type=Path, help="where the stagings go (removed after each)")
    parser.add_argument("--json", help="also write the results as JSON to this file")
    return parser.parse_args(argv)


def timed_staging(cfg, output: Path, partitions: int) -> tuple[float, object]:
    """One staging into ``output`` (removed afterwards): its wall time and manifest."""
    from traincore.data import stage

    start = time.perf_counter()
    manifest = stage(cfg, output, partitions=partitions)
    wall = time.perf_counter() - start
    shutil.rmtree(output)
    return wall, manifest


def main(argv: list[str] | None = None) -> int:
    from traincore.config import DataConfig

    args = parse_args(argv)
    # Shards of an eighth of the train split: four partitions get two shards each.
    cfg = DataConfig(source="synthetic", image_size=args.size, channels=3, synthetic_samples=args.samples,
                     synthetic_classes=10, samples_per_shard=max(1, args.samples // 10))
    scratch = scratch_directory("bench-staging-", args.scratch)
    rows, manifests = [], {}
    try:
        for repeat in range(args.repeats):
            for partitions in args.partitions:
                wall, manifests[partitions] = timed_staging(cfg, scratch / f"p{partitions}", partitions)
                rows.append({"partitions": partitions, "repeat": repeat, "wall_s": round(wall, 3),
                             "samples_per_s": round(args.samples / wall)})
                print(f"{partitions} partition(s): {wall:.2f} s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if len({m.to_json() for m in manifests.values()}) != 1:
        raise SystemExit("the partition counts staged different manifests: a bug, not a measurement")
    medians = {p: statistics.median(r["wall_s"] for r in rows if r["partitions"] == p)
               for p in args.partitions}
    base = medians[args.partitions[0]]
    ratios = {f"{args.partitions[0]} over {p} partitions (speed-up)": round(base / medians[p], 3)
              for p in args.partitions[1:]}
    for name, value in ratios.items():
        print(f"{name}: {value:.3f}x")
    write_results(args.json, "staging", rows, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
