"""The command line of :mod:`traincore.train`: one process, N local workers, or torchrun's ranks.

    python -m traincore.train --data DIR --output DIR [--nproc-per-node N [--max-restarts R]]
        [--max-steps N | --epochs N] [--checkpoint-every N] [--checkpoint-mode sync|dcp|async]
        [--parallelism ddp|fsdp] [--resume latest|none|STEP] [--checkpoint-dir DIR|URI] [--seed S]
        [--preset NAME] [--config JSON]
    torchrun --nproc-per-node N -m traincore.train --data DIR --output DIR ...

``--nproc-per-node N`` checks the run once, then starts N workers (traincore.run.launch): forked, sharing
this process's imports, where each runs one intra-op thread; fresh interpreters otherwise. torchrun is for
several nodes.

``--output`` receives ``checkpoints/step-*/``, ``tensorboard/`` and ``metrics.jsonl``. Running the same
command again resumes from the latest complete checkpoint. Bad input is one ``error:`` line and exit code
2, printed once for the job; a preempted run exits 75 after saying which step it saved.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from traincore.checkpoint import CheckpointError, as_store, complete_steps
from traincore.config import (
    PARALLELISMS,
    PRESETS,
    Config,
    ConfigError,
    DataConfig,
    build_config,
    parse_source,
    preset,
)
from traincore.data import Manifest, StagingError, dataset_manifest, staging_key
from traincore.exitcodes import PREEMPTED_EXIT_CODE
from traincore.files import local_path_argument, path_argument
from traincore.run.launch import (
    launch_local,
    name_worker,
    refuse_under_torchrun,
    shutdown_timeout_s,
    start_method,
    worker_threads,
)
from traincore.run.preemption import Preempted, read_record
from traincore.run.preflight import preflight
from traincore.run.trainer import Trainer
from traincore.telemetry import StartupClock, TrainSummary, format_summary, process_start_time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The CLI's flags."""
    parser = argparse.ArgumentParser(prog="python -m traincore.train", description=(
        "Train on a staged dataset: one process, N local workers, or torchrun's ranks."))
    parser.add_argument("--data", required=True, type=path_argument,
                        help="staged dataset (python -m traincore.stage): a directory, or an object-store "
                             "URI such as s3://bucket/staged/digits (streamed; see loader.cache_bytes)")
    parser.add_argument("--output", required=True, type=local_path_argument,
                        help="run directory: checkpoints, TensorBoard, metrics.jsonl")
    parser.add_argument("--preset", default="digits", choices=sorted(PRESETS), help="starting config")
    parser.add_argument("--config", default="",
                        help='JSON overrides, e.g. \'{"optim": {"lr": 0.01}}\' or a .json file')
    steps = parser.add_mutually_exclusive_group()
    steps.add_argument("--max-steps", type=int, help="train for exactly N optimizer steps")
    steps.add_argument("--epochs", type=int, help="train for N epochs")
    parser.add_argument("--checkpoint-every", type=int, help="save every N steps (0 = only at the end)")
    parser.add_argument("--checkpoint-mode", choices=("sync", "dcp", "async"),
                        help="sync: gather the whole state on rank 0, which writes it; dcp: every rank "
                             "writes its own part; async: dcp, written in the background")
    parser.add_argument("--parallelism", choices=PARALLELISMS,
                        help="ddp: replicate the model on every rank; fsdp: shard parameters, gradients and "
                             "optimizer state across ranks (FSDP2)")
    parser.add_argument("--checkpoint-dir", type=path_argument,
                        help="checkpoint root (default <output>/checkpoints)")
    parser.add_argument("--resume", help="'latest' (default), 'none' or a step number")
    parser.add_argument("--seed", type=int, help="training seed (model init and data order)")
    parser.add_argument("--nproc-per-node", type=int,
                        help="train in N local workers forked from this process (not under torchrun)")
    parser.add_argument("--max-restarts", type=int,
                        help="with --nproc-per-node: restart the workers up to N times after a failure")
    return parser.parse_args(argv)


def check_launch_flags(args: argparse.Namespace) -> None:
    """ConfigError for --nproc-per-node / --max-restarts out of range, or given to a torchrun worker, and
    for a training length below 1 (0 would silently mean "the preset's length")."""
    for option, value, least in (("--nproc-per-node", args.nproc_per_node, 1),
                                 ("--max-restarts", args.max_restarts, 0)):
        if value is not None:
            refuse_under_torchrun(option)
            if value < least:
                raise ConfigError(f"{option}={value} is invalid: it must be >= {least}")
    for option, value in (("--max-steps", args.max_steps), ("--epochs", args.epochs)):
        if value is not None and value < 1:
            raise ConfigError(f"{option} {value} is invalid: it must be >= 1 (omit it to keep the preset's "
                              "length; --max-steps N trains N optimizer steps, --epochs N trains N epochs)")
    if args.max_restarts and args.nproc_per_node is None:
        raise ConfigError("--max-restarts restarts the workers of --nproc-per-node: add --nproc-per-node N")


_FLAGS = {"train.max_steps": "--max-steps", "train.epochs": "--epochs",
          "checkpoint.every": "--checkpoint-every", "checkpoint.mode": "--checkpoint-mode",
          "checkpoint.resume": "--resume", "train.seed": "--seed", "dist.parallelism": "--parallelism",
          "overrides": "--config"}


def config_from_args(args: argparse.Namespace) -> Config:
    """Preset, then --config overrides, then the explicit flags; ConfigError names the flag at fault."""
    settings = {
        "train.max_steps": args.max_steps, "checkpoint.every": args.checkpoint_every,
        "checkpoint.mode": args.checkpoint_mode, "checkpoint.resume": args.resume, "train.seed": args.seed,
        "dist.parallelism": args.parallelism,
    }
    if args.epochs is not None:
        settings.update({"train.epochs": args.epochs, "train.max_steps": 0})
    return build_config(args.preset, read_config_flag(args.config),
                        {key: value for key, value in settings.items() if value is not None}, _FLAGS)


STAGED_FIELDS = tuple(name for name in staging_key(DataConfig()) if name not in ("mean", "std"))
"""The data fields that decide what staging writes, which training reads as it is (data.mean and data.std
also normalise training's batches, so training may set them)."""


def check_staged_settings(cfg: Config, args: argparse.Namespace) -> None:
    """ConfigError for a ``data.*`` field that --config sets (unlike the preset) and that the staged data
    was not staged with: training reads the staging as it is, so that setting would be ignored in silence."""
    base = preset(args.preset).data
    given = {name: getattr(cfg.data, name) for name in STAGED_FIELDS
             if getattr(cfg.data, name) != getattr(base, name)}
    if not given:
        return
    manifest = dataset_manifest(as_store(args.data))
    staged = {"source": manifest.source, **manifest.config}
    kind = parse_source(staged["source"])[0]
    if kind != "synthetic":  # other sources ignore synthetic_*
        given = {name: value for name, value in given.items() if not name.startswith("synthetic_")}
    # A source of the staging's kind may name its files another way (a relative path, a URI).
    differing = [f"data.{name}={value!r} ({staged[name]!r} staged)" for name, value in given.items()
                 if (parse_source(value)[0] != kind if name == "source"
                     else staged.get(name, value) != value)]
    if differing:
        raise ConfigError(
            f"--config sets {', '.join(differing)}, but training reads {args.data} as it was staged: stage "
            f"it again with those settings (python -m traincore.stage ... --output {args.data} --overwrite) "
            "or leave them out")


def read_config_flag(value: str) -> str:
    """--config: JSON text, or the path of a .json file holding it."""
    if not value.strip().endswith(".json"):
        return value
    try:
        return Path(value.strip()).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"--config {value}: cannot read the file ({reason}): pass an existing .json file "
                          'or the JSON itself, e.g. \'{"optim": {"lr": 0.01}}\'') from exc


USAGE_ERRORS = (ConfigError, StagingError, CheckpointError, ValueError, OSError)
"""What the CLI reports as one ``error:`` line and exit code 2: bad input, whether preflight finds it or
(a checkpoint that does not fit, an output that cannot be written) the run itself."""


RANK_ERROR_GRACE_S = 10.0
"""How long a rank other than 0 waits, after an error, for rank 0 to fail too (torchrun then stops it)."""


def _launch_rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _report(exc: BaseException, rank: int) -> None:
    """Print ``error: ...`` once for the whole job, not once per rank.

    Every rank runs every check and fails alike, so rank 0 prints at once. Another rank waits a little
    first: when rank 0 fails too, torchrun stops this rank meanwhile (rank 0 is then also the root cause
    its failure box names); only an error that rank 0 does not share is still printed, by this rank.
    """
    if rank != 0:
        time.sleep(RANK_ERROR_GRACE_S)
    print(f"error: {exc}" if rank == 0 else f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)


def _report_preempted(exc: Preempted) -> None:
    """Rank 0 says once where the run stopped and what was saved."""
    if _launch_rank() == 0:
        print(exc, file=sys.stderr, flush=True)


def _preempted_workers(error: ChildFailedError, root: Path) -> bool:
    """Whether the workers failed only by exiting as preempted, with the run's record of it in place."""
    return (all(failure.exitcode == PREEMPTED_EXIT_CODE for failure in error.failures.values())
            and read_record(root) is not None)


def checkpoint_root(args: argparse.Namespace) -> str:
    """The run's checkpoint root: --checkpoint-dir (a path or an object-store URI), else
    <output>/checkpoints (as the Trainer takes it)."""
    return args.checkpoint_dir or str(Path(args.output) / "checkpoints")


def train_worker(cfg: Config, data_dir: str, output_dir: str, checkpoint_dir: str | None, manifest: Manifest,
                 startup: dict) -> TrainSummary:
    """One worker of ``--nproc-per-node``: trains on what the launcher checked. Bad input found only now
    exits 2 after one ``error:`` line, as a torchrun worker running the CLI does."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        # A restarted worker reports its own start-up, from its fork, as a resumed torchrun worker does.
        startup = StartupClock(process_start_time()).state_dict()
    try:
        return Trainer(cfg, data_dir, output_dir, checkpoint_dir, manifest=manifest, startup=startup).train()
    except USAGE_ERRORS as exc:
        _report(exc, _launch_rank())
        sys.exit(2)
    except Preempted as exc:
        _report_preempted(exc)
        sys.exit(PREEMPTED_EXIT_CODE)


def train_local_workers(cfg: Config, args: argparse.Namespace, started_at: float) -> TrainSummary:
    """Check the run once here, then train in ``--nproc-per-node`` workers; rank 0's summary."""
    startup = StartupClock(started_at)
    startup.mark("imports")
    threads = worker_threads(args.nproc_per_node)
    shutdown_timeout_s()  # refused here, before preflight creates the output directory
    manifest = preflight(cfg, args.data, args.output, args.checkpoint_dir, world_size=args.nproc_per_node)
    startup.mark("preflight")
    if start_method(threads, torch.cuda.is_available()) == "fork":
        # torch.optim's constructors import torch._dynamo (add_param_group is wrapped in
        # torch._disable_dynamo): about 1.5 s, paid here once for every forked worker instead of in each.
        importlib.import_module("torch._dynamo")
        startup.mark("dynamo import")
    results = launch_local(train_worker, (cfg, args.data, args.output, args.checkpoint_dir, manifest,
                                          startup.state_dict()), args.nproc_per_node, args.max_restarts or 0)
    return results[0]


def _stopped(signal_name: str, root: str) -> str:
    """What a launcher stopped by a signal says: its workers' own record said the rest, or the step the
    same command resumes from (the last committed one, or none)."""
    if read_record(root):
        return f"stopped by {signal_name}"
    complete = complete_steps(as_store(root))
    then = f"resumes from step {complete[-1]}" if complete else "starts from the beginning"
    return f"stopped by {signal_name} before a checkpoint could be saved; the same command {then}"


def main(argv: list[str] | None = None) -> int:
    """CLI: exit code 2 and one ``error:`` line for bad input, found before any process group starts where
    possible; no traceback. Under torchrun, the line is printed once (see :func:`_report`). A failed
    worker of ``--nproc-per-node`` is reported as torchrun reports it, with its exit code."""
    args = parse_args(argv)
    started_at = process_start_time()
    if "LOCAL_RANK" in os.environ:  # a worker of torchrun: told apart from the others in `ps` and `top`
        name_worker()
    try:
        check_launch_flags(args)
        cfg = config_from_args(args)
        check_staged_settings(cfg, args)
        if (args.nproc_per_node or 1) == 1 and not args.max_restarts:  # nothing to launch: train here
            summary = Trainer(cfg, args.data, args.output, args.checkpoint_dir, started_at=started_at).train()
        else:
            summary = train_local_workers(cfg, args, started_at)
    except USAGE_ERRORS as exc:
        _report(exc, _launch_rank())
        return 2
    except Preempted as exc:
        _report_preempted(exc)
        return PREEMPTED_EXIT_CODE
    except ChildFailedError as exc:
        if _preempted_workers(exc, checkpoint_root(args)):  # rank 0's worker has said so
            return PREEMPTED_EXIT_CODE
        print(exc, file=sys.stderr, flush=True)
        return max(exc.get_first_failure()[1].exitcode, 1)
    except SignalException as exc:  # the signal reached this launcher, which stopped its workers
        print(_stopped(exc.sigval.name, checkpoint_root(args)), file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    if _launch_rank() == 0:
        print(format_summary(summary), flush=True)
    return 0
