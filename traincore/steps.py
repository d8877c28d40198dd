"""What one training step and one validation pass do, and the schedule they follow.

Plain functions over the model, optimizer and schedule: the :class:`~traincore.train.Trainer` calls them, and
tests call them on their own.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from traincore.config import Config
from traincore.data.loader import Batch, Normalizer, StagedLoader, StagedSplit, eval_batches
from traincore.dist import DistContext, all_reduce_sum


class NonFiniteLossError(RuntimeError):
    """The loss or the gradients became NaN/inf; training stops before the optimizer step."""


def total_steps(cfg: Config, steps_per_epoch: int) -> int:
    """Optimizer steps to train: ``train.max_steps``, else ``train.epochs`` passes of ``steps_per_epoch``
    batches, ``train.grad_accum_steps`` batches to a step."""
    return cfg.train.max_steps or cfg.train.epochs * max(1, steps_per_epoch // cfg.train.grad_accum_steps)


def warmup_cosine(cfg: Config, steps: int):
    """LR multiplier: linear warmup, then cosine decay to ``min_lr_ratio`` at the last step."""
    warmup, floor = cfg.optim.warmup_steps, cfg.optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


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
        raise NonFiniteLossError(f"non-finite loss or gradients at step {scheduler.last_epoch + 1} (loss "
                                 f"{loss.item():.4g}, gradient norm {grad_norm:.4g}): lower optim.lr "
                                 "or set optim.grad_clip")
    if before_update is not None:
        before_update()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss


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
    normalize = Normalizer(split.manifest.mean, split.manifest.std, ctx.device)
    was_training = model.training
    model.eval()
    loss_sum = correct = 0.0
    # Every rank runs as many forwards as the rank with the most batches: a sharded (FSDP) model gathers
    # parameters in each forward, a collective that every rank must join. A rank out of batches runs a
    # one-sample batch again and counts nothing.
    share = eval_batches(split, batch_size, rank=ctx.rank, world_size=ctx.world_size)
    per_rank = math.ceil(len(split) / ctx.world_size)
    rounds = math.ceil(per_rank / batch_size)
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
