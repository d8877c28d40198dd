"""What one training step and one validation pass do, and the schedule they follow.

Plain functions over the model, optimizer and schedule: the :class:`~traincore.run.trainer.Trainer` calls
them, and
tests call them on their own.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager, nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from traincore.config import Config, ConfigError
from traincore.data import Batch, Normalizer, StagedLoader, StagedSplit, epoch_batches, eval_batches
from traincore.run.dist import DistContext, all_reduce_sum, launch_env


class NonFiniteLossError(ValueError):
    """The loss or the gradients became NaN/inf; training stops before the optimizer step. A ValueError,
    as the project's other errors of bad input are: the CLI reports it as one ``error:`` line."""


def accumulation(cfg: Config, world_size: int) -> int:
    """Batches each rank accumulates per optimizer step at ``world_size``: ``train.grad_accum_steps``, or
    with ``train.global_batch`` set, as many as keep that global batch. ConfigError when the global batch is
    not a whole number of batches of loader.batch_size on every rank."""
    if not cfg.train.global_batch:
        return cfg.train.grad_accum_steps
    per_pass = cfg.loader.batch_size * world_size
    count, rest = divmod(cfg.train.global_batch, per_pass)
    if rest or not count:
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} is not a whole number of batches of "
            f"loader.batch_size={cfg.loader.batch_size} x {world_size} process(es) = {per_pass}: set "
            f"train.global_batch to a multiple of {per_pass} (for a node range, of loader.batch_size x the "
            "processes at every node count it allows), or change loader.batch_size")
    return count


def total_steps(cfg: Config, steps_per_epoch: int, accum: int | None = None) -> int:
    """Optimizer steps to train: ``train.max_steps``, else as many as ``train.epochs`` passes of
    ``steps_per_epoch`` batches fill, ``accum`` batches (default ``train.grad_accum_steps``) to a step.
    ConfigError when one step would take more batches than an epoch has (:func:`check_step_fits_epoch`)."""
    accum = accum or cfg.train.grad_accum_steps
    if accum > steps_per_epoch:
        what = (f"train.global_batch={cfg.train.global_batch}: {accum}" if cfg.train.global_batch
                else f"train.grad_accum_steps={accum}")
        raise _step_exceeds_epoch(steps_per_epoch, f"{what} batches per optimizer "
                                  f"step exceed the {steps_per_epoch} batch(es) of loader.batch_size="
                                  f"{cfg.loader.batch_size} per process in an epoch of the training split")
    return cfg.train.max_steps or cfg.train.epochs * steps_per_epoch // accum


def check_step_fits_epoch(cfg: Config, train_count: int, data: str, world_size: int | None = None) -> None:
    """ConfigError unless the samples of one optimizer step, loader.batch_size x the accumulated batches x
    the world size (``world_size``, else torchrun's WORLD_SIZE, else 1; workers check their own world
    again in :func:`total_steps`), fit in the ``train_count`` training samples of ``data``, and
    ``train.global_batch`` (when set) is a whole number of batches at that world size.

    A larger step would read the training split several times over within one step, and ``train.epochs``
    would count steps, not passes over the data."""
    world = world_size or launch_env()[1]
    accum = accumulation(cfg, world)
    batch = cfg.loader.batch_size * world
    batches = epoch_batches(train_count, batch, cfg.loader.drop_last)
    if accum > batches:
        step = batch * accum
        what = (f"train.global_batch={cfg.train.global_batch}" if cfg.train.global_batch else
                f"train.grad_accum_steps={accum} x loader.batch_size={cfg.loader.batch_size} x {world} "
                f"process(es) = {step}")
        raise _step_exceeds_epoch(batches, f"{what} samples per optimizer step exceed the {train_count} "
                                  f"training samples in {data}", world)


def _step_exceeds_epoch(batches: int, numbers: str, world: int = 1) -> ConfigError:
    """The error for an optimizer step larger than an epoch: ``numbers`` say by how much; the fix follows
    from the ``batches`` an epoch has (none: one batch per process is already more than the data)."""
    fewer = f", or run fewer than {world} processes" if world > 1 else ""
    fix = (f"lower train.grad_accum_steps to at most {batches}" if batches else
           f"lower loader.batch_size{fewer}")
    return ConfigError(f"{numbers}: one optimizer step would take more than an epoch of data (train.epochs "
                       f"would count steps, not passes over the data); {fix}, or stage more data")


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, micro_batches: list[Batch],
               cfg: Config, before_update: Callable[[], None] | None = None) -> torch.Tensor:
    """Forward and backward of every micro-batch (``train.grad_accum_steps`` of them), finite check, clip,
    optimizer and LR step. Returns the detached loss, the mean over the micro-batches.

    Each micro-batch's loss is divided by their count, so the summed gradients are those of one batch of all
    their samples. Ranks synchronise gradients only in the last backward (DDP's ``no_sync``, FSDP2's
    ``set_requires_gradient_sync``): one all-reduce per step, as without accumulation.

    ``before_update`` runs right before ``optimizer.step()``, the first moment the step writes to the
    weights: work that reads them in the background (an async checkpoint's copy) overlaps the forward and
    backward, and is waited for there.
    """
    device = micro_batches[0][0].device
    bf16 = device.type == "cuda" and cfg.train.bf16
    losses = []
    for index, (images, labels) in enumerate(micro_batches):
        with gradient_sync(model, index == len(micro_batches) - 1):
            # Entering a disabled autocast still costs a context switch of dispatch state on every step.
            with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext():
                logits = model(images)
                loss = F.cross_entropy(logits.float(), labels, label_smoothing=cfg.train.label_smoothing)
            del logits  # frees the activations' last reference before backward allocates gradients
            (loss / len(micro_batches) if len(micro_batches) > 1 else loss).backward()
        losses.append(loss.detach())
    loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
    # The gradient norm is global after DDP's all-reduce, so every rank takes the same decision here.
    norm = nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
    # Under FSDP the norm is a DTensor over every rank's shards: the same global figure once made whole.
    grad_norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
    if not math.isfinite(grad_norm):  # .item(): a host read, cheaper than an isfinite op and its read
        raise non_finite(cfg, loss.item(), grad_norm, scheduler.last_epoch)
    if before_update is not None:
        before_update()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss


def non_finite(cfg: Config, loss: float, grad_norm: float, updates: int) -> NonFiniteLossError:
    """The error for a non-finite loss or gradient norm after ``updates`` optimizer steps (a resumed run
    counts those before it). Before any update, the weights are as initialised (or loaded): the model or
    its inputs produce the NaN/inf, and a lower learning rate cannot help. After some, training diverged."""
    what = (f"the loss is {loss:.4g}" if not math.isfinite(loss) else
            f"the loss is {loss:.4g} but its gradient norm is {grad_norm:.4g}")
    if updates == 0:
        start = f"model.init_from={cfg.model.init_from!r}" if cfg.model.init_from else "its initialisation"
        return NonFiniteLossError(
            f"{what} at step 1, before any optimizer update: the model (model.name={cfg.model.name!r}) or "
            "its input already produces non-finite values, so no learning-rate setting can help; check the "
            f"model's forward and {start}, and the staged images and their normalisation (mean and std in "
            "the staged manifest.json; a channel with std near 0 blows its inputs up)")
    clip = "" if cfg.optim.grad_clip else ", or set optim.grad_clip (e.g. 1.0)"
    return NonFiniteLossError(
        f"{what} at step {updates + 1}, after {updates} optimizer updates: training diverged; lower optim.lr "
        f"(now {cfg.optim.lr:g}) or raise optim.warmup_steps (now {cfg.optim.warmup_steps}){clip}")


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Around one backward: ranks all-reduce (DDP) or reduce-scatter (FSDP2) its gradients only when
    ``enabled``; otherwise they accumulate locally. A model of one process has nothing to synchronise."""
    if enabled:
        yield
    elif hasattr(model, "no_sync"):  # DistributedDataParallel
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2's fully_shard
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


@torch.no_grad()
def validate(model: nn.Module, split: StagedSplit, batch_size: int, ctx: DistContext) -> dict[str, float]:
    """Loss and accuracy over the whole split, each rank taking a share, summed across ranks."""
    normalize = Normalizer(split.mean, split.std, ctx.device)
    was_training = model.training
    model.eval()
    loss_sum = correct = 0.0
    # Every rank runs as many forwards as the rank with the most batches: a sharded (FSDP) model gathers
    # parameters in each forward, a collective that every rank must join. A rank out of batches runs a
    # one-sample batch again and counts nothing.
    share = eval_batches(split, batch_size, rank=ctx.rank, world_size=ctx.world_size)
    per_rank = math.ceil(len(split) / ctx.world_size)
    rounds = math.ceil(per_rank / batch_size)
    with closing(share):  # a streamed split's last batch stays pinned in its cache until then
        for _ in range(rounds):
            batch = next(share, None)
            images, labels = batch if batch is not None else split.read(np.arange(1))
            labels = labels.to(ctx.device)
            logits = model(normalize(images.to(ctx.device))).float()
            if batch is not None:
                loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
                correct += (logits.argmax(1) == labels).sum().item()
    model.train(was_training)
    loss_sum, correct = all_reduce_sum([loss_sum, correct], ctx.device)
    return {"loss": loss_sum / len(split), "accuracy": correct / len(split)}


def endless(loader: StagedLoader) -> Iterator[Batch]:
    """Batches across epoch boundaries; the loader advances its own epoch."""
    while True:
        yield from loader
