"""Loader benchmark: naive per-sample JPEG decoding vs our staged loader vs a raw memcpy of the same bytes.

    python bench/loader.py [--dir runs/bench] [--images 20000] [--size 64] [--rounds 8] [--json PATH]

All rows read the same synthetic JPEG ImageFolder (generated once into --dir, deterministic). Rows:
  naive      torchvision ImageFolder + PIL decode + ToTensor per sample, DataLoader(num_workers=0), batch 64
  staged     StagedLoader.host_batches() with LoaderConfig() on world size 1: uint8 host batches
  staged+cpu iterating the StagedLoader itself: normalised float32 batches on the CPU
  memcpy     numpy copy of the train split's image bytes, in RAM, into a preallocated array: the limit
Staging (decode + resize + write, once per dataset) is timed separately. The table reports ratios against
the baselines measured in the same run; the targets (staged >= 20x naive, >= 50% of memcpy on a 2-core
machine) are printed next to them, not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout

from traincore.config.schema import DataConfig, LoaderConfig  # noqa: E402
from traincore.data.loader import StagedLoader, StagedSplit  # noqa: E402
from traincore.data.staging import stage  # noqa: E402

GENERATE_CHUNK = 500  # images per generation task
COMPLETE = ".complete"  # written last: a folder without it is regenerated


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="runs/bench", help="cache directory for the generated JPEGs")
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--size", type=int, default=64, help="square image side in pixels")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--naive-samples", type=int, default=3000, help="samples timed for the naive loader")
    parser.add_argument("--rounds", type=int, default=8,
                        help="timed epochs / copies per row (the best counts)")
    parser.add_argument("--json", help="also write the rows and ratios as JSON to this file")
    args = parser.parse_args(argv)
    for name in ("images", "size", "classes", "naive_samples", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.images < 10 * args.classes:
        parser.error(f"--images={args.images} is too few for {args.classes} classes: "
                     f"use >= {10 * args.classes}")
    return args


# ---- the image folder ----------------------------------------------------------------------------

def _write_images(root: str, first: int, count: int, size: int, classes: int, suffix: str) -> None:
    """Write images ``first .. first+count-1``: a smooth class-coloured gradient plus per-image noise."""
    from PIL import Image

    rng = np.random.default_rng([0, first])
    ramp = np.linspace(0.0, 1.0, size, dtype=np.float32)
    for index in range(first, first + count):
        label = index % classes
        colour = np.random.default_rng([1, label]).uniform(40, 215, size=3).astype(np.float32)
        base = colour * (0.6 + 0.4 * ramp[:, None, None] * ramp[None, :, None])
        pixels = np.clip(base + rng.normal(0, 20, size=(size, size, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(Path(root) / f"class_{label:02d}" / f"{index:06d}.{suffix}", quality=90)


def image_folder(cache: Path, images: int, size: int, classes: int, suffix: str = "jpg") -> Path:
    """A benchmark ImageFolder of ``suffix`` files (jpg or png; PNG ignores the JPEG quality), generated in
    parallel on first use and reused afterwards."""
    root = cache / f"{suffix}-{images}x{size}px-{classes}classes"
    if (root / COMPLETE).exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    for label in range(classes):
        (root / f"class_{label:02d}").mkdir(parents=True)
    starts = range(0, images, GENERATE_CHUNK)
    with ProcessPoolExecutor() as pool:
        list(pool.map(_write_images, [str(root)] * len(starts), starts,
                      [min(GENERATE_CHUNK, images - s) for s in starts], [size] * len(starts),
                      [classes] * len(starts), [suffix] * len(starts)))
    (root / COMPLETE).write_text(json.dumps({"images": images, "size": size, "classes": classes}))
    return root


# ---- measurements --------------------------------------------------------------------------------

def drain(batches: Iterable, stop_after: int | None = None) -> int:
    """Samples in ``batches`` (or the first batches holding ``stop_after`` samples)."""
    samples = 0
    for _, labels in batches:
        samples += len(labels)
        if stop_after is not None and samples >= stop_after:
            break
    return samples


def timed(run: Callable[[], int]) -> float:
    """Samples per second of one call of ``run``, which returns the samples it handled."""
    start = time.perf_counter()
    samples = run()
    return samples / (time.perf_counter() - start)


def naive_rate(root: Path, samples: int) -> float:
    """torchvision's ImageFolder decoding every JPEG per sample in the main process."""
    import torch
    from torchvision import datasets, transforms

    dataset = datasets.ImageFolder(str(root), transform=transforms.ToTensor())
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, shuffle=True, num_workers=0,
                                         generator=torch.Generator().manual_seed(0))
    return timed(lambda: drain(loader, stop_after=samples))


def memcpy_pass(split: StagedSplit) -> Callable[[], int]:
    """One pass = copy the split's image bytes from RAM into a preallocated array."""
    source = split.read(np.arange(len(split)))[0].numpy()
    target = np.empty_like(source)

    def copy() -> int:
        np.copyto(target, source)
        return len(split)

    return copy


def best_rates(passes: dict[str, Callable[[], int]], rounds: int) -> dict[str, float]:
    """Each pass's best samples/s over ``rounds`` rounds, after one untimed warm-up round.

    The passes alternate within a round, so every row sees the same machine load, and the best round
    counts: on a shared machine the fastest run is the one least disturbed by other processes.
    """
    for run in passes.values():  # warm-up: page cache, mappings, allocator
        run()
    best = dict.fromkeys(passes, 0.0)
    for _ in range(rounds):
        for name, run in passes.items():
            best[name] = max(best[name], timed(run))
    return best


def report(rows: dict[str, float], sample_bytes: int) -> dict:
    """Print the table: samples/s, MB/s and each row's ratio to the naive loader and to memcpy; return it
    as ``{"results": [rows], "ratios": ..., "targets": ...}`` for --json."""
    naive, staged, limit = rows["naive"], rows["staged"], rows["memcpy"]
    print(f"{'loader':<12}{'samples/s':>14}{'MB/s':>10}{'x naive':>10}{'% memcpy':>10}")
    for name, value in rows.items():
        print(f"{name:<12}{value:>14,.0f}{value * sample_bytes / 1e6:>10,.0f}{value / naive:>10.1f}"
              f"{100 * value / limit:>9.1f}%")
    print(f"b/a = {staged / naive:.1f}x (target >= 20x)   b/c = {100 * staged / limit:.0f}% (target >= 50%)")
    return {"results": [{"loader": name, "samples_per_s": value, "mb_per_s": value * sample_bytes / 1e6,
                         "x_naive": value / naive, "share_of_memcpy": value / limit}
                        for name, value in rows.items()],
            "ratios": {"staged/naive": staged / naive, "staged/memcpy": staged / limit},
            "targets": {"staged/naive": ">= 20", "staged/memcpy": ">= 0.5"}}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cache = Path(args.dir)
    start = time.perf_counter()
    root = image_folder(cache, args.images, args.size, args.classes)
    print(f"image folder {root}: {args.images} JPEGs ready in {time.perf_counter() - start:.1f} s")
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        start = time.perf_counter()
        staged = Path(scratch) / "staged"
        stage(DataConfig(source=f"imagefolder:{root}", image_size=args.size), staged)
        print(f"staging (one-time): {time.perf_counter() - start:.1f} s")
        split = StagedSplit(staged, "train")
        loader = StagedLoader(split, LoaderConfig())
        rows = {"naive": naive_rate(root, args.naive_samples)}
        rows |= best_rates({"staged": lambda: drain(loader.host_batches()),
                            "staged+cpu": lambda: drain(loader), "memcpy": memcpy_pass(split)}, args.rounds)
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"train split: {len(split)} samples of {split.manifest.sample_bytes} bytes; naive: "
              f"{args.naive_samples} samples; others: best of {args.rounds} full passes; load average {load}")
        table = report(rows, split.manifest.sample_bytes)
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "loader", **table}, indent=2))


if __name__ == "__main__":
    main()
