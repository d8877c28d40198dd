"""Train on a staged dataset: the :class:`Trainer`, one run in this worker.

``python -m traincore.train`` is its command line (:mod:`traincore.run.cli`: flags, local workers,
torchrun, and one ``error:`` line for bad input). A Trainer builds the run's parts (process group, loader,
model, optimizer, telemetry, state registry, checkpointer), resumes from the latest complete checkpoint,
and :meth:`Trainer.train` runs the steps as a story: one step, telemetry, the preemption agreement, a
checkpoint when due, validation. On CPU with a fixed seed and world size a run is deterministic, so a
resumed run ends with bitwise the same weights as an uninterrupted one.
"""

from __future__ import annotations

import gc
import importlib
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from traincore.checkpoint import Checkpointer, CheckpointError, Store, as_store, step_store
from traincore.config import Config
from traincore.data import (
    Manifest,
    StagedLoader,
    StagedSplit,
    StreamedSplit,
    autotune,
    cache_limit,
    open_streamed,
)
from traincore.model import build_model, init_tensors, parameter_count, shard_units, store_options
from traincore.run.dist import (
    DistContext,
    distributed,
    explain_timeouts,
    parallelize,
    tighten_timeout,
)
from traincore.run.early_stopping import EarlyStopping
from traincore.run.ema import EMA
from traincore.run.membership import Membership
from traincore.run.param_groups import freeze, optimizer_groups
from traincore.run.preemption import (
    Preempted,
    PreemptionWatch,
    clear_record,
    write_record,
)
from traincore.run.preflight import preflight
from traincore.run.schedule import lr_factor
from traincore.run.state import Progress, load_model_tensors, training_registry, unwrap_model
from traincore.run.steps import accumulation, endless, seed_everything, total_steps, train_step, validate
from traincore.telemetry import (
    ProfilerWindow,
    RecordsSync,
    StartupClock,
    Telemetry,
    TrainSummary,
    Workload,
    attempt_records,
    continue_records,
    logging_setup,
    next_attempt,
    peak_flops,
    state_bytes,
    training_flops_per_sample,
)

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

    def __init__(self, cfg: Config, data_dir: str | Path | Store, output_dir: str | Path,
                 checkpoint_dir: str | Path | Store | None = None, started_at: float | None = None, *,
                 manifest: Manifest | None = None, startup: dict | None = None, attempt: int | None = None):
        self.attempt = attempt
        self.startup = StartupClock(started_at)
        if startup is not None:
            self.startup.load_state_dict(startup)
            self.startup.mark("launch")
        elif started_at is not None:
            self.startup.mark("imports")
        # The staged dataset: a directory (memory-mapped) or an object-store prefix (streamed, data.stream).
        self.cfg, self.data, self.output = cfg, as_store(data_dir), Path(output_dir)
        self.checkpoint_root = as_store(checkpoint_dir or self.output / "checkpoints")
        if manifest is None:
            manifest = preflight(cfg, data_dir, self.output, self.checkpoint_root)
            self.startup.mark("preflight")
        self.manifest = manifest
        self.progress = Progress()
        self.closed = False
        self.validated: dict[str, float] | None = None  # the last validation, as a checkpoint records it
        self.stopped_early = False
        self.parts = ExitStack()  # unwinds in reverse: profiler, checkpointer, telemetry, logging, group, ...
        try:
            self._open(self.parts)
        except BaseException:
            self.parts.__exit__(*sys.exc_info())
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
        self.preemption = stack.enter_context(PreemptionWatch(
            cfg.checkpoint.preemption_grace_s, ctx.world_size, committed=self._committed_checkpoint,
            main=ctx.is_main))
        self.startup.mark("process group")
        self.output.mkdir(parents=True, exist_ok=True)
        if ctx.is_main:
            clear_record(self.checkpoint_root)
        # Batches per step on each rank: train.global_batch keeps a step's samples whatever the world size.
        self.accum = accumulation(cfg, ctx.world_size)
        self.loader, self.val_split = training_loader(cfg, self.data, ctx, stack, self.accum)
        self.total_steps = total_steps(cfg, self.loader.steps_per_epoch, self.accum)
        # Where this run stops: the last step, or train.stop_after's (a rung of a search, continued later).
        self.end_step = min(self.total_steps, cfg.train.stop_after or self.total_steps)
        # Samples per optimizer step, across ranks and accumulated batches.
        self.step_batch_size = self.loader.global_batch_size * self.accum
        self.startup.mark("loader")
        model = build_model(cfg.model, self.manifest.num_classes, self.manifest.shape, seed=cfg.train.seed)
        freeze(model, cfg.optim.param_groups)  # before DDP or FSDP2 decide what they reduce
        workload = self._workload(model)
        self.model = parallelize(model.to(ctx.device), model_units(model, cfg), cfg.dist, ctx,
                                 bf16=cfg.train.bf16, compile=cfg.model.compile)
        self.optimizer, self.scheduler = optimizer_and_schedule(cfg, self.model, self.total_steps)
        self.ema = self._ema() if cfg.optim.ema_decay else None
        self.startup.mark("model")
        self.records = self._records()
        if self.records is not None:  # closed after telemetry, whose last rows and events it copies
            stack.callback(self.records.close)
            # A save that outlasts the grace ends the process without unwinding: the records' last copy.
            self.preemption.last_copy = self.records.close
        self.telemetry = Telemetry(cfg.telemetry, self.output, ctx, workload, cfg.to_dict())
        stack.callback(self.telemetry.close)
        self.startup.mark("telemetry")
        seed_everything(cfg.train.seed + ctx.rank)  # per-rank streams (dropout, ...); a resume restores them
        self.run_meta = self._run_meta()  # the record a warm start adds its file to (_warm_start)
        self.registry = training_registry(self.model, self.optimizer, self.scheduler, self.loader,
                                          self.progress, self.run_meta)
        self.registry.register("telemetry", self.telemetry)
        self.membership = Membership(ctx.world_size, self.step_batch_size)
        self.registry.register("membership", self.membership)
        if self.ema is not None:
            self.registry.register("ema", self.ema)
        stopping = cfg.train.early_stopping
        self.early_stopping = EarlyStopping(cfg.train.metric, stopping.get("patience"),
                                            stopping.get("min_delta", 0.0))
        self.registry.register("early_stopping", self.early_stopping)
        self.checkpointer = Checkpointer(self.checkpoint_root, cfg.checkpoint, self.registry, ctx.rank,
                                         ctx.world_size, keep_best=cfg.train.metric)
        stack.callback(self.checkpointer.close)
        self.profiler = ProfilerWindow(cfg.train.profile_window(), self.output, ctx.rank)
        stack.callback(self.profiler.close)
        self.resumed_from = self._resume()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc_info) -> None:
        # The parts see the error the run ends on (a signalled run that fails ends as a preempted one).
        self.closed = True
        self.parts.__exit__(*exc_info)

    def close(self) -> None:
        """Close every part (profiler, checkpointer, telemetry, process group) and restore the settings."""
        self.closed = True
        self.parts.close()

    def train(self) -> TrainSummary:
        """Run the steps from the resumed one to the last, validate, summarise; then close the run.

        Raises :class:`~traincore.run.preemption.Preempted` when a signal stopped the run at a step boundary,
        after that step was saved on every rank.
        """
        if self.closed:
            raise RuntimeError("this Trainer has finished and is closed: build a new Trainer to train again")
        with self:
            self.parts.enter_context(gc_paused())
            # A peer that hangs surfaces as gloo's bare "Timed out waiting ...": say what timed out and why.
            with explain_timeouts(self.cfg.dist, self.ctx.rank, lambda: self.progress.step):
                self._run_steps()
                if self.validated is None:  # resumed at the last step: nothing ran, so validate here
                    self.validated = self._validate(self.progress.step)
            return self._summary(self.validated["val_accuracy"])

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
        return Workload(total_steps=self.end_step, global_batch_size=self.step_batch_size,
                        flops_per_sample=flops, dtype=dtype)

    def _warm_start(self, resumed: int | None) -> None:
        """Load model.init_from into the model (wrapped and sharded by now) of a run that starts fresh: the
        checkpointer, which chose the step to resume from (None: nothing to resume), decides. A resumed
        run's checkpoint holds the weights since, and its run record says which file they started from; a
        fresh run's record gets that file and its sha256."""
        cfg = self.cfg.model
        if not cfg.init_from:
            return
        if resumed is not None:
            log.info("model.init_from %s is ignored: this run resumes from step %d in %s", cfg.init_from,
                     resumed, self.checkpoint_root)
            return
        self.startup.mark("checkpoint look-up")
        report, tensors = init_tensors(unwrap_model(self.model).state_dict(), cfg.init_from, cfg.init_exclude,
                                       cfg.init_strict, store_options(cfg.init_from, self.checkpoint_root))
        load_model_tensors(self.model, tensors)
        self.run_meta["init"] = {"from": cfg.init_from, "sha256": report.sha256}
        self.startup.mark("model")  # the starting weights are part of the model's start-up

    def _run_meta(self) -> dict:
        """What a checkpoint records about the run beside the state: config, data shape, world size (and,
        added by :meth:`_warm_start`, the file its weights started from)."""
        manifest = self.manifest
        return {"config": self.cfg.to_dict(), "num_classes": manifest.num_classes,
                "shape": list(manifest.shape), "classes": manifest.classes, "mean": self.val_split.mean,
                "std": self.val_split.std, "source": manifest.source, "world_size": self.ctx.world_size}

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
        target = attempt_records(root, attempt)
        continue_records(target, sources["metrics.jsonl"])
        return RecordsSync(target, self.cfg.telemetry.records_every_s, sources).start()

    def _committed_checkpoint(self) -> str:
        """What a resume loads, from the newest checkpoint this run knows committed (loaded or saved), for
        the grace's last word."""
        step = getattr(self, "checkpointer", None) and self.checkpointer.committed
        if step is None:
            return (f"no checkpoint of this run is committed in {self.checkpoint_root}, so a resume starts "
                    "from the beginning")
        return f"the committed checkpoint step {step} in {self.checkpoint_root} stays the one a resume loads"

    def _resume(self) -> int | None:
        """Restore the latest (or the requested) checkpoint, if any; returns its step.

        Telemetry learns the step the run continues from (0 when fresh): metrics an earlier attempt logged
        after it are dropped from metrics.jsonl and purged from TensorBoard, so each step appears once.
        """
        wanted = self.cfg.checkpoint.resume
        resumed = None
        if wanted != "none":
            # A run that stops early (a rung of a search) resumes from a step it reaches, even where a later
            # rung already went further: a rerun of the rung measures the same step.
            at_most = self.end_step if self.cfg.train.stop_after else None
            resumed = self.checkpointer.load(None if wanted == "latest" else int(wanted), at_most)
        self._warm_start(resumed)
        # (step, time) of the newest step an earlier attempt logged here: what a membership change redoes
        self.last_logged = self.telemetry.resumed_at(resumed or 0)
        accum = self.accum
        log.info("training %s (%s parameters) on %s for %d steps, %d per epoch, global batch %d%s%s",
                 self.cfg.model.name, f"{parameter_count(self.model):,}", self.ctx.device, self.total_steps,
                 max(1, self.loader.steps_per_epoch // accum), self.step_batch_size,
                 f" ({accum} accumulated batches of {self.loader.global_batch_size})" if accum > 1 else "",
                 f", resumed from step {resumed} in {self.checkpoint_root}" if resumed else "")
        window = self.cfg.train.profile_window()
        if window and self.ctx.is_main and not (resumed or 0) <= window[0] < self.end_step:
            log.warning("train.profile_steps %s: this run trains steps %d to %d, so nothing is profiled",
                        self.cfg.train.profile_steps, resumed or 0, self.end_step - 1)
        self.startup.mark("checkpoint look-up")
        return resumed

    def _run_steps(self) -> None:
        """The step loop proper, from the current (possibly resumed) step to the last."""
        cfg, progress = self.cfg, self.progress
        batches = endless(self.loader)
        self.model.train()
        first_step = progress.step + 1
        while progress.step < self.end_step:
            with self.telemetry.data_wait():
                micro_batches = [next(batches) for _ in range(self.accum)]
            self.profiler.on_step(progress.step)
            loss = train_step(self.model, self.optimizer, self.scheduler, micro_batches, cfg,
                              before_update=self.checkpointer.wait_for_snapshot)
            if self.ema is not None:
                self.ema.update()
            progress.step += 1
            step, last = progress.step, progress.step == self.end_step
            self.telemetry.step_done(step, loss, self.scheduler.get_last_lr()[0], self.loader.take_digest())
            if step == first_step:
                self._membership_change(step)
                tighten_timeout(cfg.dist)  # start-up is over: a hung peer should now fail fast
                self.startup.mark("first step")
                self.telemetry.log_startup(step, self.startup)
                self.telemetry.log_state_bytes(step, *state_bytes(self.model, self.optimizer))
            if step % cfg.train.gc_every == 0:
                gc.collect()
            validated = stop_early = None
            if last or (cfg.train.eval_every and step % cfg.train.eval_every == 0):
                self.validated = validated = self._validate(step)
                stop_early = self.early_stopping.observe(step, validated)  # the same on every rank
            agreed = self.preemption.agree(save_due=self.checkpointer.interval_elapsed())
            saved = self.checkpointer.maybe_save(step, last_step=last or stop_early, interval_due=agreed.save,
                                                 metrics=validated)
            if stop_early:
                self.stopped_early = True
                log.info("%s", self.early_stopping.reason(step))
                break
            if not last and agreed.stop:
                self._stop_preempted(step, saved)
        self.preemption.finish()
        self.checkpointer.wait()

    def _membership_change(self, step: int) -> None:
        """At the first step after a resume at another world size: its line (every rank knows the change,
        rank 0 prints it) and its record."""
        if not (self.membership.changed and self.ctx.is_main):
            return
        record = self.membership.record(step - 1, self.last_logged, time.time())
        self.telemetry.log_membership(step, record)

    def _ema(self) -> EMA:
        """The average of the weights (optim.ema_decay), sharded as the model is."""
        cfg, ctx = self.cfg, self.ctx

        def sharded_copy() -> nn.Module:
            twin = build_model(cfg.model, self.manifest.num_classes, self.manifest.shape).to(ctx.device)
            return parallelize(twin, model_units(twin, cfg), cfg.dist, ctx, bf16=cfg.train.bf16)

        sharded = cfg.dist.parallelism == "fsdp" and ctx.distributed
        return EMA(self.model, cfg.optim.ema_decay, sharded_copy if sharded else None)

    def _validate(self, step: int) -> dict[str, float]:
        """Validate on the val split (the average of the weights, when on), log it, and return it as a
        checkpoint records it (val_accuracy, val_loss)."""
        model = self.ema.model if self.ema is not None else self.model
        val = validate(model, self.val_split, self.cfg.loader.eval_batch_size, self.ctx)
        self.telemetry.log_eval(step, val)
        return {f"val_{name}": value for name, value in val.items()}

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
        preempted = Preempted(step, self.preemption.signal_name or "a signal", checkpoint,
                              resumes_from=self.checkpointer.committed)
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
                            records=self.records.target.uri if self.records is not None else "",
                            metric=self.early_stopping.metric, best_step=self.early_stopping.best_step,
                            best_value=self.early_stopping.best, stopped_early=self.stopped_early,
                            membership_changes=self.membership.changes,
                            steps_redone=self.membership.steps_redone,
                            seconds_lost=round(self.membership.seconds_lost, 3))


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


def training_loader(cfg: Config, data: Store, ctx: DistContext, stack: ExitStack,
                    accum: int = 1) -> tuple[StagedLoader, StagedSplit | StreamedSplit]:
    """This rank's resumable loader over the train split (autotuned when asked), and the val split; a
    dataset in an object store is streamed, its cache closed by ``stack`` with the run; ``accum`` batches
    to an optimizer step."""
    normalization = (cfg.data.mean, cfg.data.std) if cfg.data.mean else None
    if data.local:
        train_split, val_split = (StagedSplit(data.path, split, normalization=normalization)
                                  for split in ("train", "val"))
    else:
        train_split, val_split = open_streamed(data, ("train", "val"), cache_limit(cfg.loader.cache_bytes),
                                               normalization=normalization)
        for split in (train_split, val_split):
            stack.callback(split.close)
    if cfg.train.overfit:  # fit a few samples, and measure the fit on those same samples
        train_split = val_split = train_split.first(cfg.train.overfit)
    loader_cfg = cfg.loader
    if loader_cfg.autotune and not train_split.remote:  # the probe times DataLoader workers, which a
        # streamed split does not use (its own threads fetch ahead)
        loader_cfg = autotune(train_split, loader_cfg, rank=ctx.rank, world_size=ctx.world_size,
                              seed=cfg.train.seed, device=ctx.device)
    loader = StagedLoader(train_split, loader_cfg, rank=ctx.rank, world_size=ctx.world_size,
                          seed=cfg.train.seed, device=ctx.device, accum=accum)
    return loader, val_split


def model_units(model: nn.Module, cfg: Config) -> list[nn.Module]:
    """The blocks FSDP shards one by one (none under DDP)."""
    return shard_units(model, cfg.model.name) if cfg.dist.parallelism == "fsdp" else []


def optimizer_and_schedule(cfg: Config, model: nn.Module, steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """optim.name over the model's parameters and its LR schedule (optim.schedule) over ``steps``."""
    optim = cfg.optim
    groups = optimizer_groups(unwrap_model(model), cfg)  # by canonical name (optim.param_groups)
    if optim.name == "sgd":
        optimizer = torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum,
                                    nesterov=optim.nesterov, weight_decay=optim.weight_decay, foreach=True)
    else:
        optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2),
                                      weight_decay=optim.weight_decay, foreach=True)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, steps))
