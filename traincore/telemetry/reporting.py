"""Logging setup, the progress display and the per-interval training telemetry.

Every rank builds a :class:`Telemetry` and calls it every step; only rank 0 writes files, so the
other ranks cost one all-reduce per logging interval and nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from traincore.config import TelemetryConfig
from traincore.telemetry.metrics import IntervalMeter, RunTotals, WaitTimer, memory_metrics, peak_flops
from traincore.telemetry.sinks import JsonlSink, MetricSink, build_sinks
from traincore.telemetry.startup import StartupClock
from traincore.telemetry.wandb_access import resolve_wandb_key

if TYPE_CHECKING:  # the run imports telemetry, never the reverse
    from traincore.run import DistContext

logger = logging.getLogger(__name__)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_HANDLER_NAME = "traincore"


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time, so a live progress bar can redirect it."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass  # always follow sys.stderr


class _BriefLibraryFormatter(logging.Formatter):
    """Other libraries' records with their exception's class instead of its traceback: gcsfs logs a 40-line
    aiohttp traceback for each request it gives up on, before the command's own error names the cause
    (`registry list gs://...` without a network printed 50 lines before its one). Our own records keep
    theirs."""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info and record.exc_info[1] is not None and not record.name.startswith("traincore"):
            message = f"{record.getMessage()} [{type(record.exc_info[1]).__name__}; traceback not shown]"
            record = logging.makeLogRecord({**record.__dict__, "msg": message, "args": None,
                                            "exc_info": None, "exc_text": None})
        return super().format(record)


@contextlib.contextmanager
def logging_setup(level: str = "INFO", rank: int | None = 0,
                  library_tracebacks: bool = True) -> Iterator[None]:
    """Our handler on the root logger, and its level, for the run; both restored on exit, so a process
    that trains in-process (a notebook, a Flyte task) keeps its own logging configuration afterwards.

    Ranks > 0 log WARNING and above only, so N ranks do not print every line N times; ``rank`` None (a
    command that is no rank of a run) leaves the rank out of each line. Without ``library_tracebacks``,
    other libraries' records show their exception's class, not its traceback.
    """
    if str(level).upper() not in LOG_LEVELS:
        raise ValueError(f"log level {level!r} is unknown; use one of {', '.join(LOG_LEVELS)}")
    root = logging.getLogger()
    before, theirs = root.level, [h for h in root.handlers if h.get_name() == _HANDLER_NAME]
    for handler in theirs:  # an enclosing run's handler (a run inside a run): ours replaces it meanwhile
        root.removeHandler(handler)
    handler = _CurrentStderrHandler()
    handler.set_name(_HANDLER_NAME)
    tag = "" if rank is None else f" [rank {rank}]"
    formatter = logging.Formatter if library_tracebacks else _BriefLibraryFormatter
    handler.setFormatter(formatter(f"%(asctime)s %(levelname)s{tag} %(name)s: %(message)s"))
    root.addHandler(handler)
    numeric = logging.getLevelName(str(level).upper())
    root.setLevel(numeric if not rank else max(numeric, logging.WARNING))
    try:
        yield
    finally:
        root.removeHandler(handler)
        for handler in theirs:
            root.addHandler(handler)
        root.setLevel(before)


class ProgressBar:
    """A rich progress bar for rank 0; log lines emitted while it runs print above it."""

    def __init__(self, total_steps: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                  TimeRemainingColumn(), TextColumn("{task.fields[line]}"))
        self._task = self._progress.add_task("train", total=total_steps, line="")
        self._progress.start()

    def update(self, step: int, line: str | None = None) -> None:
        """Move to ``step``; ``line`` replaces the metrics shown next to the bar."""
        fields = {} if line is None else {"line": line}
        self._progress.update(self._task, completed=step, **fields)

    def close(self) -> None:
        """Stop the live display (idempotent)."""
        self._progress.stop()


def wants_progress_bar(mode: str) -> bool:
    """"on" always, "auto" only when stdout is a terminal, "off" never."""
    return mode == "on" or (mode == "auto" and sys.stdout.isatty())


def format_interval(step: int, total_steps: int, metrics: dict[str, float]) -> str:
    """One human line per interval, e.g. ``step 40/200 | loss 0.8123 | lr 1.0e-03 | ...``."""
    mfu = f"{metrics['mfu']:.1%}" if "mfu" in metrics else "n/a"
    line = (f"step {step}/{total_steps} | loss {metrics['loss']:.4f} | lr {metrics['lr']:.1e} | "
            f"{metrics['samples_per_s']:.0f} samples/s | data-wait {metrics['data_wait_share']:.1%} | "
            f"mfu {mfu} | rss {metrics['host_rss_gib']:.1f} GiB")
    if "cuda_max_allocated_gib" in metrics:
        line += f" | cuda {metrics['cuda_max_allocated_gib']:.1f}/{metrics['cuda_max_reserved_gib']:.1f} GiB"
    return line


@dataclass(frozen=True)
class Workload:
    """What telemetry must know of the run to turn step times into progress, throughput and MFU."""

    total_steps: int
    global_batch_size: int
    flops_per_sample: float | None = None  # training FLOPs of one sample; None: MFU is not reported
    dtype: torch.dtype = torch.float32  # the dtype the run computes in: MFU is against that dtype's peak


class Telemetry:
    """Per-step meters and per-interval reporting for the training loop.

    ``step_done`` is cheap: the loss is summed on its device, and only every ``cfg.log_every``
    steps (and at the last step) one all-reduce brings it to the host, which is also the only
    device sync. Throughput and data-wait figures are rank 0's wall clock over the interval, which
    ends after that sync, so device work still queued at the last step is counted.
    """

    def __init__(self, cfg: TelemetryConfig, output_dir: str | Path, ctx: DistContext, workload: Workload,
                 run_config: dict | None = None) -> None:
        for name, value in (("world_size", ctx.world_size), ("total_steps", workload.total_steps),
                            ("global_batch_size", workload.global_batch_size)):
            if value < 1:
                raise ValueError(f"Telemetry {name}={value} is invalid: it must be >= 1")
        if not 0 <= ctx.rank < ctx.world_size:
            raise ValueError(f"Telemetry rank={ctx.rank} is outside world_size={ctx.world_size}: use "
                             f"0..{ctx.world_size - 1}")
        resolve_wandb_key(cfg.wandb_mode)  # every rank fails alike, before any training
        self.cfg, self.rank, self.world_size = cfg, ctx.rank, ctx.world_size
        self.total_steps, self.global_batch_size = workload.total_steps, workload.global_batch_size
        self.device = torch.device(ctx.device)
        self._created = time.perf_counter()
        self._wall_before = 0.0  # wall seconds of earlier attempts of the run (restored on resume)
        self._interval_start: float | None = None
        self._interval_wait_start = 0.0
        self._intervals = 0
        self._wait = WaitTimer()
        self._meter = IntervalMeter(self.device)
        self._totals = RunTotals()
        self._closed = False
        self._sinks: list[MetricSink] = []
        self._bar: ProgressBar | None = None
        self._flops_per_sample = workload.flops_per_sample
        self._peak: float | None = None
        if self.rank == 0:
            if workload.flops_per_sample:  # may raise: before any sink opens
                self._peak = peak_flops(self.device, workload.dtype)
            self._sinks = build_sinks(cfg, output_dir, run_config or {})
            self._bar = ProgressBar(self.total_steps) if wants_progress_bar(cfg.progress) else None

    def data_wait(self) -> WaitTimer:
        """Context manager for ``next(it)`` and the host-to-device wait: its time is data-wait."""
        return self._wait

    def step_done(self, step: int, loss: torch.Tensor, lr: float, digest: int = 0) -> dict[str, float] | None:
        """Record a finished step and the digest of the samples this rank took in it; at interval ends
        return the metrics on rank 0 (None elsewhere).

        Every rank must call it at every step: interval ends run an all-reduce.
        """
        if self._interval_start is None:
            first = self._wait.first_entry
            self._interval_start = self._created if first is None else first
        self._meter.add(loss, digest)
        if self._bar is not None:
            self._bar.update(step)
        if step % self.cfg.log_every and step != self.total_steps:
            return None
        return self._end_interval(step, lr)

    def _end_interval(self, step: int, lr: float) -> dict[str, float] | None:
        loss, digest = self._meter.reduce()
        now = time.perf_counter()
        steps, seconds = self._meter.steps, max(now - self._interval_start, 1e-9)
        wait = self._wait.seconds - self._interval_wait_start
        samples = float(steps * self.global_batch_size)
        # The first interval of a process holds start-up costs (compilation, allocator warm-up).
        self._totals.add_interval(steps, samples, seconds, wait, loss, warmup=self._intervals == 0)
        self._intervals += 1
        self._meter.reset()
        self._interval_start, self._interval_wait_start = now, self._wait.seconds
        if self.rank != 0:
            return None
        # world_size and global_batch on every row: an elastic run's world changes, its global batch not;
        # sample_digest: of every sample the interval's steps took, over all ranks (elastic runs check that
        # no sample of an epoch was skipped or taken twice by adding them up)
        metrics = {"loss": loss, "lr": float(lr), "samples_per_s": samples / seconds,
                   "step_time_s": seconds / steps, "data_wait_s": wait / steps,
                   "data_wait_share": min(wait / seconds, 1.0), "world_size": self.world_size,
                   "global_batch": self.global_batch_size, "sample_digest": digest}
        if self._peak and self._flops_per_sample:
            metrics["mfu"] = (self._flops_per_sample * metrics["samples_per_s"]
                              / (self._peak * self.world_size))
        metrics.update(memory_metrics(self.device))
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # peaks are per interval
        self._report(step, metrics)
        return metrics

    def _report(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self._sinks:
            sink.log(step, metrics, kind="train")
        line = format_interval(step, self.total_steps, metrics)
        if self._bar is not None:
            self._bar.update(step, line)
            logger.debug(line)
        else:
            logger.info(line)
        if not math.isfinite(metrics["loss"]):
            logger.warning("loss is %s at step %d", metrics["loss"], step)

    def log_startup(self, step: int, startup: StartupClock) -> None:
        """Log where start-up time went, and write it as one record of kind "startup" (rank 0 only)."""
        if self.rank != 0:
            return
        for sink in self._sinks:
            sink.log(step, startup.record(), kind="startup")
        logger.info(startup.describe())

    def log_state_bytes(self, step: int, param_bytes: int, optimizer_bytes: int) -> None:
        """Write what model state each rank holds, as kind "memory": the largest rank's parameter and
        optimizer-state bytes and their totals over the ranks (under FSDP, per rank ~ total / N). Every rank
        calls it (one all-reduce); rank 0 writes."""
        local = torch.tensor([param_bytes, optimizer_bytes], dtype=torch.float64, device=self.device)
        largest, total = local.clone(), local.clone()
        if self.world_size > 1:
            torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
            torch.distributed.all_reduce(total)
        if self.rank != 0:
            return
        record = {"param_bytes_per_rank": largest[0].item(), "optimizer_bytes_per_rank": largest[1].item(),
                  "param_bytes_total": total[0].item(), "optimizer_bytes_total": total[1].item()}
        for sink in self._sinks:
            sink.log(step, record, kind="memory")
        logger.info("model state per rank: parameters %.2f MiB, optimizer %.2f MiB (all ranks: %.2f MiB, "
                    "%.2f MiB)", *(value / 2**20 for value in record.values()))

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Write evaluation metrics as kind "eval" and log them (rank 0 only)."""
        if self.rank != 0:
            return
        try:
            values = {name: float(value) for name, value in metrics.items()}
        except (TypeError, ValueError) as exc:
            raise ValueError(f"eval metrics must be numbers, got {metrics!r} ({exc})") from None
        for sink in self._sinks:
            sink.log(step, values, kind="eval")
        logger.info("eval step %d | %s", step, " | ".join(f"{k} {v:.4f}" for k, v in values.items()))

    def log_membership(self, step: int, record: dict[str, float]) -> None:
        """Write a membership change (traincore.run.membership) as kind "membership" (rank 0 only)."""
        for sink in self._sinks:
            sink.log(step, record, kind="membership")

    def summary(self) -> dict[str, float]:
        """Totals: steps, samples_per_s (after warm-up if possible), data_wait_share, final_loss, wall_s."""
        totals = self._totals
        if totals.steady_seconds > 0:
            throughput = totals.steady_samples / totals.steady_seconds
        else:
            throughput = totals.samples / totals.seconds if totals.seconds > 0 else 0.0
        return {"steps": float(totals.steps), "samples_per_s": throughput,
                "data_wait_share": totals.wait_seconds / totals.seconds if totals.seconds > 0 else 0.0,
                "final_loss": totals.final_loss, "wall_s": self._wall_s()}

    def _wall_s(self) -> float:
        return self._wall_before + time.perf_counter() - self._created

    def state_dict(self) -> dict[str, float]:
        """Run totals and wall time so far, so a resumed run's summary covers the whole run."""
        return {**self._totals.state_dict(), "wall_s": self._wall_s()}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore totals saved by ``state_dict``."""
        state = dict(state)
        self._wall_before = float(state.pop("wall_s", 0.0))
        self._totals.load_state_dict(state)

    def resumed_at(self, step: int) -> tuple[int, float] | None:
        """The run continues after ``step`` (0: it starts fresh); call once, before the first ``step_done``.

        An earlier attempt in this output directory may have logged steps after its last checkpoint; they
        are trained again now, so every sink forgets them (metrics.jsonl drops their records, TensorBoard
        purges their events) and each step is reported once. Returns the (step, time) of the newest step
        metrics.jsonl held before (None without one). Rank 0 only; a no-op elsewhere.
        """
        last = None
        for sink in self._sinks:
            if isinstance(sink, JsonlSink):
                last = sink.last_step()
            sink.resumed_at(step)
        if self._bar is not None:
            self._bar.update(step)
        return last

    def close(self) -> None:
        """Stop the progress bar and flush and close every sink; idempotent and never raises."""
        if self._closed:
            return
        self._closed = True
        closers = ([self._bar.close] if self._bar is not None else []) + [s.close for s in self._sinks]
        for close in closers:
            try:
                close()
            except Exception:  # a failing sink must not hide the error that ended the run
                logger.warning("closing telemetry output failed", exc_info=True)

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
