"""The training loop: load -> for each step: fetch, step, maybe log, maybe evaluate, maybe checkpoint.

Run in every worker (torchrun or torch elastic): :func:`train` sets up the process group, resumes from the
latest complete checkpoint when there is one, trains to ``max_steps`` and returns a :class:`TrainSummary`.
On CPU with a fixed seed and world size the run is deterministic, so a resumed run ends with bitwise the
same weights as an uninterrupted one.
"""

from __future__ import annotations

import gc
import logging
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from traincore.autotune import autotune
from traincore.checkpoint import Checkpointer, TrainState, unwrap_model
from traincore.config import Config
from traincore.data import Manifest
from traincore.dist import DistContext, all_reduce_sum, distributed, tighten_timeout
from traincore.loader import Batch, Normalizer, StagedLoader, StagedSplit, eval_batches
from traincore.models import build_model, parameter_count
from traincore.sinks import resolve_wandb_key
from traincore.telemetry import Telemetry, setup_logging, training_flops_per_sample

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss or the gradients became NaN/inf; training stops before the optimizer step."""


@dataclass
class TrainSummary:
    steps: int
    samples_per_s: float
    data_wait_share: float
    final_loss: float
    val_accuracy: float | None
    resumed_from: int | None
    checkpoint_dir: str
    output_dir: str
    wall_s: float


def total_steps(cfg: Config, steps_per_epoch: int) -> int:
    """``train.max_steps`` when set, else ``train.epochs`` full epochs."""
    return cfg.train.max_steps or cfg.train.epochs * steps_per_epoch


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
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_state(cfg: Config, manifest: Manifest, loader: StagedLoader, ctx: DistContext, steps: int) -> TrainState:
    """Model (DDP-wrapped across ranks), AdamW, warmup-cosine schedule and the loader, as one state."""
    seed_everything(cfg.train.seed)  # identical initial weights on every rank
    model = build_model(cfg.model, manifest.num_classes, manifest.shape).to(ctx.device)
    if ctx.distributed:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    if cfg.model.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                  weight_decay=cfg.optim.weight_decay, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg, steps))
    meta = {"config": cfg.to_dict(), "num_classes": manifest.num_classes, "shape": list(manifest.shape),
            "classes": manifest.classes, "mean": manifest.mean, "std": manifest.std, "source": manifest.source,
            "world_size": ctx.world_size}
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, meta=meta)


def train_step(state: TrainState, batch: Batch, cfg: Config, device: torch.device) -> torch.Tensor:
    """Forward, backward, finite check, clip, optimizer and LR step. Returns the detached loss."""
    images, labels = batch
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda" and cfg.train.bf16):
        logits = state.model(images)
        loss = F.cross_entropy(logits.float(), labels)
    del logits  # frees the activations' last reference before backward allocates gradients
    loss.backward()
    # The gradient norm is global after DDP's all-reduce, so every rank takes the same decision here.
    grad_norm = nn.utils.clip_grad_norm_(state.model.parameters(), cfg.optim.grad_clip or float("inf"))
    if not torch.isfinite(grad_norm):
        raise NonFiniteLossError(f"non-finite loss or gradients at step {state.step + 1} (loss {loss.item():.4g}, "
                                 f"gradient norm {grad_norm.item():.4g}): lower optim.lr or set optim.grad_clip")
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()
    return loss.detach()


@torch.no_grad()
def validate(model: nn.Module, split: StagedSplit, batch_size: int, ctx: DistContext) -> dict[str, float]:
    """Loss and accuracy over the whole split, each rank taking a share, summed across ranks."""
    normalize = Normalizer(split.manifest.mean, split.manifest.std, ctx.device)
    was_training = model.training
    model.eval()
    loss_sum = correct = 0.0
    for images, labels in eval_batches(split, batch_size, rank=ctx.rank, world_size=ctx.world_size):
        labels = labels.to(ctx.device)
        logits = model(normalize(images.to(ctx.device))).float()
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(1) == labels).sum().item()
    model.train(was_training)
    loss_sum, correct = all_reduce_sum([loss_sum, correct], ctx.device)
    return {"loss": loss_sum / len(split), "accuracy": correct / len(split)}


def endless(loader: StagedLoader) -> Iterator[Batch]:
    """Batches across epoch boundaries; the loader advances its own epoch."""
    while True:
        yield from loader


class ProfilerWindow:
    """Records a torch.profiler trace for the steps in ``train.profile_steps`` (rank-local)."""

    def __init__(self, window: tuple[int, int] | None, output: Path, rank: int):
        self.window, self.trace = window, output / "profile" / f"trace-rank{rank}.json"
        self.profiler: torch.profiler.profile | None = None

    def on_step(self, step: int) -> None:
        if self.window and step == self.window[0]:
            self.profiler = torch.profiler.profile(record_shapes=True, profile_memory=True)
            self.profiler.start()
        elif self.window and step == self.window[1] and self.profiler is not None:
            self.close()
            log.info("profiler trace for steps %d-%d written to %s", *self.window, self.trace)

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.trace.parent.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(self.trace))
            self.profiler = None


def prepare(cfg: Config, data_dir: str | Path) -> Manifest:
    """Check the config against the staged data before any process group starts; returns the manifest."""
    manifest = Manifest.load(data_dir)
    train_count = manifest.splits["train"].count
    if cfg.loader.drop_last and train_count < cfg.loader.batch_size:
        raise ValueError(f"loader.batch_size={cfg.loader.batch_size} exceeds the {train_count} training samples "
                         f"in {data_dir}: lower loader.batch_size")
    resolve_wandb_key(cfg.telemetry.wandb_mode)  # online mode without a key fails here, not in a worker
    if cfg.model.name == "vit_b_16" and manifest.shape[1] % 16:
        raise ValueError(f"model.name='vit_b_16' needs an image size divisible by 16; {data_dir} is staged at "
                         f"{manifest.shape[1]}: stage again with a multiple of 16")
    return manifest


def train(cfg: Config, data_dir: str | Path, output_dir: str | Path,
          checkpoint_dir: str | Path | None = None) -> TrainSummary:
    """Train in this worker: the whole story, from process group to the final checkpoint."""
    manifest = prepare(cfg, data_dir)
    output = Path(output_dir)
    ckpt_root = Path(checkpoint_dir) if checkpoint_dir else output / "checkpoints"
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    with distributed(cfg.dist) as ctx:
        setup_logging(cfg.telemetry.level, ctx.rank)
        output.mkdir(parents=True, exist_ok=True)
        train_split, val_split = StagedSplit(data_dir, "train"), StagedSplit(data_dir, "val")
        loader_cfg = cfg.loader
        if loader_cfg.autotune:
            loader_cfg = autotune(train_split, loader_cfg, rank=ctx.rank, world_size=ctx.world_size,
                                  seed=cfg.train.seed, device=ctx.device)
        loader = StagedLoader(train_split, loader_cfg, rank=ctx.rank, world_size=ctx.world_size,
                              seed=cfg.train.seed, device=ctx.device)
        steps = total_steps(cfg, loader.steps_per_epoch)
        state = build_state(cfg, manifest, loader, ctx, steps)
        flops = training_flops_per_sample(unwrap_model(state.model), manifest.shape)  # meta tensors: no copy
        telemetry = Telemetry(cfg.telemetry, output, rank=ctx.rank, world_size=ctx.world_size,
                              run_config=cfg.to_dict(), total_steps=steps,
                              global_batch_size=loader.global_batch_size, flops_per_sample=flops, device=ctx.device)
        seed_everything(cfg.train.seed + ctx.rank)  # per-rank streams (dropout); a resume restores saved ones
        checkpointer = Checkpointer(ckpt_root, cfg.checkpoint, ctx.rank, ctx.world_size)
        resumed = None
        if cfg.checkpoint.resume != "none":
            wanted = None if cfg.checkpoint.resume == "latest" else int(cfg.checkpoint.resume)
            resumed = checkpointer.load(state, wanted)
        log.info("training %s (%s parameters) on %s for %d steps, %d per epoch, global batch %d%s",
                 cfg.model.name, f"{parameter_count(state.model):,}", ctx.device, steps, loader.steps_per_epoch,
                 loader.global_batch_size, f", resumed from step {resumed} in {ckpt_root}" if resumed else "")
        profiler = ProfilerWindow(cfg.train.profile_window(), output, ctx.rank)
        gc.disable()  # a full collection mid-step costs more than the garbage it frees; collect on our schedule
        try:
            run_steps(cfg, state, ctx, steps, checkpointer, telemetry, profiler, val_split)
            val = validate(state.model, val_split, cfg.loader.eval_batch_size, ctx)
            telemetry.log_eval(state.step, val)
            summary = telemetry.summary()
        finally:
            gc.enable()
            profiler.close()
            checkpointer.close()
            telemetry.close()
    return TrainSummary(steps=state.step, samples_per_s=summary.get("samples_per_s", 0.0),
                        data_wait_share=summary.get("data_wait_share", 0.0),
                        final_loss=summary.get("final_loss", float("nan")), val_accuracy=val["accuracy"],
                        resumed_from=resumed, checkpoint_dir=str(ckpt_root), output_dir=str(output),
                        wall_s=summary.get("wall_s", 0.0))


def run_steps(cfg: Config, state: TrainState, ctx: DistContext, steps: int, checkpointer: Checkpointer,
              telemetry: Telemetry, profiler: ProfilerWindow, val_split: StagedSplit) -> None:
    """The step loop proper, from the current (possibly resumed) step to ``steps``."""
    batches = endless(state.loader)
    state.model.train()
    every, first_step = cfg.checkpoint.every, state.step + 1
    while state.step < steps:
        with telemetry.data_wait():
            batch = next(batches)
        profiler.on_step(state.step)
        loss = train_step(state, batch, cfg, ctx.device)
        state.step += 1
        telemetry.step_done(state.step, loss, state.scheduler.get_last_lr()[0])
        if state.step == first_step:
            tighten_timeout(cfg.dist)  # start-up is over: a hung peer should now fail fast
        if state.step % cfg.train.gc_every == 0:
            gc.collect()
        if cfg.train.eval_every and state.step % cfg.train.eval_every == 0 and state.step < steps:
            telemetry.log_eval(state.step, validate(state.model, val_split, cfg.loader.eval_batch_size, ctx))
        if (every and state.step % every == 0) or state.step == steps:
            checkpointer.save(state)
    checkpointer.wait()
