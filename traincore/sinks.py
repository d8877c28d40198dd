"""Metric sinks for rank 0: JSONL always, TensorBoard and Weights & Biases as configured.

Each sink takes ``log(step, metrics, kind)`` and ``close()``; :func:`build_sinks` opens the set a
:class:`~traincore.config.TelemetryConfig` asks for.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Protocol

from traincore.config import TelemetryConfig


class MetricSink(Protocol):
    """Where rank 0 sends metrics; ``kind`` is "train" or "eval"."""

    def log(self, step: int, metrics: dict[str, float], kind: str = "train") -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """``<output>/metrics.jsonl``: one JSON object per line, flushed at once so a crash loses nothing."""

    RESERVED = ("step", "time", "kind")

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")  # append: a resumed run continues the file

    def log(self, step: int, metrics: dict[str, float], kind: str = "train") -> None:
        """Append one record ``{"step", "time", "kind", **metrics}``."""
        clash = [name for name in self.RESERVED if name in metrics]
        if clash:
            raise ValueError(f"metric names {clash} are reserved in metrics.jsonl; rename them")
        record = {"step": step, "time": time.time(), "kind": kind, **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._file.close()


class TensorBoardSink:
    """``<output>/tensorboard`` event files; scalars under ``train/...`` and ``eval/...``."""

    def __init__(self, output_dir: str | Path, cfg: TelemetryConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(Path(output_dir) / "tensorboard"), max_queue=cfg.tb_max_queue,
                                     flush_secs=cfg.tb_flush_secs)

    def log(self, step: int, metrics: dict[str, float], kind: str = "train") -> None:
        """Queue one scalar per metric; new_style writes the compact tensor-summary format."""
        for name, value in metrics.items():
            self._writer.add_scalar(f"{kind}/{name}", value, global_step=step, new_style=True)

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        self._writer.close()


def resolve_wandb_key(mode: str) -> str | None:
    """The W&B API key for ``mode``: from WANDB_API_KEY or the file named by WANDB_API_KEY_FILE.

    Only "online" needs one; it raises ValueError without one, so the run fails before training.
    The key itself never appears in a message.
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
    return key


class WandbSink:
    """A Weights & Biases run under ``<output>/wandb``; "offline" needs neither network nor key."""

    def __init__(self, output_dir: str | Path, cfg: TelemetryConfig, run_config: dict) -> None:
        import wandb

        key = resolve_wandb_key(cfg.wandb_mode)
        if cfg.wandb_mode == "offline":
            # wandb's process-wide analytics follow the global settings, not the run's mode: without
            # this, an offline run still probes the W&B server over the network.
            wandb.setup(wandb.Settings(mode="offline"))
        # The key goes through Settings, never the environment or the run config, so it is not
        # inherited by child processes or stored with the run.
        settings = wandb.Settings(api_key=key) if key else None
        self._run = wandb.init(mode=cfg.wandb_mode, dir=str(output_dir), project=cfg.wandb_project,
                               config=run_config, settings=settings)
        self._closed = False

    def log(self, step: int, metrics: dict[str, float], kind: str = "train") -> None:
        """Log ``kind/name`` scalars at ``step``."""
        self._run.log({f"{kind}/{name}": value for name, value in metrics.items()}, step=step)

    def close(self) -> None:
        """Finish the run (idempotent)."""
        if not self._closed:
            self._closed = True
            self._run.finish()


def build_sinks(cfg: TelemetryConfig, output_dir: str | Path, run_config: dict) -> list[MetricSink]:
    """JSONL always, then TensorBoard and W&B as configured; closes what it opened if one fails."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    sinks: list[MetricSink] = [JsonlSink(output_dir)]
    try:
        if cfg.tensorboard:
            sinks.append(TensorBoardSink(output_dir, cfg))
        if cfg.wandb_mode != "disabled":
            sinks.append(WandbSink(output_dir, cfg, run_config))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
