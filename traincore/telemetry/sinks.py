"""Metric sinks for rank 0: JSONL always, TensorBoard and Weights & Biases as configured.

Each sink takes ``log(step, metrics, kind)``, ``resumed_at(step)`` and ``close()``; :func:`build_sinks`
opens the set a :class:`~traincore.config.schema.TelemetryConfig` asks for.

Resuming: an attempt killed after its last checkpoint (step S) had already logged steps S+1..K, and the
resumed attempt trains and logs them again. ``resumed_at(S)`` (called by Telemetry once the checkpoint is
loaded, with S=0 for a fresh start) makes every step appear once: JSONL drops its records of steps > S,
TensorBoard opens its writer with ``purge_step=S+1`` so readers hide the orphaned events, and W&B starts
the attempt's run (every attempt is a run of its own).

Nothing is written before that call or the first record: metrics.jsonl is opened, the TensorBoard writer
and the W&B run are started only then, so a run whose resume fails (a checkpoint that does not fit) leaves
the output as it found it.

TensorBoard's event files are written by ``torch.utils.tensorboard.SummaryWriter``, whose format and purge
handling tensorboard maintains. What it costs, measured on a 2-core CPU machine:

- start-up: nothing. Importing this module or ``traincore.train`` loads no tensorboard, and building the
  sink takes about 60 us; the writer is imported at the first ``log``, right after the first step. That
  import takes about 0.4 s, half of it boto3, which tensorboard's file-system layer imports whenever it is
  installed (no option turns that off).
- per interval: about 1 ms of CPU for the 7 scalars of a CPU run, one event each (0.3 ms in ``log``, the
  rest on the writer's thread, which checksums every record in pure Python and appends it to the file):
  about 1.5% of the MLP's 20-step interval in bench/step.py and 0.1% of the digits CNN's. The writer's
  options do not change that work (``max_queue`` only bounds its queue, and a local file is appended to
  per event whatever ``flush_secs`` says); one event per interval instead of one per scalar would save
  about a third. tensorboard has no C CRC-32C to pick up; tensorboardX would use the ``crc32c`` package,
  but it imports boto3 and google-cloud-storage as well, passes every event through a multiprocessing
  queue and writes only old-style scalars.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import BinaryIO, Protocol, TextIO

from traincore.config import TelemetryConfig
from traincore.files import publish, temporary_sibling
from traincore.telemetry.wandb_access import WANDB_OFFLINE_FIX, WandbError, resolve_wandb_key, wandb_base_url

CHECKS_ONLY = frozenset({"sample_digest"})
"""Fields metrics.jsonl keeps but TensorBoard and W&B do not plot: a digest is a check, not a curve."""


class MetricSink(Protocol):
    """Where rank 0 sends metrics; ``kind`` is "train", "eval" or "startup" (once per attempt)."""

    def log(self, step: int, metrics: dict[str, float], kind: str = "train") -> None: ...

    def resumed_at(self, step: int) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """``<output>/metrics.jsonl``: one JSON object per line, flushed at once so a crash loses nothing.

    The file is opened (created, or appended to: a resumed run continues it) at the first record, not
    here: a run that fails before it knows where it starts (a checkpoint that does not fit) leaves the file
    as it was, or absent.
    """

    RESERVED = ("step", "time", "kind")

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self._file: TextIO | None = None

    def log(self, step: int, metrics: dict[str, float], kind: str = "train") -> None:
        """Append one record ``{"step", "time", "kind", **metrics}``."""
        clash = [name for name in self.RESERVED if name in metrics]
        if clash:
            raise ValueError(f"metric names {clash} are reserved in metrics.jsonl; rename them")
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        record = {"step": step, "time": time.time(), "kind": kind, **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def last_step(self) -> tuple[int, float] | None:
        """(step, time) of the newest training record in the file; None without one."""
        try:
            lines = self.path.read_bytes().splitlines()
        except FileNotFoundError:
            return None
        for line in reversed(lines):
            try:
                record = json.loads(line)
            except ValueError:  # a torn last line
                continue
            if record.get("kind") == "train":
                return int(record["step"]), float(record["time"])
        return None

    def resumed_at(self, step: int) -> None:
        """Drop the records of steps after ``step`` (and a torn last line): the resumed run logs them again.

        The file is rewritten only when something is dropped, atomically (a temporary sibling, fsync'd,
        renamed over it), so a crash during the rewrite leaves either the old file or the new one. The lines
        before the first dropped one are copied as they are, without parsing them twice.
        """
        self.close()
        try:
            old = open(self.path, "rb")
        except FileNotFoundError:  # the first attempt in this directory: nothing to drop
            return
        with old:
            kept_bytes = 0
            for line in old:
                if not (line.endswith(b"\n") and _keeps(line, step)):
                    break
                kept_bytes += len(line)
            else:
                kept_bytes = None  # nothing to drop
            if kept_bytes is not None:
                old.seek(0)
                _replace_atomically(self.path, old, kept_bytes, step)

    def close(self) -> None:
        """Close the file, if it was opened (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardSink:
    """``<output>/tensorboard`` event files, through ``torch.utils.tensorboard.SummaryWriter``; scalars
    under ``train/...``, ``eval/...`` and ``startup/...``, one ``add_scalar(new_style=True)`` each.

    The writer is imported and opened at the first ``log``, not here: the import is off the way to the
    first step, and a resume can still set the purge step. ``SummaryWriter(purge_step=S)`` starts its file
    with a session-start event at S, and TensorBoard discards the events of step S and later that came
    before it (the killed attempt's), in every earlier event file of the directory. TensorBoard reads the
    first session start of a directory as the beginning and only later ones as restarts, so a fresh run
    opens with one too (``resumed_at(0)``: purge step 1).

    ``max_queue`` bounds the events waiting for the writer's thread (a full queue blocks ``log``);
    ``flush_secs`` is how often that thread flushes. Into a local directory every event is appended to the
    file as soon as the thread takes it, so a killed run loses at most the events still queued.
    """

    def __init__(self, output_dir: str | Path, max_queue: int = TelemetryConfig.tb_max_queue,
                 flush_secs: int = TelemetryConfig.tb_flush_secs) -> None:
        self.directory = Path(output_dir) / "tensorboard"
        self._max_queue, self._flush_secs = max_queue, flush_secs
        self._writer = None
        self._purge_step: int | None = None

    def log(self, step: int, metrics: dict[str, float], kind: str = "train") -> None:
        """Queue one scalar event per metric; the writer's thread writes them."""
        if self._writer is None:
            self._writer = self._open()
        for name, value in metrics.items():
            if name not in CHECKS_ONLY:
                self._writer.add_scalar(f"{kind}/{name}", float(value), step, new_style=True)

    def _open(self):
        # Imported here, at the first interval: with what it brings along (boto3, through tensorboard's
        # file-system layer) it would add about 0.4 s to every run's start-up.
        from torch.utils.tensorboard import SummaryWriter

        if gc.get_freeze_count():
            # The first log comes after the training loop froze the heap (traincore.run.trainer.gc_paused);
            # frozen
            # too, the ~20,000 objects of the modules just imported stay out of its scheduled collections,
            # each of which would otherwise walk them (25 ms, on every collection to the end of the run).
            gc.freeze()
        return SummaryWriter(str(self.directory), purge_step=self._purge_step, max_queue=self._max_queue,
                             flush_secs=self._flush_secs)

    def resumed_at(self, step: int) -> None:
        """Hide the events of steps after ``step``: the next event file opens with purge step ``step + 1``."""
        self._purge_step = step + 1
        if self._writer is not None:  # something was logged before the resume: start a new event file
            self._writer.close()
            self._writer = None

    def close(self) -> None:
        """Write what is queued and close the event file (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbSink:
    """A Weights & Biases run under ``<output>/wandb``; "offline" needs neither network nor key.

    The key is checked here (``resolve_wandb_key``); the W&B run starts at ``resumed_at`` (or the first
    ``log``), so a run that fails before it knows where it starts (a checkpoint that does not fit) adds no
    run to the project.
    """

    def __init__(self, output_dir: str | Path, cfg: TelemetryConfig, run_config: dict) -> None:
        self._output_dir, self._cfg, self._run_config = str(output_dir), cfg, run_config
        self._key = resolve_wandb_key(cfg.wandb_mode)
        self._run = None

    def _start(self):
        import wandb

        if self._cfg.wandb_mode == "offline":
            # wandb's process-wide analytics follow the global settings, not the run's mode: without
            # this, an offline run still probes the W&B server over the network.
            wandb.setup(wandb.Settings(mode="offline"))
        # The key goes through Settings, never the environment or the run config, so it is not
        # inherited by child processes or stored with the run.
        settings = wandb.Settings(api_key=self._key) if self._key else None
        try:
            cfg = self._cfg
            return wandb.init(mode=cfg.wandb_mode, dir=self._output_dir, project=cfg.wandb_project,
                              entity=cfg.wandb_entity or None, name=cfg.wandb_run_name or None,
                              tags=cfg.wandb_tags or None, config=self._run_config, settings=settings)
        except wandb.errors.Error as exc:
            # One line with the cause: wandb's traceback runs through its service and says nothing more.
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise WandbError(self._start_failure(reason)) from None

    def _start_failure(self, reason: str) -> str:
        """The one-line error of a W&B run that did not start: the cause (wandb's words) and the fix."""
        if self._cfg.wandb_mode == "offline":
            return (f"W&B could not start its offline run under {self._output_dir}/wandb: {reason}. Check "
                    "that the output directory is writable, or set telemetry.wandb_mode='disabled'")
        return (f"W&B could not start the online run (server {wandb_base_url()}, project "
                f"{self._cfg.wandb_project!r}): {reason}. Check the API key, the project and this machine's "
                f"network access to the server, or {WANDB_OFFLINE_FIX}")

    def log(self, step: int, metrics: dict[str, float], kind: str = "train") -> None:
        """Log ``kind/name`` scalars at ``step``."""
        if self._run is None:
            self._run = self._start()
        self._run.log({f"{kind}/{name}": value for name, value in metrics.items() if name not in CHECKS_ONLY},
                      step=step)

    def resumed_at(self, step: int) -> None:
        """Start the W&B run (nothing to drop: every attempt logs to a run of its own, from ``step`` on)."""
        if self._run is None:
            self._run = self._start()

    def close(self) -> None:
        """Finish the run, if it started (idempotent)."""
        run, self._run = self._run, None
        if run is not None:
            run.finish()


def _keeps(line: bytes, step: int) -> bool:
    """Whether a metrics.jsonl line stays when a run resumes after ``step``: not torn nor of a later step."""
    try:
        record = json.loads(line)
    except ValueError:  # torn by a crash mid-write (or not text at all)
        return False
    return not (isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step)


def _replace_atomically(path: Path, old: BinaryIO, prefix: int, step: int) -> None:
    """Rewrite ``path`` as the first ``prefix`` bytes of ``old`` and then its later lines that
    :func:`_keeps`, through a temporary sibling that is fsync'd and renamed over ``path``."""
    tmp = temporary_sibling(path)
    with open(tmp, "wb") as new:
        while prefix:
            block = old.read(min(prefix, 1 << 20))
            new.write(block)
            prefix -= len(block)
        for line in old:
            if _keeps(line, step):
                new.write(line if line.endswith(b"\n") else line + b"\n")
    publish(tmp, path)


def build_sinks(cfg: TelemetryConfig, output_dir: str | Path, run_config: dict) -> list[MetricSink]:
    """JSONL always, then TensorBoard and W&B as configured; closes what it opened if one fails."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    sinks: list[MetricSink] = [JsonlSink(output_dir)]
    try:
        if cfg.tensorboard:
            sinks.append(TensorBoardSink(output_dir, cfg.tb_max_queue, cfg.tb_flush_secs))
        if cfg.wandb_mode != "disabled":
            sinks.append(WandbSink(output_dir, cfg, run_config))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
