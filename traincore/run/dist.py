"""Process-group setup from the torchrun / torch elastic environment, and its teardown.

A single process with no launcher env runs without a process group. With CUDA the backend is
"cpu:gloo,cuda:nccl": NCCL for gradients, gloo for CPU collectives (async checkpointing needs one).
Start-up gets a generous timeout (slow image pulls, rendezvous); once the first step has run, the
timeout is cut so a hung peer fails the job in minutes rather than the start-up allowance.

Under torch elastic (torchrun, flytekit's Elastic task) the workers are clients of the agent's TCPStore,
which outlives restarts of the worker group; each attempt gets a key namespace of its own there
(:func:`attempt_store`), so a restarted group never reads the dead attempt's keys.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

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


def attempt_store(timeout: timedelta) -> dist.Store | None:
    """This restart attempt's namespace in torch elastic's agent store; None when there is no agent store.

    With ``TORCHELASTIC_USE_AGENT_STORE=True`` every worker is a client of the agent's TCPStore at
    MASTER_ADDR:MASTER_PORT, which lives as long as the agent, across restarts of the worker group. env://
    adds no per-attempt prefix, so a restarted group would read the dead attempt's keys: its gloo peer
    addresses (connection refused to a dead port) and its barrier counters (a barrier that passes too early
    or never completes). ``TORCHELASTIC_RESTART_COUNT`` numbers the attempts of this agent's group.

    Caveat, several nodes: each agent counts its own restarts and does not count a restart for a
    membership change, so counts can differ between nodes; ranks then wait in different namespaces and
    init fails after ``timeout`` (bounded, never silent).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # torch's own test: str(True)
        return None
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except (KeyError, ValueError) as exc:
        raise ValueError(f"torch elastic's agent store needs MASTER_ADDR, an integer MASTER_PORT and "
                         f"TORCHELASTIC_RESTART_COUNT ({exc!r}); launch with torchrun") from exc
    # A client only: the agent hosts the server (is_master=False never binds the port).
    client = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"traincore/attempt-{attempt}", client)


def init_group(backend: str, rank: int, world_size: int, timeout: timedelta) -> None:
    """Start the default process group: on this attempt's store under torch elastic, else env://.

    ``timeout`` (``dist.init_timeout_s``) bounds every start-up wait: connecting to the store, every rank
    joining, and the collectives until :func:`tighten_timeout` lowers it after the first step.
    """
    store = attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


@contextlib.contextmanager
def distributed(cfg: DistConfig) -> Iterator[DistContext]:
    """Initialise the process group (when launched with several ranks) and always tear it down."""
    rank, world_size, local_rank = launch_env()
    device = pick_device(local_rank)
    ctx = DistContext(rank, world_size, local_rank, device)
    started = False
    if world_size > 1 and not dist.is_initialized():
        backend = resolve_backend(cfg, device.type == "cuda")
        init_group(backend, rank, world_size, timedelta(seconds=cfg.init_timeout_s))
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


class CollectiveTimeoutError(dist.DistError):
    """A collective timed out waiting for another rank; the message says what timed out and what to do.

    A DistError like torch's own timeouts, so the Flyte task treats it as a transient fault (a retry).
    """


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a process-group or store timeout (gloo: "Timed out waiting 5000ms for ...")."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in text or "timeout" in text)


@contextlib.contextmanager
def explain_timeouts(cfg: DistConfig, rank: int, last_step: Callable[[], int]) -> Iterator[None]:
    """Re-raise a collective's timeout inside the block as a CollectiveTimeoutError that says what to do.

    gloo reports a peer that never joins a collective as a bare RuntimeError from wherever the collective
    ran (DDP's hooks, telemetry's all-reduce, a checkpoint barrier), naming neither the setting nor where
    to look. ``last_step()`` is the last step this rank completed. The original error stays chained.
    """
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, CollectiveTimeoutError) or not is_timeout(exc):
            raise
        detail = next(iter(str(exc).strip().splitlines()), type(exc).__name__)
        raise CollectiveTimeoutError(
            f"rank {rank}: a collective timed out after step {last_step()}: another rank never joined it "
            "(it hung or died); look at the other ranks' logs for why. Training collectives wait "
            f"dist.step_timeout_s={cfg.step_timeout_s} s once the first step has run "
            f"(dist.init_timeout_s={cfg.init_timeout_s} s until then); if a step legitimately takes longer, "
            f"raise dist.step_timeout_s. [{detail}]") from exc


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few floats across ranks (identity without a process group)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor.tolist()


# ---- parallelism ---------------------------------------------------------------------------------

def parallelize(model: nn.Module, units: list[nn.Module], cfg: DistConfig, ctx: DistContext, *,
                bf16: bool = False, compile: bool = False) -> nn.Module:
    """Wrap ``model`` (on ``ctx.device``) for this run's parallelism; ``units`` are its blocks.

    ``ddp`` replicates the model (DistributedDataParallel across ranks; compiled whole when asked).
    ``fsdp`` shards it with FSDP2: ``fully_shard`` on every unit and at the root, on a 1-D device mesh
    over all ranks (compiled per unit when asked, so each graph is a block FSDP gathers for); on CUDA with
    bf16, parameters compute in bf16 and gradients reduce in fp32. One rank has nothing to shard: the
    model runs as it is, and its checkpoints are the same full tensors a sharded run's reshard into.
    """
    if cfg.parallelism == "ddp" or not ctx.distributed:
        if ctx.distributed:
            device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
        return torch.compile(model) if compile else model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    precision = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                 if bf16 and ctx.device.type == "cuda" else MixedPrecisionPolicy())
    for unit in units:
        if compile:
            unit.compile()  # in place: the module FSDP wraps stays the one the model calls
        fully_shard(unit, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=precision)
    fully_shard(model, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=precision)
    if any(True for _ in model.buffers()):
        # As DDP does: rank 0's buffers (BatchNorm statistics) on every rank before each forward. FSDP leaves
        # buffers unsharded and unsynchronised; this way the run depends on rank 0's alone, which is what a
        # checkpoint keeps (see broadcast_buffers).
        model.register_forward_pre_hook(lambda module, args: broadcast_buffers(module))
    return model


def broadcast_buffers(module: nn.Module) -> None:
    """Copy rank 0's buffers (BatchNorm statistics, counters) to every rank, in one collective.

    Each rank updates its buffers from its own batches; a checkpoint holds one copy of each, so it takes
    rank 0's: then a resumed run continues from exactly the buffers an uninterrupted one would use.
    """
    buffers = list(module.buffers())
    if not buffers or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    # float64 holds every int64 counter below 2**53 exactly, so one flat tensor carries them all.
    flat = torch.cat([buffer.detach().reshape(-1).to(torch.float64) for buffer in buffers])
    dist.broadcast(flat, src=0)
    offset = 0
    with torch.no_grad():
        for buffer in buffers:
            buffer.copy_(flat[offset:offset + buffer.numel()].view_as(buffer))
            offset += buffer.numel()
