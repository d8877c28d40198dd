"""Metric sinks for rank 0: JSONL always, TensorBoard and Weights & Biases as configured.

Each sink takes ``log(step, metrics, kind)``, ``resumed_at(step)`` and ``close()``; :func:`build_sinks`
opens the set a :class:`~traincore.config.TelemetryConfig` asks for.

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
import ipaddress
import json
import os
import re
import socket
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import BinaryIO, Protocol, TextIO

from traincore.config import TelemetryConfig
from traincore.files import publish, temporary_sibling


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
            self._writer.add_scalar(f"{kind}/{name}", float(value), step, new_style=True)

    def _open(self):
        # Imported here, at the first interval: with what it brings along (boto3, through tensorboard's
        # file-system layer) it would add about 0.4 s to every run's start-up.
        from torch.utils.tensorboard import SummaryWriter

        if gc.get_freeze_count():
            # The first log comes after the training loop froze the heap (traincore.train.gc_paused); frozen
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


def resolve_wandb_key(mode: str) -> str | None:
    """The W&B API key for ``mode``: from WANDB_API_KEY or the file named by WANDB_API_KEY_FILE.

    Only "online" needs one; it raises ValueError without one or with one that is malformed
    (:func:`wandb_key_problem`), so the run fails before training. The key never appears in a message.
    """
    if mode != "online":
        return None
    key = os.environ.get("WANDB_API_KEY", "").strip()
    key_file = os.environ.get("WANDB_API_KEY_FILE", "")
    if not key and key_file:
        try:
            key = Path(key_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"WANDB_API_KEY_FILE={key_file!r} cannot be read ({exc.strerror}); "
                             "mount the secret at that path or set WANDB_API_KEY") from None
    if not key:
        raise ValueError("telemetry.wandb_mode='online' needs a W&B API key: set WANDB_API_KEY or "
                         "WANDB_API_KEY_FILE (a mounted secret file), or use wandb_mode='offline' "
                         "(no network, sync later) or 'disabled'")
    problem = wandb_key_problem(key)
    if problem:
        where = "WANDB_API_KEY" if os.environ.get("WANDB_API_KEY", "").strip() else (
            f"the file WANDB_API_KEY_FILE={key_file!r} names")
        raise ValueError(f"the W&B API key in {where} is malformed: {problem}. Copy the key again from "
                         "https://wandb.ai/authorize (a local server's key starts with 'local-') into "
                         "WANDB_API_KEY or the file WANDB_API_KEY_FILE names, with nothing around it; or use "
                         "telemetry.wandb_mode='offline' or 'disabled'")
    return key


# The shape of a W&B API key, as wandb itself checks it before any request (wandb 0.31.0,
# wandb/sdk/lib/wbauth/validation.py, check_api_key): a JWT (three base64url parts joined by dots), or an
# optional "<prefix>-" (keys of on-prem and local servers, e.g. "local-...") before a secret of at least 40
# letters, digits, underscores or dashes (cloud keys are 40 hex digits).
_WANDB_JWT = re.compile(r"[\w-]+\.[\w-]+\.[\w-]+")
_WANDB_SECRET = re.compile(r"[\w-]+")
WANDB_SECRET_MIN = 40


def wandb_key_problem(key: str) -> str | None:
    """What makes ``key`` no W&B API key by wandb's own format rule (above), or None; checked without any
    network, and the text never contains the key."""
    if _WANDB_JWT.fullmatch(key):
        return None
    secret = key.split("-", 1)[-1]  # wandb splits at the first dash, too
    if not _WANDB_SECRET.fullmatch(secret):
        return "it holds characters other than letters, digits, underscores and dashes (quotes, spaces?)"
    if len(secret) < WANDB_SECRET_MIN:
        return f"its secret part has {len(secret)} characters, a W&B key's has at least {WANDB_SECRET_MIN}"
    return None


WANDB_DEFAULT_BASE_URL = "https://api.wandb.ai"
WANDB_PROBE_TIMEOUT_S = 5.0
"""How long :func:`check_wandb_reachable` waits for the W&B server (name lookup and TCP connect); wandb
itself retries for ``init_timeout`` (90 s) before it gives up."""
WANDB_OFFLINE_FIX = ("set telemetry.wandb_mode='offline' (the run logs to <output>/wandb, in the train "
                     "task's logs output; upload it later from a machine with network access: wandb sync "
                     "<output>/wandb/offline-run-*) or 'disabled'")


class WandbError(ValueError):
    """W&B online mode cannot work here (its server is out of reach, or refuses the run); the message names
    the server, the cause and the fix."""


def wandb_base_url() -> str:
    """The W&B server wandb talks to: WANDB_BASE_URL, else W&B's cloud."""
    return os.environ.get("WANDB_BASE_URL", "").strip().rstrip("/") or WANDB_DEFAULT_BASE_URL


def check_wandb_reachable(mode: str, timeout_s: float = WANDB_PROBE_TIMEOUT_S) -> None:
    """For ``mode`` "online", WandbError unless a TCP connection to the W&B server (or to the proxy the
    environment routes it through: HTTPS_PROXY, HTTP_PROXY, NO_PROXY) opens within ``timeout_s``.

    Without this, a machine with no egress (a cluster pod, say) would fail only once training has begun,
    on rank 0, after wandb's own 90 s of retries."""
    if mode != "online":
        return
    base = wandb_base_url()
    target, via = _wandb_route(_url(base, "WANDB_BASE_URL", "https"))
    host, port = target.hostname, target.port or (443 if target.scheme == "https" else 80)
    problem = _connect_problem(host, port, timeout_s)
    if problem:
        raise WandbError(f"telemetry.wandb_mode='online' but this machine cannot reach the W&B server {base}"
                         f"{via} ({host}:{port}: {problem}); no network egress here? Either let it reach "
                         f"{host}:{port}, set WANDB_BASE_URL to a W&B server it can reach, or "
                         f"{WANDB_OFFLINE_FIX}")


def _wandb_route(server: urllib.parse.SplitResult) -> tuple[urllib.parse.SplitResult, str]:
    """Where wandb's connection to ``server`` goes first, and the words that say so: the proxy the
    environment names for its scheme, else the server itself. As in wandb's Go client (its net/http), NO_PROXY
    exempts a host, and a loopback one never goes through a proxy."""
    proxy = urllib.request.getproxies().get(server.scheme)
    if not proxy or _loopback(server.hostname) or urllib.request.proxy_bypass(server.hostname):
        return server, ""
    return _url(proxy, f"{server.scheme.upper()}_PROXY", "http"), f" through the proxy {proxy}"


def _url(text: str, name: str, scheme: str) -> urllib.parse.SplitResult:
    """``text`` (from the environment variable ``name``) parsed as a URL, ``scheme`` when it names none;
    WandbError unless it has a host and a valid port."""
    url = urllib.parse.urlsplit(text if "://" in text else f"{scheme}://{text}")
    try:
        if url.hostname and url.port != 0:  # .port raises ValueError for one out of range or not a number
            return url
    except ValueError:
        pass
    raise WandbError(f"{name}={text!r} is not a server's URL: set it to one with a host (and a port from 1 "
                     "to 65535, if any), or unset it")


def _loopback(host: str) -> bool:
    """Whether ``host`` is this machine: "localhost" or a loopback address."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost
        return False


def _connect_problem(host: str, port: int, timeout_s: float) -> str | None:
    """Why a TCP connection to ``host:port`` does not open within ``timeout_s``, or None once it does.

    In a thread, because the name lookup has no timeout of its own (a resolver that gets no answer retries
    for tens of seconds); the daemon thread is left to finish it on its own."""
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(None)
        except socket.gaierror as exc:
            outcome.append(f"the name does not resolve: {exc.strerror}")
        except TimeoutError:
            outcome.append(f"no answer within {timeout_s:g} s")
        except OSError as exc:
            outcome.append((exc.strerror or str(exc) or type(exc).__name__).lower())

    thread = threading.Thread(target=connect, name="wandb-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return outcome[0] if outcome else f"no answer within {timeout_s:g} s"


class WandbSink:
    """A Weights & Biases run under ``<output>/wandb``; "offline" needs neither network nor key.

    The key is checked here (:func:`resolve_wandb_key`); the W&B run starts at ``resumed_at`` (or the first
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
            return wandb.init(mode=self._cfg.wandb_mode, dir=self._output_dir,
                              project=self._cfg.wandb_project, config=self._run_config, settings=settings)
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
        self._run.log({f"{kind}/{name}": value for name, value in metrics.items()}, step=step)

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
