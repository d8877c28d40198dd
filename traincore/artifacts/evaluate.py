"""Evaluate an exported model on one split of a staged dataset.

    python -m traincore.evaluate --model model.safetensors --data DIR [--split test] [--batch-size N]

Reads batches with the training loader's reader (memory-mapped uint8 shards, normalised on the device)
and reports accuracy, mean cross-entropy, per-class precision and recall and the confusion matrix.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from traincore.artifacts.export import ExportError, add_trust_flags, load_exported, trust_from_args
from traincore.checkpoint import Store, as_store
from traincore.data import (
    Normalizer,
    StagedSplit,
    StagingError,
    StreamedSplit,
    cache_limit,
    eval_batches,
    open_streamed,
)
from traincore.exitcodes import INTERRUPTED_EXIT_CODE
from traincore.files import local_path_argument, path_argument


@dataclass
class EvalResult:
    """One split's metrics of an exported model (the Flyte EvalReport carries it as it is)."""

    split: str
    accuracy: float
    loss: float  # mean cross-entropy per sample
    count: int
    classes: list[str]
    precision: list[float]  # per class; 0.0 for a class never predicted
    recall: list[float]  # per class; 0.0 for a class absent from the split
    confusion: list[list[int]]  # confusion[true][predicted]


def confusion_matrix(labels: torch.Tensor, predictions: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``num_classes`` x ``num_classes`` counts; rows are true classes, columns predicted ones."""
    flat = labels.to(torch.int64) * num_classes + predictions.to(torch.int64)
    return torch.bincount(flat, minlength=num_classes * num_classes).view(num_classes, num_classes)


def precision_recall(confusion: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per-class precision (of the predictions) and recall (of the true samples); 0.0 where undefined."""
    confusion = confusion.to(torch.float64)
    hits = confusion.diagonal()
    precision = hits / confusion.sum(dim=0).clamp(min=1)
    recall = hits / confusion.sum(dim=1).clamp(min=1)
    return precision.tolist(), recall.tolist()


def _check_compatible(meta: dict, split: StagedSplit | StreamedSplit, model_path: str | Path) -> None:
    manifest, where = split.manifest, split.store.uri if split.remote else split.directory
    if list(meta["shape"]) != list(manifest.shape) or list(meta["classes"]) != list(manifest.classes):
        raise StagingError(
            f"model {model_path} expects {len(meta['classes'])} classes of shape {tuple(meta['shape'])}, but "
            f"{where} holds {manifest.num_classes} classes of shape {manifest.shape}: evaluate on "
            "data staged with the training settings")


def _check_meta(meta: dict, model_path: str | Path) -> None:
    """The config keys evaluation needs beyond those that rebuild the model: class names and normalisation."""
    config_path = Path(model_path).with_suffix(".json")
    channels = meta["shape"][0] if meta["shape"] else 0
    for key, ok in (("classes", lambda v: isinstance(v, list) and len(v) == meta["num_classes"]),
                    ("mean", lambda v: isinstance(v, list) and len(v) == channels),
                    ("std", lambda v: isinstance(v, list) and len(v) == channels)):
        if not ok(meta.get(key)):
            raise ExportError(f"model config {config_path} has {key}={meta.get(key)!r}, which does not "
                              f"match its {meta['num_classes']} classes of shape {tuple(meta['shape'])}: "
                              "export the model again from a checkpoint written by traincore.train")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a torch.device this machine has (default: cuda when available, else cpu); ValueError
    naming the value and the choices otherwise."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device is None or device == "":
        return torch.device("cuda" if cuda else "cpu")
    choices = "use cpu" + (f", cuda or cuda:0 to cuda:{cuda - 1}" if cuda
                           else " (this machine has no CUDA device)")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"device {device!r} (--device) is not a device name: {choices}") from exc
    if resolved.type == "cpu" or (resolved.type == "cuda" and cuda and (resolved.index or 0) < cuda):
        return resolved
    raise ValueError(f"device {device!r} (--device) is not available on this machine: {choices}")


def evaluate(model_path: str | Path, data_dir: str | Path | Store, split: str = "test", batch_size: int = 256,
             device: str | torch.device | None = None, trust_model: bool | str = False) -> EvalResult:
    """Run the exported model over ``split`` of ``data_dir`` and measure it. ``trust_model``: True, or the
    model's import path, allows rebuilding a model of an imported factory
    (traincore.model.build.check_trusted)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size} is invalid: it must be >= 1 (--batch-size)")
    device = resolve_device(device)
    model, meta = load_exported(model_path, trust_model)
    _check_meta(meta, model_path)
    data = open_split(data_dir, split)
    try:
        return _measure(model, meta, data, model_path, split, batch_size, device)
    finally:
        if data.remote:
            data.close()


def open_split(data_dir: str | Path | Store, split: str) -> StagedSplit | StreamedSplit:
    """``split`` of the staged dataset at ``data_dir``: memory-mapped, or streamed from an object store
    (traincore.data.stream: only that split's samples are fetched, never the whole dataset)."""
    data = as_store(data_dir)
    if data.local:
        return StagedSplit(data.path, split)
    return open_streamed(data, (split,), cache_limit(0))[0]


def _measure(model: torch.nn.Module, meta: dict, data: StagedSplit | StreamedSplit, model_path: str | Path,
             split: str, batch_size: int, device: torch.device) -> EvalResult:
    """The model's loss, accuracy, precision, recall and confusion over ``data``."""
    _check_compatible(meta, data, model_path)
    model.to(device)
    # The model's own normalisation, from its training data: correct even on a differently staged copy.
    normalize = Normalizer(meta["mean"], meta["std"], device)
    num_classes = len(meta["classes"])
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64)
    loss_sum = 0.0
    with torch.inference_mode():
        for images, labels in eval_batches(data, batch_size):
            labels = labels.to(device)
            logits = model(normalize(images.to(device))).float()
            loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
            confusion += confusion_matrix(labels, logits.argmax(dim=1), num_classes).cpu()
    count = int(confusion.sum())
    precision, recall = precision_recall(confusion)
    return EvalResult(split=split, accuracy=float(confusion.diagonal().sum()) / count, loss=loss_sum / count,
                      count=count, classes=list(meta["classes"]), precision=precision, recall=recall,
                      confusion=confusion.tolist())


def format_result(result: EvalResult) -> str:
    """The one line a user reads: ``test accuracy: 0.978 (360 samples, loss 0.0712)``."""
    return f"{result.split} accuracy: {result.accuracy:.3f} ({result.count} samples, loss {result.loss:.4f})"


def main(argv: list[str] | None = None) -> int:
    """CLI: print the accuracy line; exit code 2 for a missing model, unusable data or a bad argument, 130
    and one line when interrupted."""
    parser = argparse.ArgumentParser(prog="python -m traincore.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=local_path_argument,
                        help="exported model.safetensors (python -m traincore.export)")
    parser.add_argument("--data", required=True, type=path_argument, help="staged dataset directory")
    parser.add_argument("--split", default="test", help="train | val | test")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    add_trust_flags(parser)
    args = parser.parse_args(argv)
    try:
        result = evaluate(args.model, args.data, args.split, args.batch_size, args.device,
                          trust_from_args(args))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no score (the evaluation writes nothing)", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    print(format_result(result))
    return 0

