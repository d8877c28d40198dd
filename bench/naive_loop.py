"""The baseline of bench/end_to_end.py: a distributed training loop written the plain way, as a user would.

    torchrun --nproc-per-node 2 bench/naive_loop.py --data IMAGEFOLDER --output DIR --model vit_tiny
        --steps 200 --batch-size 32 --checkpoint-every 50 [--image-size 32] [--channels 3]

torchvision ImageFolder with PIL decoding and transforms per sample, a DataLoader with its defaults
(no workers) over a DistributedSampler, DDP, AdamW, a TensorBoard SummaryWriter with its defaults logging
the loss every step, and rank 0 writing torch.save(model and optimizer) every --checkpoint-every steps.
The model comes from traincore.model.build so that both loops train the same architecture.

Only the benchmark's instrumentation is added: rank 0 notes the wall time at the end of every step, the
seconds spent waiting for each batch and the seconds each save blocks, and writes them to
``<output>/timing.json`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout

from traincore.config.schema import ModelConfig  # noqa: E402
from traincore.model.build import build_model  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="ImageFolder root: one sub-directory per class")
    parser.add_argument("--output", required=True, help="checkpoints, TensorBoard logs and timing.json")
    parser.add_argument("--model", default="vit_tiny")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--channels", type=int, default=3, choices=(1, 3))
    parser.add_argument("--lr", type=float, default=1e-3)
    return parser.parse_args()


def make_loader(args: argparse.Namespace) -> tuple[DataLoader, DistributedSampler, int]:
    """ImageFolder + per-sample transforms, DistributedSampler, DataLoader defaults otherwise."""
    steps = [transforms.Resize((args.image_size, args.image_size))]
    if args.channels == 1:
        steps.append(transforms.Grayscale())
    steps += [transforms.ToTensor(), transforms.Normalize([0.5] * args.channels, [0.25] * args.channels)]
    dataset = datasets.ImageFolder(args.data, transform=transforms.Compose(steps))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    return loader, sampler, len(dataset.classes)


def main() -> None:
    args = parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    loader, sampler, num_classes = make_loader(args)
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=args.model), num_classes,
                        (args.channels, args.image_size, args.image_size)).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    output = Path(args.output)
    writer = SummaryWriter(str(output / "tensorboard")) if rank == 0 else None
    timing = {"loop_start": time.time(), "step_end": [], "data_wait_s": [], "save_s": []}
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        batches = iter(loader)
        while step < args.steps:
            waited = time.perf_counter()
            batch = next(batches, None)
            timing["data_wait_s"].append(time.perf_counter() - waited)
            if batch is None:
                break
            images, labels = batch[0].to(device), batch[1].to(device)
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0:
                writer.add_scalar("train/loss", loss.item(), step)  # .item() waits for the step to finish
                timing["step_end"].append(time.time())
                if step % args.checkpoint_every == 0:
                    started = time.perf_counter()
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "step": step}, output / f"checkpoint-{step}.pt")
                    timing["save_s"].append(time.perf_counter() - started)
        epoch += 1
    if rank == 0:
        writer.close()
        (output / "timing.json").write_text(json.dumps(timing))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
