"""Process-group setup from the torchrun / torch elastic environment, and its teardown.

A single process with no launcher env runs without a process group. With CUDA the backend is
"cpu:gloo,cuda:nccl": NCCL for gradients, gloo for CPU collectives (async checkpointing needs one).
Start-up gets a generous timeout (slow image pulls, rendezvous); once the first step has run, the
timeout is cut so a hung peer fails the job in minutes rather than the start-up allowance.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from traincore.config import DistConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    """Where this process sits: rank, world size, and the device it trains on."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launch_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the launcher's environment, (0, 1, 0) without one."""
    try:
        return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                int(os.environ.get("LOCAL_RANK", 0)))
    except ValueError as exc:
        raise ValueError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers ({exc}); "
                         "launch with torchrun") from exc


def resolve_backend(cfg: DistConfig, cuda: bool) -> str:
    """The backend string for init_process_group; NCCL without CUDA is a configuration error."""
    if cfg.backend == "auto":
        return "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if "nccl" in cfg.backend and not cuda:
        raise ValueError(f"dist.backend={cfg.backend!r} needs CUDA, which this machine lacks: "
                         "use 'auto' or 'gloo'")
    return cfg.backend


def pick_device(local_rank: int) -> torch.device:
    """cuda:<local_rank> when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


@contextlib.contextmanager
def distributed(cfg: DistConfig) -> Iterator[DistContext]:
    """Initialise the process group (when launched with several ranks) and always tear it down."""
    rank, world_size, local_rank = launch_env()
    device = pick_device(local_rank)
    ctx = DistContext(rank, world_size, local_rank, device)
    started = False
    if world_size > 1 and not dist.is_initialized():
        backend = resolve_backend(cfg, device.type == "cuda")
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.init_timeout_s))
        started = True
        log.info("process group up: backend %s, world size %d, device %s", backend, world_size, device)
    try:
        if started:
            dist.barrier()
        yield ctx
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()


def tighten_timeout(cfg: DistConfig) -> None:
    """Lower the default group's timeout to ``cfg.step_timeout_s`` once training runs."""
    if not dist.is_initialized():
        return
    dist.set_timeout(timedelta(seconds=cfg.step_timeout_s))
    log.debug("process-group timeout now %d s", cfg.step_timeout_s)


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few floats across ranks (identity without a process group)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor.tolist()
