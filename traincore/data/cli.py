"""Stage a dataset source into the memory-mappable format (traincore.data.staging), from the command line.

    python -m traincore.stage --source digits --output DIR [--image-size N] [--seed S] [--partitions P]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from traincore.config import ConfigError, DataConfig
from traincore.data.manifest import StagingError
from traincore.data.staging import directory_bytes, stage, summary
from traincore.exitcodes import INTERRUPTED_EXIT_CODE
from traincore.files import local_path_argument


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The CLI flags; every DataConfig field that changes the staged bytes has one."""
    parser = argparse.ArgumentParser(prog="python -m traincore.stage", description=__doc__.splitlines()[0])
    defaults = DataConfig()
    parser.add_argument("--source", required=True,
                        help="digits | synthetic | imagefolder:<path-or-URI> (file://, s3://, gs://...) | "
                             "python:<module>:<callable> (a dataset factory of yours)")
    parser.add_argument("--output", required=True, type=local_path_argument,
                        help="directory to create (published atomically)")
    parser.add_argument("--image-size", type=int, default=defaults.image_size, help="square side in pixels")
    parser.add_argument("--channels", type=int, default=defaults.channels, choices=(1, 3))
    parser.add_argument("--seed", type=int, default=defaults.seed, help="split and synthetic-data seed")
    parser.add_argument("--val-fraction", type=float, default=defaults.val_fraction)
    parser.add_argument("--test-fraction", type=float, default=defaults.test_fraction)
    parser.add_argument("--samples", type=int, default=defaults.synthetic_samples,
                        help="synthetic: sample count")
    parser.add_argument("--classes", type=int, default=defaults.synthetic_classes,
                        help="synthetic: class count")
    parser.add_argument("--samples-per-shard", type=int, default=defaults.samples_per_shard)
    parser.add_argument("--decode-workers", type=int, default=0,
                        help="imagefolder decode processes (0 = cores)")
    parser.add_argument("--partitions", type=int, default=1,
                        help="stage in this many partitions in parallel processes, each a run of whole "
                             "shards (the same bytes as one); 0 = one per 4 GiB of staged pixels")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing, different staging (never a directory of other files)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """CLI: stage and print one summary line; exit code 2 (one ``error:`` line, no traceback) for a bad
    source or settings, too little disk space, or an output that cannot be written; 130 and one line when
    interrupted."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = DataConfig(source=args.source, image_size=args.image_size, channels=args.channels,
                         seed=args.seed, val_fraction=args.val_fraction, test_fraction=args.test_fraction,
                         synthetic_samples=args.samples, synthetic_classes=args.classes,
                         samples_per_shard=args.samples_per_shard, decode_workers=args.decode_workers)
        start = time.perf_counter()
        manifest = stage(cfg, args.output, overwrite=args.overwrite, partitions=args.partitions)
    except (ConfigError, StagingError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # anything stage() could not name better: still one line, no traceback
        print(f"error: {exc.strerror or exc}: {exc.filename or args.output}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or a factory raising it: stage() removed its partial copy
        print(f"interrupted: nothing was published, {args.output} is as it was", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    size, seconds = directory_bytes(args.output) / 2**20, time.perf_counter() - start
    print(f"staged {summary(manifest)} -> {args.output} ({size:.1f} MiB, {seconds:.1f} s)")
    return 0
