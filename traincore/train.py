"""Train on a staged dataset: the Trainer, and its CLI (one process, N local workers, or torchrun's ranks).

    python -m traincore.train --data DIR --output DIR [--nproc-per-node N [--max-restarts R]]
        [--max-steps N | --epochs N] [--checkpoint-every N] [--checkpoint-mode sync|dcp|async]
        [--parallelism ddp|fsdp] [--seed S]
        [--preset NAME] [--config JSON]
    torchrun --nproc-per-node N -m traincore.train --data DIR --output DIR ...

``--nproc-per-node N`` checks the run once, then forks N workers (traincore.launch) that share this
process's imports; torchrun is for several nodes.

``--output`` receives ``checkpoints/step-*/``, ``tensorboard/`` and ``metrics.jsonl``. Running the same
command again resumes from the latest complete checkpoint. On CPU with a fixed seed and world size the run
is deterministic, so a resumed run ends with bitwise the same weights as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from traincore.checkpoint import Checkpointer, CheckpointError, Store, as_store, step_store
from traincore.config import PARALLELISMS, Config, ConfigError
from traincore.data.autotune import autotune
from traincore.data.loader import StagedLoader, StagedSplit
from traincore.data.manifest import Manifest, StagingError
from traincore.dist import (
    DistContext,
    distributed,
    explain_timeouts,
    parallelize,
    tighten_timeout,
)
from traincore.launch import launch_local, refuse_under_torchrun, start_method
from traincore.models import build_model, parameter_count, shard_units
from traincore.preemption import (
    PREEMPTED_EXIT_CODE,
    Preempted,
    PreemptionWatch,
    clear_record,
    read_record,
    write_record,
)
from traincore.preflight import preflight
from traincore.presets import PRESETS, build_config
from traincore.state import Progress, training_registry
from traincore.steps import endless, seed_everything, total_steps, train_step, validate, warmup_cosine
from traincore.telemetry.metrics import peak_flops, state_bytes, training_flops_per_sample
from traincore.telemetry.profiling import ProfilerWindow
from traincore.telemetry.records import RecordsSync, attempt_records, next_attempt
from traincore.telemetry.reporting import Telemetry, Workload, logging_setup
from traincore.telemetry.startup import StartupClock, process_start_time
from traincore.telemetry.summary import TrainSummary, format_summary

log = logging.getLogger(__name__)


@contextmanager
def gc_paused() -> Iterator[None]:
    """A collection mid-step costs more than the garbage it frees: the loop collects on its schedule.

    What exists when the loop starts (torch's modules and the run's parts: millions of objects, which a
    full collection walks for most of a second) is frozen, so the loop's collections only look at what
    the steps allocated since.
    """
    gc.disable()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.enable()


class Trainer:
    """One run in this worker, complete once built: the process group, loader, model, optimizer, schedule,
    telemetry, state registry, checkpointer and profiler are up, and the latest checkpoint (if any) is
    loaded. :meth:`train` runs the steps and closes everything; a Trainer that will not train is closed
    with :meth:`close` (or used as a context manager).

    ``started_at`` (epoch seconds, e.g. :func:`~.startup.process_start_time`) is where the start-up
    figures begin: what ran before the Trainer was built counts as "imports". None: they begin now.

    A worker of a launcher that ran :func:`preflight` once for all its workers (``--nproc-per-node``)
    passes the ``manifest`` preflight returned, which skips preflight here, and the launcher's
    ``startup`` clock (:meth:`~.startup.StartupClock.state_dict`), which it continues in place
    of ``started_at``: the time up to this Trainer counts as "launch".

    ``attempt`` numbers this attempt's records in a durable checkpoint root (``records/attempt-<N>/``,
    :mod:`~traincore.telemetry.records`); None takes the next free number.

    Process-wide settings the run needs (deterministic algorithms, the root logger's handler and level)
    are restored when the Trainer closes, so code that runs in the same process afterwards is unaffected.
    """

    def __init__(self, cfg: Config, data_dir: str | Path, output_dir: str | Path,
                 checkpoint_dir: str | Path | Store | None = None, started_at: float | None = None, *,
                 manifest: Manifest | None = None, startup: dict | None = None, attempt: int | None = None):
        self.attempt = attempt
        self.startup = StartupClock(started_at)
        if startup is not None:
            self.startup.load_state_dict(startup)
            self.startup.mark("launch")
        elif started_at is not None:
            self.startup.mark("imports")
        self.cfg, self.data_dir, self.output = cfg, Path(data_dir), Path(output_dir)
        self.checkpoint_root = as_store(checkpoint_dir or self.output / "checkpoints")
        if manifest is None:
            manifest = preflight(cfg, data_dir, self.output, self.checkpoint_root)
            self.startup.mark("preflight")
        self.manifest = manifest
        self.progress = Progress()
        self.closed = False
        self.parts = ExitStack()  # unwinds in reverse: profiler, checkpointer, telemetry, logging, group, ...
        try:
            self._open(self.parts)
        except BaseException:
            self.parts.close()
            raise

    def _open(self, stack: ExitStack) -> None:
        """Every part of the run, each closed by ``stack`` however the run ends; then the resume."""
        cfg = self.cfg
        # torch.optim's constructors and use_deterministic_algorithms import torch._dynamo (about 1.5 s on a
        # 2-core machine, in any PyTorch training script): a phase of its own, so none of ours looks slow.
        importlib.import_module("torch._dynamo")
        self.startup.mark("dynamo import")
        stack.enter_context(deterministic_algorithms(cfg.train.deterministic))
        self.ctx = ctx = stack.enter_context(distributed(cfg.dist))
        stack.enter_context(logging_setup(cfg.telemetry.level, ctx.rank))
        # Closed among the last: its grace timer bounds the checkpointer's and telemetry's closing too.
        self.preemption = PreemptionWatch(cfg.checkpoint.preemption_grace_s, ctx.world_size,
                                          committed=self._committed_checkpoint)
        stack.callback(self.preemption.close)
        self.startup.mark("process group")
        self.output.mkdir(parents=True, exist_ok=True)
        if ctx.is_main:
            clear_record(self.checkpoint_root)
        self.loader, self.val_split = training_loader(cfg, self.data_dir, ctx)
        self.total_steps = total_steps(cfg, self.loader.steps_per_epoch)
        self.startup.mark("loader")
        model = build_model(cfg.model, self.manifest.num_classes, self.manifest.shape, seed=cfg.train.seed)
        workload = self._workload(model)
        self.model = parallelize(model.to(ctx.device), model_units(model, cfg), cfg.dist, ctx,
                                 bf16=cfg.train.bf16, compile=cfg.model.compile)
        self.optimizer, self.scheduler = optimizer_and_schedule(cfg, self.model, self.total_steps)
        self.startup.mark("model")
        self.records = self._records()
        if self.records is not None:  # closed after telemetry, whose last rows and events it copies
            stack.callback(self.records.close)
        self.telemetry = Telemetry(cfg.telemetry, self.output, ctx, workload, cfg.to_dict())
        stack.callback(self.telemetry.close)
        self.startup.mark("telemetry")
        seed_everything(cfg.train.seed + ctx.rank)  # per-rank streams (dropout, ...); a resume restores them
        self.registry = training_registry(self.model, self.optimizer, self.scheduler, self.loader,
                                          self.progress, self._run_meta())
        self.registry.register("telemetry", self.telemetry)
        self.checkpointer = Checkpointer(self.checkpoint_root, cfg.checkpoint, self.registry, ctx.rank,
                                         ctx.world_size)
        stack.callback(self.checkpointer.close)
        self.profiler = ProfilerWindow(cfg.train.profile_window(), self.output, ctx.rank)
        stack.callback(self.profiler.close)
        self.resumed_from = self._resume()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close every part (profiler, checkpointer, telemetry, process group) and restore the settings."""
        self.closed = True
        self.parts.close()

    def train(self) -> TrainSummary:
        """Run the steps from the resumed one to the last, validate, summarise; then close the run.

        Raises :class:`~traincore.preemption.Preempted` when a signal stopped the run at a step boundary,
        after that step was saved on every rank.
        """
        if self.closed:
            raise RuntimeError("this Trainer has finished and is closed: build a new Trainer to train again")
        with self:
            self.parts.enter_context(gc_paused())
            # A peer that hangs surfaces as gloo's bare "Timed out waiting ...": say what timed out and why.
            with explain_timeouts(self.cfg.dist, self.ctx.rank, lambda: self.progress.step):
                self._run_steps()
                val = validate(self.model, self.val_split, self.cfg.loader.eval_batch_size, self.ctx)
            self.telemetry.log_eval(self.progress.step, val)
            return self._summary(val["accuracy"])

    def _workload(self, model: nn.Module) -> Workload:
        """Steps, batch and FLOPs for telemetry; MFU is measured against the dtype the run computes in.
        ``model`` is the bare model, before any wrapping or sharding."""
        dtype = torch.bfloat16 if self.ctx.device.type == "cuda" and self.cfg.train.bf16 else torch.float32
        flops = None
        # Counted only where MFU is reported (rank 0, a device of known peak, e.g. not a CPU): a forward
        # under FlopCounterMode is start-up time (0.1 s for the digits model here). On meta tensors: the
        # weights are untouched.
        if self.ctx.is_main and peak_flops(self.ctx.device, dtype):
            flops = training_flops_per_sample(model, self.manifest.shape)
        return Workload(total_steps=self.total_steps, global_batch_size=self.loader.global_batch_size,
                        flops_per_sample=flops, dtype=dtype)

    def _run_meta(self) -> dict:
        """What a checkpoint records about the run beside the state: config, data shape, world size."""
        manifest = self.manifest
        return {"config": self.cfg.to_dict(), "num_classes": manifest.num_classes,
                "shape": list(manifest.shape), "classes": manifest.classes, "mean": manifest.mean,
                "std": manifest.std, "source": manifest.source, "world_size": self.ctx.world_size}

    def _records(self) -> RecordsSync | None:
        """Rank 0's copier of metrics.jsonl and the TensorBoard events into the checkpoint root's
        ``records/attempt-<N>/`` (N: ``attempt``, else the next free number), when that root is durable
        storage of its own rather than a directory inside the output."""
        root = self.checkpoint_root
        inside_output = root.local and root.path.resolve().is_relative_to(self.output.resolve())
        if not self.ctx.is_main or inside_output:
            return None
        attempt = self.attempt if self.attempt is not None else next_attempt(root)
        sources = {"metrics.jsonl": self.output / "metrics.jsonl", "tensorboard": self.output / "tensorboard"}
        every_s = self.cfg.telemetry.records_every_s
        return RecordsSync(attempt_records(root, attempt), every_s, sources).start()

    def _committed_checkpoint(self) -> str:
        """The newest checkpoint this run knows committed (loaded or saved), for the grace's last word."""
        step = getattr(self, "checkpointer", None) and self.checkpointer.committed
        if step is None:
            return f"no committed checkpoint in {self.checkpoint_root} (a resume starts from the beginning)"
        return f"the committed checkpoint step {step} in {self.checkpoint_root}"

    def _resume(self) -> int | None:
        """Restore the latest (or the requested) checkpoint, if any; returns its step.

        Telemetry learns the step the run continues from (0 when fresh): metrics an earlier attempt logged
        after it are dropped from metrics.jsonl and purged from TensorBoard, so each step appears once.
        """
        wanted = self.cfg.checkpoint.resume
        resumed = None
        if wanted != "none":
            resumed = self.checkpointer.load(None if wanted == "latest" else int(wanted))
        self.telemetry.resumed_at(resumed or 0)
        log.info("training %s (%s parameters) on %s for %d steps, %d per epoch, global batch %d%s",
                 self.cfg.model.name, f"{parameter_count(self.model):,}", self.ctx.device, self.total_steps,
                 self.loader.steps_per_epoch, self.loader.global_batch_size,
                 f", resumed from step {resumed} in {self.checkpoint_root}" if resumed else "")
        self.startup.mark("checkpoint look-up")
        return resumed

    def _run_steps(self) -> None:
        """The step loop proper, from the current (possibly resumed) step to the last."""
        cfg, progress = self.cfg, self.progress
        batches = endless(self.loader)
        self.model.train()
        first_step = progress.step + 1
        while progress.step < self.total_steps:
            with self.telemetry.data_wait():
                batch = next(batches)
            self.profiler.on_step(progress.step)
            loss = train_step(self.model, self.optimizer, self.scheduler, batch, cfg,
                              before_update=self.checkpointer.wait_for_snapshot)
            progress.step += 1
            step, last = progress.step, progress.step == self.total_steps
            self.telemetry.step_done(step, loss, self.scheduler.get_last_lr()[0])
            if step == first_step:
                tighten_timeout(cfg.dist)  # start-up is over: a hung peer should now fail fast
                self.startup.mark("first step")
                self.telemetry.log_startup(step, self.startup)
                self.telemetry.log_state_bytes(step, *state_bytes(self.model, self.optimizer))
            if step % cfg.train.gc_every == 0:
                gc.collect()
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and not last:
                self.telemetry.log_eval(step, validate(self.model, self.val_split, cfg.loader.eval_batch_size,
                                                       self.ctx))
            agreed = self.preemption.agree(save_due=self.checkpointer.interval_elapsed())
            saved = self.checkpointer.maybe_save(step, last_step=last, interval_due=agreed.save)
            if not last and agreed.stop:
                self._stop_preempted(step, saved)
        self.preemption.finish()
        self.checkpointer.wait()

    def _stop_preempted(self, step: int, saved: bool) -> None:
        """Every rank: save ``step`` unless just done, wait until it is committed, raise Preempted."""
        checkpoint: str | None = step_store(self.checkpoint_root, step).uri
        try:
            if not saved:
                self.checkpointer.save(step)
            self.checkpointer.wait()
        except CheckpointError as exc:  # e.g. a full disk: the last complete checkpoint stays the latest
            log.error("preempted at step %d, but its checkpoint failed: %s", step, exc)
            checkpoint = None
        preempted = Preempted(step, self.preemption.signal_name or "a signal", checkpoint)
        if self.ctx.is_main:
            write_record(self.checkpoint_root, preempted)
        raise preempted

    def _summary(self, val_accuracy: float) -> TrainSummary:
        """The run's summary from the telemetry totals (restored on resume, so they cover the whole run)."""
        totals = self.telemetry.summary()
        return TrainSummary(steps=self.progress.step, samples_per_s=totals["samples_per_s"],
                            data_wait_share=totals["data_wait_share"], final_loss=totals["final_loss"],
                            val_accuracy=val_accuracy, resumed_from=self.resumed_from,
                            checkpoint_dir=str(self.checkpoint_root), output_dir=str(self.output),
                            wall_s=totals["wall_s"], world_size=self.ctx.world_size,
                            startup_s=dict(self.startup.phases),
                            records=self.records.target.uri if self.records is not None else "")


@contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """torch.use_deterministic_algorithms for the run only (it is process-wide): restored on exit."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    if enabled:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def training_loader(cfg: Config, data_dir: Path, ctx: DistContext) -> tuple[StagedLoader, StagedSplit]:
    """This rank's resumable loader over the train split (autotuned when asked), and the val split."""
    train_split, val_split = StagedSplit(data_dir, "train"), StagedSplit(data_dir, "val")
    loader_cfg = cfg.loader
    if loader_cfg.autotune:
        loader_cfg = autotune(train_split, loader_cfg, rank=ctx.rank, world_size=ctx.world_size,
                              seed=cfg.train.seed, device=ctx.device)
    loader = StagedLoader(train_split, loader_cfg, rank=ctx.rank, world_size=ctx.world_size,
                          seed=cfg.train.seed, device=ctx.device)
    return loader, val_split


def model_units(model: nn.Module, cfg: Config) -> list[nn.Module]:
    """The blocks FSDP shards one by one (none under DDP)."""
    return shard_units(model) if cfg.dist.parallelism == "fsdp" else []


def optimizer_and_schedule(cfg: Config, model: nn.Module, steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over the model's parameters and its warmup-cosine LR schedule over ``steps``."""
    optim = cfg.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2),
                                  weight_decay=optim.weight_decay, foreach=True)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg, steps))


# ---- CLI -----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The CLI's flags."""
    parser = argparse.ArgumentParser(prog="python -m traincore.train", description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="staged dataset directory (python -m traincore.stage)")
    parser.add_argument("--output", required=True,
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
    parser.add_argument("--checkpoint-dir", help="checkpoint root (default <output>/checkpoints)")
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
    """Check the run once here, then train in ``--nproc-per-node`` forked workers; rank 0's summary."""
    startup = StartupClock(started_at)
    startup.mark("imports")
    manifest = preflight(cfg, args.data, args.output, args.checkpoint_dir)
    startup.mark("preflight")
    if start_method() == "fork":
        # torch.optim's constructors import torch._dynamo (add_param_group is wrapped in
        # torch._disable_dynamo): about 1.5 s, paid here once for every forked worker instead of in each.
        importlib.import_module("torch._dynamo")
        startup.mark("dynamo import")
    results = launch_local(train_worker, (cfg, args.data, args.output, args.checkpoint_dir, manifest,
                                          startup.state_dict()), args.nproc_per_node, args.max_restarts or 0)
    return results[0]


def main(argv: list[str] | None = None) -> int:
    """CLI: exit code 2 and one ``error:`` line for bad input, found before any process group starts where
    possible; no traceback. Under torchrun, the line is printed once (see :func:`_report`). A failed
    worker of ``--nproc-per-node`` is reported as torchrun reports it, with its exit code."""
    args = parse_args(argv)
    started_at = process_start_time()
    try:
        check_launch_flags(args)
        cfg = config_from_args(args)
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
        print(f"stopped by {exc.sigval.name}" if read_record(checkpoint_root(args)) else
              f"stopped by {exc.sigval.name} before a checkpoint could be saved; the same command resumes "
              "from the last complete one", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    if _launch_rank() == 0:
        print(format_summary(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
