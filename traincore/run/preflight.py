"""Checks a run passes before any process group or worker starts: the config against the staged data,
this machine and the model, the output and checkpoint locations, and the checkpoint a resume would load.

Everything here fails with a message naming the problem and its fix, so nothing fails only once training
has begun (in a worker, after the launcher's start-up).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from traincore.checkpoint import (
    RunFit,
    Store,
    as_store,
    check_fit,
    choose_step,
    open_saved,
    read_marker,
    step_store,
)
from traincore.config import (
    OWN_MODELS,
    Config,
    ModelConfig,
    is_imported_model,
    model_identity,
    optimizer_identity,
)
from traincore.data import Manifest, verify_staging, verify_streamed
from traincore.imports import no_exit
from traincore.model import (
    ModelImportError,
    build_model,
    check,
    plan,
    read_init_header,
    shard_units,
    store_options,
)
from traincore.run.dist import resolve_backend
from traincore.run.param_groups import check_param_groups
from traincore.run.steps import check_step_fits_epoch
from traincore.telemetry import check_wandb_reachable, resolve_wandb_key


def preflight(cfg: Config, data_dir: str | Path | Store, output_dir: str | Path | None = None,
              checkpoint_dir: str | Path | Store | None = None, world_size: int | None = None) -> Manifest:
    """Check the config against the staged data before any process group starts; returns the manifest.

    Also, so that nothing fails only once training has begun: W&B online mode's key and server (reached
    within a few seconds), the process-group backend against this machine, the model against the staged
    sample shape (on the meta device: no memory, no compute; under FSDP its units too), and, when given, the
    output directory and the checkpoint root (created if missing, probed with a file), and the checkpoint a
    resume would load (its step exists, its model and data match this run's), or else model.init_from
    against the same model (from the file's header: a large file is not downloaded here).

    The splits a run reads are verified here (traincore.data.manifest.verify_staging: labels every time, image
    shards hashed once per staging), so a corrupt staging fails with a StagingError naming the file; a
    dataset in an object store (streamed) is reached, its labels and image digests checked and the cache's
    size against the batches in flight (traincore.data.stream.verify_streamed).
    """
    data = as_store(data_dir)
    manifest = (verify_staging(data.path, Manifest.load(data.path), ("train", "val")) if data.local else
                verify_streamed(data, cfg.loader))
    data_dir = data.uri  # how the messages below name it
    train_count = manifest.splits["train"].count
    if cfg.train.overfit > train_count:  # capped in silence, it would train on all and validate on train
        raise ValueError(f"train.overfit={cfg.train.overfit} exceeds the {train_count} training samples in "
                         f"{data_dir}: give at most {train_count}, or 0 to train on the whole split")
    if cfg.train.overfit:
        train_count = cfg.train.overfit
    if cfg.loader.drop_last and train_count < cfg.loader.batch_size:
        subset = f" (train.overfit={cfg.train.overfit})" if cfg.train.overfit else ""
        raise ValueError(f"loader.batch_size={cfg.loader.batch_size} exceeds the {train_count} training "
                         f"samples in {data_dir}{subset}: lower loader.batch_size")
    # train.grad_accum_steps within one epoch, for the world the launcher starts (``world_size``: every
    # node's processes; None in a worker, which knows its own from torchrun's WORLD_SIZE)
    check_step_fits_epoch(cfg, train_count, str(data_dir), world_size)
    resolve_wandb_key(cfg.telemetry.wandb_mode)  # online mode without a key fails here, not in a worker
    check_wandb_reachable(cfg.telemetry.wandb_mode)  # nor without network (rank 0, after wandb's retries)
    if cfg.model.name == "vit_b_16" and manifest.shape[1] % 16:
        raise ValueError(f"model.name='vit_b_16' needs an image size divisible by 16; {data_dir} is staged "
                         f"at {manifest.shape[1]}: stage again with a multiple of 16")
    if cfg.data.mean and len(cfg.data.mean) != manifest.shape[0]:
        raise ValueError(f"data.mean={cfg.data.mean} and data.std={cfg.data.std} give {len(cfg.data.mean)} "
                         f"channels, but {data_dir} is staged with {manifest.shape[0]}: give one value per "
                         "staged channel, or leave both empty for the staging's own statistics")
    resolve_backend(cfg.dist, torch.cuda.is_available())  # nccl without CUDA fails here, not in a worker
    model = check_model_input(cfg.model, manifest.num_classes, manifest.shape, f"the data in {data_dir}",
                              cfg.loader.batch_size)
    check_param_groups(model, cfg.optim.param_groups)  # a pattern that matches nothing
    if cfg.dist.parallelism == "fsdp":
        shard_units(model, cfg.model.name)  # a module's shard_units hook fails here, not in every worker
    root = as_store(checkpoint_dir) if checkpoint_dir is not None else None
    if output_dir is not None:
        output_dir = Path(output_dir)
        root = as_store(checkpoint_dir or output_dir / "checkpoints")
        if data.local:
            check_outside_data(data.path, output_dir, "output directory", "--output")
            if root.local:
                check_outside_data(data.path, root.path, "checkpoint directory", "--checkpoint-dir")
        ensure_writable_dir(output_dir, "output directory", "--output")
        if root.local:
            ensure_writable_dir(root.path, "checkpoint directory", "--checkpoint-dir or checkpoint_uri")
        else:
            ensure_writable_store(root)
        resumed = check_resume(cfg, manifest, root, data_dir)
    else:
        resumed = None
    if cfg.model.init_from and resumed is None:
        check_init(cfg.model, model, root)
    return manifest


class OutputError(ValueError):
    """An output location cannot be written; the message names it and the fix."""


def check_outside_data(data: Path, path: Path, what: str, option: str) -> None:
    """OutputError when ``path`` is the staged dataset ``data`` or inside it: a run's files would mix with
    the staging's (and a restaging would delete them)."""
    data, where = data.resolve(), Path(path).resolve()
    if where == data or data in where.parents:
        raise OutputError(f"{what} {path} is inside the staged dataset {data}: set {option} to a directory "
                          "outside it")


def ensure_writable_dir(path: str | Path, what: str, option: str) -> Path:
    """``path`` as a directory this process can write: created if missing, then proven with a probe file
    (created and removed; permission bits alone do not tell, e.g. for root or on a read-only mount).
    OutputError names ``what`` (``"output directory"``), the path and the ``option`` that sets it."""
    path = Path(path)
    fix = f"set {option} to a directory you can write to"
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path} is a file, not a directory: {fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{what} {path} cannot be created ({exc.strerror or exc}): {fix}") from exc
    try:
        handle, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(f"{what} {path} is not writable ({exc.strerror or exc}): {fix}") from exc
    return path


def ensure_writable_store(store: Store) -> None:
    """An object-store checkpoint root this process can write and list: proven with a probe object
    (written, listed and removed), so that missing credentials, an unknown bucket or a read-only key fail
    here, naming the root, instead of at the first save after training."""
    probe = f".write-probe-{uuid.uuid4().hex[:12]}"
    try:
        store.write_bytes(probe, b"probe")
        try:
            if store.size(probe) != len(b"probe"):
                raise OSError(f"the probe object {store.uri_of(probe)} did not read back")
        finally:
            store.remove_file(probe)
    except Exception as exc:  # botocore, gcsfs and adlfs raise their own classes for auth and network errors
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OutputError(f"checkpoint root {store} cannot be written ({type(exc).__name__}: {reason}): "
                          "check that the bucket exists and that the credentials (AWS_* or FLYTE_AWS_* for "
                          "s3://) may write there, or set --checkpoint-dir / checkpoint_uri to another "
                          "location") from exc


def check_model_input(model: ModelConfig, num_classes: int, shape: tuple[int, ...] | list[int], data: str,
                      batch_size: int = 2) -> nn.Module:
    """The model ``model`` names, as built for the check (on the meta device or CPU); ValueError unless it
    builds for ``shape`` (C, H, W) samples, trains on batches of ``batch_size`` and maps them to
    ``num_classes`` logits.

    Our own models run a forward on CPU zeros without gradients, in training mode on min(batch_size, 2)
    samples (BatchNorm needs > 1 value per channel: a batch of 1 whose feature map shrinks to 1x1 fails)
    and in eval mode: milliseconds. On the meta device the first op with a Python meta kernel imports
    sympy (over a second), which a run that fails here, or a launcher that only checks, need not pay.
    The torchvision models run on the meta device: building their tens of millions of real weights
    takes seconds, and importing torchvision has already paid for sympy.

    An imported model (``"<module>:<callable>"``) runs on the meta device too, and on CPU zeros when one
    of its ops has no meta kernel or its forward reads values (``.item()``, a branch on a tensor). Its
    factory's errors (ModelImportError) propagate as they are: they name its import path; whatever its
    forward raises, or a sys.exit() in it, is an error naming it too.
    """
    shape = tuple(shape)
    imported = is_imported_model(model.name)
    device = "cpu" if model.name in OWN_MODELS else "meta"
    try:
        with no_exit(f"model.name={model.name!r}: its forward", ModelImportError):
            try:
                built, logits = _probe(model, num_classes, shape, batch_size, device)
            except Exception as exc:  # an op without a meta kernel, or code that reads values (.item())
                if not imported or not (isinstance(exc, NotImplementedError) or "meta" in str(exc)):
                    raise
                built, logits = _probe(model, num_classes, shape, batch_size, "cpu")
    except ModelImportError:
        raise
    except (RuntimeError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in reason:
            # the model's size, not the data's: a larger batch or image would only need more
            raise ValueError(f"model.name={model.name!r} with model.width={model.width} and model.kwargs="
                             f"{model.kwargs} does not fit in this machine's memory ({reason[:160]}): make "
                             "it smaller (model.width or model.kwargs)") from exc
        fix = "fix the model" if imported else "choose another model.name"
        raise ValueError(f"model.name={model.name!r} cannot take {data}: samples of shape {shape} in "
                         f"batches of {batch_size} ({reason}); stage the data with a larger "
                         f"data.image_size, raise loader.batch_size, or {fix}") from exc
    except Exception as exc:  # an imported model's forward is the user's code, which may raise anything
        if not imported:
            raise
        raise ValueError(f"model.name={model.name!r}: its forward on {data} (zeros of shape {shape}) raised "
                         f"{type(exc).__name__}: {exc}: fix the model") from exc
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"model.name={model.name!r} returns a {type(logits).__name__} for a batch of "
                         f"{data}, not a tensor of logits: make it return logits of shape (N, {num_classes})")
    if tuple(logits.shape) != (2, num_classes):
        fix = (f"make it return logits of shape (N, {num_classes})" if imported
               else "choose another model.name")
        raise ValueError(f"model.name={model.name!r} maps {data} to logits of shape "
                         f"{tuple(logits.shape)[1:]}, not ({num_classes},): {fix}")
    if next(built.parameters(), None) is None:  # the optimizer would refuse it, once the workers started
        raise ValueError(f"model.name={model.name!r} builds a model with no parameters: there is nothing to "
                         "train; make the factory return a model with weights")
    return built


def _probe(model: ModelConfig, num_classes: int, shape: tuple[int, ...], batch_size: int,
           device: str) -> tuple[nn.Module, Any]:
    """Build ``model`` on ``device`` and run it on zeros, in training then eval mode; it and its eval
    output."""
    with torch.device(device), torch.no_grad():
        built = build_model(model, num_classes, shape)
        built.train()(torch.zeros(min(batch_size, 2), *shape))
        return built, built.eval()(torch.zeros(2, *shape))


def check_init(cfg: ModelConfig, model: nn.Module, root: Store | None = None) -> None:
    """InitError unless model.init_from can be read and fits ``model`` (as :func:`check_model_input` built
    it) as the worker will load it: the same plan and check (traincore.model.warmstart), from the file's
    header only (a torch file in an object store: only that it is there). ``root``: the run's checkpoint
    root, whose store options read an init_from in the same kind of store, as the worker reads it."""
    header = read_init_header(cfg.init_from, store_options(cfg.init_from, root))
    if header is not None:
        check(plan(model.state_dict(), header.tensors, cfg.init_exclude, cfg.init_from, layout=header.layout),
              cfg.init_strict)


def check_resume(cfg: Config, manifest: Manifest, root: Store, data_dir: str | Path) -> int | None:
    """Refuse, before training, a resume the checkpointer would refuse once the workers run: it picks the
    step as the checkpointer does (traincore.checkpoint.choose_step: the newest complete one that passes
    verification, or the one asked for) and refuses one of a format this code cannot read, of another
    model, or of data with other classes, another sample shape or another number of training samples
    (traincore.checkpoint.check_fit). Returns the step a resume loads, or None for a fresh start."""
    wanted = cfg.checkpoint.resume
    if wanted == "none":
        return None
    step = choose_step(root, None if wanted == "latest" else int(wanted), cfg.checkpoint.verify_on_load,
                       cfg.train.stop_after or None)
    if step is None:
        return None
    directory = step_store(root, step)
    marker = read_marker(directory)
    if not root.local and marker["format"] == "torch_save":
        # Its record sits inside the whole state (state.pt): the checkpointer downloads it once to load it,
        # and refuses it then if it does not fit; reading it here too would download it once more.
        return step
    config = cfg.to_dict()
    run = RunFit(model_identity(config["model"]), list(manifest.classes), list(manifest.shape),
                 manifest.splits["train"].count, optimizer_identity(config["optim"]))
    check_fit(directory, open_saved(directory, marker), run, data=str(data_dir))
    return step
