"""Bad input, table-driven: every entry point refuses it with one clear message and leaves nothing behind.

One table covers the four CLIs (``traincore.stage``, ``.train``, ``.export``, ``.evaluate``, called in
process through their ``main(argv)``), the Flyte tasks (``plan_run``, ``stage_dataset``, the train task's
``execute``) and the workflow's inputs (``training_pipeline``). Each case asserts:

* it fails: exit code 2 for a CLI, an exception for a task or the workflow;
* the message names the bad input and says what to do (key substrings of both);
* no ``Traceback`` in stderr (and a CLI prints exactly one ``error:`` line);
* nothing that looks complete appeared: no new ``manifest.json``, ``commit.json``, ``model.safetensors``
  nor a leftover ``*.tmp`` file, anywhere the case could have written.

A case marked ``real_process`` also runs as ``python -m traincore.<cli>`` (one per CLI); a torchrun case with
two ranks shows the error printed exactly once. The real processes all start together, up front, and are
collected by their tests: the slow part (importing torch) overlaps.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from faultlib import TINY, child_env, torchrun

from tasks.launch import train_task_for
from tasks.plan import plan_run
from tasks.stage import stage_dataset
from tasks.types import StagedDataset, Topology
from traincore.artifacts.evaluate import main as evaluate_main
from traincore.artifacts.export import WEIGHTS_FILE, export
from traincore.artifacts.export import main as export_main
from traincore.checkpoint import MARKER, verify_checkpoint
from traincore.config.presets import preset
from traincore.config.schema import DataConfig
from traincore.data.cli import main as stage_main
from traincore.data.manifest import MANIFEST, Manifest
from traincore.data.staging import stage
from traincore.run.cli import main as train_main
from traincore.run.trainer import Trainer
from workflows.pipeline import training_pipeline

REPO = Path(__file__).resolve().parents[2]
CONFIG = preset("debug").with_overrides(TINY)
COMPLETE_LOOKING = (MANIFEST, MARKER, WEIGHTS_FILE)  # what declares a staging, a checkpoint, an export done
PLAN = dict(source="digits", preset="digits", config_overrides="", epochs=0, max_steps=0, backend="local",
            nnodes="1", nproc_per_node=1, gpus_per_node=0, accelerator="", max_restarts=0, parallelism="ddp",
            checkpoint_uri="", slurm_target="", slurm_partition="", slurm_account="", slurm_time_limit="",
            slurm_sbatch_flags="", slurm_setup="")


def tiny(**sections: dict) -> str:
    """The tiny training config with ``sections`` merged in, as the JSON ``--config`` takes."""
    config = json.loads(json.dumps(TINY))
    for name, fields in sections.items():
        config.setdefault(name, {}).update(fields)
    return json.dumps(config)


# ---- shared inputs: staged datasets, a trained run, its export -------------------------------------------

@dataclass(frozen=True)
class Run:
    """A tiny finished training run on ``fault_data`` (small_cnn width 8, 4 classes of 3x12x12)."""

    checkpoints: Path
    model: Path


@pytest.fixture(scope="module")
def trained(fault_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("bad-inputs-run")
    Trainer(CONFIG.with_overrides({"train.max_steps": 2}), fault_data, root / "run").train()
    model = root / "model" / WEIGHTS_FILE
    export(root / "run" / "checkpoints", model)
    return Run(root / "run" / "checkpoints", model)


@pytest.fixture(scope="module")
def other_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Stagings the trained run does not fit: 3 classes instead of 4; 1 channel instead of 3; 96 training
    samples instead of 384."""
    root = tmp_path_factory.mktemp("bad-inputs-data")
    base = dict(source="synthetic", image_size=12, synthetic_samples=120, samples_per_shard=100)
    stage(DataConfig(**base, synthetic_classes=3), root / "three-classes")
    stage(DataConfig(**base, synthetic_classes=4, channels=1), root / "one-channel")
    stage(DataConfig(**base, synthetic_classes=4), root / "fewer-samples")
    return {"three_classes": root / "three-classes", "one_channel": root / "one-channel",
            "more_samples": root / "fewer-samples"}


class Env:
    """What a case builds its input from: the shared inputs and a private directory to damage."""

    def __init__(self, tmp: Path, data: Path, other: dict[str, Path], run: Run, stack: contextlib.ExitStack):
        self.tmp, self.data, self.run, self._stack = tmp, data, run, stack
        self.three_classes, self.one_channel = other["three_classes"], other["one_channel"]
        self.more_samples = other["more_samples"]  # same classes and shape, another training-split size

    def path(self, name: str) -> Path:
        """A path in this case's directory that does not exist yet."""
        return self.tmp / name

    def file(self, name: str, content: bytes | str = "not what you think\n") -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    def images(self, name: str, classes: int = 2, per_class: int = 4, sizes: tuple = ((14, 10),),
               broken: str = "") -> Path:
        """An ImageFolder ``<name>/class_k/img_i.png``; image i has size ``sizes[i % len(sizes)]``;
        ``broken`` names an extra file with an image extension that holds text."""
        from PIL import Image

        root, rng = self.tmp / name, np.random.default_rng(0)
        root.mkdir(parents=True)
        for label in range(classes):
            (root / f"class_{label}").mkdir()
            for index in range(per_class):
                width, height = sizes[index % len(sizes)]
                pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / f"class_{label}" / f"img_{index}.png")
        if broken:
            (root / "class_0" / broken).write_text("this is not an image\n")
        return root

    def awkward_images(self, name: str) -> Path:
        """An ImageFolder of the image kinds a camera roll or a scan holds: palette (with transparency),
        CMYK, grey+alpha, RGBA, 16-bit grey, 1x1 and 1x40 pixels; 8 images, 2 classes."""
        from PIL import Image

        root = self.tmp / name
        palette = Image.new("P", (9, 7), 1)
        palette.putpalette([0, 0, 0, 200, 40, 90])
        images = [(palette, "p.png", {"transparency": 1}),
                  (Image.new("CMYK", (9, 7), (0, 255, 255, 0)), "cmyk.jpg", {}),
                  (Image.new("LA", (9, 7), (120, 0)), "la.png", {}),
                  (Image.new("RGBA", (9, 7), (70, 80, 250, 0)), "rgba.png", {}),
                  (Image.new("I;16", (9, 7), 128 * 257), "grey16.png", {}),
                  (Image.new("RGB", (1, 1), (200, 40, 90)), "1x1.png", {}),
                  (Image.new("P", (1, 1), 0), "1x1.gif", {}),
                  (Image.new("RGB", (1, 40), (9, 9, 9)), "1x40.png", {})]
        for index, (image, file_name, options) in enumerate(images):
            directory = root / f"class_{index % 2}"
            directory.mkdir(parents=True, exist_ok=True)
            image.save(directory / file_name, **options)
        return root

    def with_dot_files(self, root: Path) -> Path:
        """``root`` with what macOS, Jupyter and git leave in a folder, some of it named like images."""
        from PIL import Image

        (root / ".git").mkdir()
        Image.new("RGB", (4, 4)).save(root / ".git" / "logo.png")
        for directory in sorted(root.glob("class_*")):
            (directory / ".DS_Store").write_bytes(b"\0\0\0\1Bud1" + bytes(64))
            (directory / "._img_0.png").write_bytes(b"\0\5\26\7\0\2\0\0Mac OS X        ")
            (directory / ".ipynb_checkpoints").mkdir()
            Image.new("RGB", (4, 4)).save(directory / ".ipynb_checkpoints" / "img_0-checkpoint.png")
        return root

    def float_image_folder(self, name: str) -> Path:
        """A 2-class ImageFolder holding one 32-bit float TIFF (mode F), as scientific cameras write."""
        from PIL import Image

        root = self.images(name)
        Image.new("F", (14, 10), 0.5).save(root / "class_0" / "scan.tif")
        return root

    def copied(self, directory: Path, name: str) -> Path:
        """A private copy of a shared directory (a case that damages it damages only the copy)."""
        return Path(shutil.copytree(directory, self.tmp / name))

    def foreign_checkpoints(self, name: str) -> Path:
        """A directory another program wrote: a ``step-000005/`` with its own ``commit.json``."""
        step = self.tmp / name / "step-000005"
        step.mkdir(parents=True)
        (step / MARKER).write_text(json.dumps({"epoch": 3, "saved_by": "another-trainer"}))
        (step / "weights.bin").write_bytes(b"\0" * 64)
        return self.tmp / name

    def staged_dataset(self, directory: Path) -> StagedDataset:
        """The StagedDataset value a train task receives for ``directory`` (no check: the task checks)."""
        from flytekit.types.directory import FlyteDirectory

        return StagedDataset(directory=FlyteDirectory(str(directory)), source="synthetic", classes=["a", "b"],
                             shape=[3, 12, 12], counts={"train": 1}, format_version=1,
                             source_fingerprint="synthetic:sha256:" + "0" * 32)

    def read_only(self, name: str) -> Path:
        """A directory this process cannot write, whoever runs the tests: mode 0555 for a user; as root
        (which ignores modes) a read-only tmpfs, or else an immutable directory."""
        path = self.tmp / name
        path.mkdir()
        if os.geteuid() != 0:
            path.chmod(0o555)
            self._stack.callback(path.chmod, 0o755)
        else:
            self._read_only_as_root(path)
        with contextlib.suppress(OSError):
            (path / ".probe").touch()
            pytest.fail(f"could not make {path} read-only for this test")
        return path

    def _read_only_as_root(self, path: Path) -> None:
        tried = []
        for make, undo in ((["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs"], ["umount", "-l"]),
                           (["chattr", "+i"], ["chattr", "-i"])):
            try:
                done = subprocess.run([*make, str(path)], capture_output=True, text=True, timeout=30)
            except OSError as exc:
                tried.append(f"{make[0]}: {exc}")
                continue
            if done.returncode == 0:
                self._stack.callback(subprocess.run, [*undo, str(path)], capture_output=True, timeout=30)
                return
            tried.append(f"{make[0]}: {done.stderr.strip()}")
        pytest.fail(f"cannot make {path} read-only as root ({'; '.join(tried)}): the read-only cases need "
                    "CAP_SYS_ADMIN (a read-only tmpfs) or a filesystem with chattr +i")


# ---- the table ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One bad input. ``make`` builds what ``target`` is called with: argv for a CLI, keyword arguments for
    plan_run and the workflow, a DataConfig for stage_dataset, (config, dataset dir) for the train task."""

    id: str
    target: str  # stage | train | export | evaluate | plan | stage_task | train_task | workflow
    make: Callable[[Env], Any]
    names: tuple[str, ...]  # substrings that name the bad input
    fix: tuple[str, ...]  # substrings that say what to do
    no_cuda: bool = False  # run as on a machine without CUDA
    real_process: bool = False  # also run as `python -m traincore.<target>`
    works: bool = False  # hostile-looking, yet valid: it must succeed
    env: tuple[tuple[str, str], ...] = ()  # environment variables set for the case
    stages_first: bool = False  # found when the Slurm job is submitted, after the data staged (and cached)


def stage_args(env: Env, source: str, *extra: str, output: str = "staged") -> list[str]:
    return ["--source", source, "--output", str(env.path(output)), "--image-size", "12", "--decode-workers",
            "1", *extra]


def train_argv(env: Env, *extra: str, config: str = "", data: Path | None = None,
               output: Path | None = None) -> list[str]:
    return ["--data", str(data or env.data), "--output", str(output or env.path("run")), "--preset", "debug",
            "--config", config or tiny(), "--max-steps", "2", *extra]


def export_argv(env: Env, checkpoint: Path | None = None, output: Path | None = None) -> list[str]:
    return ["--checkpoint", str(checkpoint or env.run.checkpoints),
            "--output", str(output or env.path("model") / WEIGHTS_FILE)]


def evaluate_argv(env: Env, model: Path | None = None, *extra: str, data: Path | None = None) -> list[str]:
    return ["--model", str(model or env.run.model), "--data", str(data or env.data), *extra]


def copied_model(env: Env, weights: bytes | None = None, config_text: str | None = None) -> Path:
    """A copy of the exported model with its weights and/or config replaced."""
    model = env.file(f"copy/{WEIGHTS_FILE}", weights if weights is not None else env.run.model.read_bytes())
    config = env.run.model.with_suffix(".json").read_text()
    env.file("copy/model.json", config_text if config_text is not None else config)
    return model


def pickle_claiming_safetensors(env: Env) -> Path:
    """A torch.save file named model.safetensors, its config's sha256 updated so only the format is wrong."""
    import hashlib
    import io

    buffer = io.BytesIO()
    torch.save({"weight": torch.zeros(3)}, buffer)
    config = json.loads(env.run.model.with_suffix(".json").read_text())
    config["sha256"] = hashlib.sha256(buffer.getvalue()).hexdigest()
    return copied_model(env, buffer.getvalue(), json.dumps(config))


FRESH = "--resume none"  # part of every refused-resume fix
CASES = [
    # -- traincore.stage: sources that do not exist or are no image folders; bad settings ----------------
    Case("stage-missing-path", "stage", lambda e: stage_args(e, f"imagefolder:{e.path('nowhere')}"),
         ("imagefolder location", "nowhere", "does not exist"), ("check the path or URI",),
         real_process=True),
    Case("stage-missing-uri", "stage", lambda e: stage_args(e, "imagefolder:memory://bucket/no-such-images"),
         ("memory://bucket/no-such-images", "does not exist"), ("check the path or URI",)),
    Case("stage-location-is-a-file", "stage", lambda e: stage_args(e, f"imagefolder:{e.file('images.zip')}"),
         ("images.zip", "is a file"), ("one sub-directory per class",)),
    Case("stage-no-images", "stage",
         lambda e: stage_args(e, f"imagefolder:{e.file('empty/class_0/readme.txt').parent.parent}"),
         ("empty", "holds no images"), ("<root>/<class>/<image>",)),
    Case("stage-one-class", "stage", lambda e: stage_args(e, f"imagefolder:{e.images('one', classes=1)}"),
         ("only one class", "class_0"), ("at least two class directories",)),
    Case("stage-non-image-file", "stage",
         lambda e: stage_args(e, f"imagefolder:{e.images('broken', broken='notes.png')}"),
         ("cannot read image", "notes.png"), ("Remove or replace the file",)),
    Case("stage-mixed-sizes-are-resized", "stage",
         lambda e: stage_args(e, f"imagefolder:{e.images('mixed', sizes=((14, 10), (40, 31), (9, 23)))}"),
         (), (), works=True),
    Case("stage-camera-roll-modes-are-converted", "stage",
         lambda e: stage_args(e, f"imagefolder:{e.awkward_images('awkward')}"), (), (), works=True),
    Case("stage-dot-files-are-skipped", "stage",
         lambda e: stage_args(e, f"imagefolder:{e.with_dot_files(e.images('dots'))}"), (), (), works=True),
    Case("stage-float-image", "stage", lambda e: stage_args(e, f"imagefolder:{e.float_image_folder('sci')}"),
         ("scan.tif", "32-bit float pixels (mode F)"), ("save it as an 8- or 16-bit PNG or TIFF",)),
    Case("stage-synthetic-fewer-samples-than-classes", "stage",
         lambda e: stage_args(e, "synthetic", "--samples", "5", "--classes", "10"),
         ("data.synthetic_samples=5 (--samples)", "data.synthetic_classes=10 (--classes)"),
         ("raise --samples to at least the class count", "or lower --classes")),
    Case("stage-unknown-source", "stage", lambda e: stage_args(e, "mnist"),
         ("data.source='mnist'", "is unknown"), ("imagefolder:<path-or-URI>",)),
    Case("stage-image-size-0", "stage", lambda e: [*stage_args(e, "synthetic"), "--image-size", "0"],
         ("data.image_size=0",), ("must be an integer >= 1",)),
    Case("stage-fractions-leave-no-training-split", "stage",
         lambda e: stage_args(e, "synthetic", "--val-fraction", "0.6", "--test-fraction", "0.5"),
         ("data.val_fraction + data.test_fraction",), ("must leave a training split",)),
    # -- traincore.train: data, config types and ranges, checkpoints that do not fit, outputs ------------
    Case("train-data-missing", "train", lambda e: train_argv(e, data=e.path("nothing-staged")),
         ("nothing-staged", "is not a staged dataset"), ("python -m traincore.stage",)),
    Case("train-data-is-an-image-folder", "train", lambda e: train_argv(e, data=e.images("raw")),
         ("raw", "is not a staged dataset"), ("stage it first",)),
    Case("train-text-for-a-number", "train", lambda e: train_argv(e, config=tiny(loader={"batch_size": "8"})),
         ("--config", "loader.batch_size='8'", "expected an integer"), ('{"loader.batch_size": 8}',),
         real_process=True),
    Case("train-text-for-a-bool", "train", lambda e: train_argv(e, config=tiny(loader={"shuffle": "no"})),
         ("loader.shuffle='no'", "expected true or false"), ('{"loader.shuffle": false}',)),
    Case("train-lr-out-of-range", "train", lambda e: train_argv(e, config=tiny(optim={"lr": -1})),
         ("optim.lr=-1",), ("must be in (0, 10)",)),
    Case("train-negative-max-steps", "train", lambda e: [*train_argv(e), "--max-steps", "-1"],
         ("--max-steps -1 is invalid",), ("it must be >= 1",)),
    Case("train-zero-max-steps", "train", lambda e: [*train_argv(e), "--max-steps", "0"],
         ("--max-steps 0 is invalid",), ("omit it to keep the preset's length",)),
    Case("train-config-file-missing", "train", lambda e: train_argv(e, config=str(e.path("cfg.json"))),
         ("--config", "cfg.json", "cannot read the file"), ("pass an existing .json file",)),
    Case("train-nccl-without-cuda", "train", lambda e: train_argv(e, config=tiny(dist={"backend": "nccl"})),
         ("dist.backend='nccl'", "needs CUDA"), ("use 'auto' or 'gloo'",), no_cuda=True),
    Case("train-async-checkpoints-without-cpu-backend", "train",
         lambda e: train_argv(e, "--checkpoint-mode", "async", config=tiny(dist={"backend": "nccl"})),
         ("checkpoint.mode='async'", "dist.backend='nccl'"), ("set dist.backend to 'auto'",)),
    Case("train-vit-on-12px", "train", lambda e: train_argv(e, config=tiny(model={"name": "vit_b_16"})),
         ("model.name='vit_b_16'", "staged at 12"), ("multiple of 16",)),
    Case("train-wandb-malformed-key", "train",
         lambda e: train_argv(e, config=tiny(telemetry={"wandb_mode": "online"})),
         ("W&B API key in WANDB_API_KEY is malformed", "has 10 characters"),
         ("https://wandb.ai/authorize", "WANDB_API_KEY_FILE", "wandb_mode='offline'"),
         env=(("WANDB_API_KEY", "not-a-real-key"),)),
    Case("train-wandb-key-file-with-quotes", "train",
         lambda e: (e.file("wandb-key", '"0123456789abcdef0123456789abcdef01234567"\n'),
                    train_argv(e, config=tiny(telemetry={"wandb_mode": "online"})))[1],
         ("WANDB_API_KEY_FILE=", "is malformed", "characters other than letters"),
         ("https://wandb.ai/authorize", "with nothing around it"),
         env=(("WANDB_API_KEY_FILE", "{tmp}/wandb-key"),)),
    Case("train-resume-another-datasets-size", "train",
         lambda e: train_argv(e, "--checkpoint-dir", str(e.run.checkpoints), data=e.more_samples),
         ("was saved by a run over 384 training samples", "has 96"), ("the dataset that run used", FRESH)),
    Case("train-resume-missing-step", "train", lambda e: train_argv(e, "--resume", "999"),
         ("--resume", "step 999", "no complete checkpoint"), (FRESH,)),
    Case("train-resume-another-model", "train",
         lambda e: train_argv(e, "--checkpoint-dir", str(e.run.checkpoints),
                              config=tiny(model={"width": 16})),
         ("was written by a run of model", "'width': 8", "'width': 16"),
         ("use that run's model config", FRESH)),
    # Once refused only in the worker, loading its state, blaming the model ("build that model"):
    Case("train-resume-another-optimizer", "train",
         lambda e: train_argv(e, "--checkpoint-dir", str(e.run.checkpoints),
                              config=tiny(optim={"name": "sgd"})),
         ("its optimizer state was written by optimizer", "'adamw'", "'sgd'"),
         ("resume with that run's", FRESH)),
    Case("train-resume-another-datasets-classes", "train",
         lambda e: train_argv(e, "--checkpoint-dir", str(e.run.checkpoints), data=e.three_classes),
         ("trained on data of 4 classes", "holds 3 classes"), ("staged as that run's was", FRESH)),
    Case("train-resume-other-channels", "train",
         lambda e: train_argv(e, "--checkpoint-dir", str(e.run.checkpoints), data=e.one_channel),
         ("shape (3, 12, 12)", "of shape (1, 12, 12)"), ("staged as that run's was", FRESH)),
    Case("train-checkpoints-of-another-program", "train",
         lambda e: train_argv(e, "--checkpoint-dir", str(e.foreign_checkpoints("theirs"))),
         ("theirs/step-000005", MARKER), ("fresh checkpoint root",)),
    Case("train-checkpoint-dir-is-a-file", "train",
         lambda e: train_argv(e, "--checkpoint-dir", str(e.file("ckpt"))),
         ("checkpoint directory", "is a file, not a directory"), ("set --checkpoint-dir",)),
    Case("train-output-inside-the-staged-data", "train", lambda e: train_argv(e, output=e.data / "run"),
         ("output directory", "/run is inside the staged dataset"),
         ("set --output to a directory outside it",)),
    Case("train-output-read-only", "train",
         lambda e: train_argv(e, output=e.read_only("ro") / "run"),
         ("output directory", "ro/run", "cannot be created"), ("set --output to a directory you can write",)),
    # -- traincore.export: inputs that are no checkpoint, outputs it must not or cannot write ------------
    Case("export-checkpoint-missing", "export", lambda e: export_argv(e, e.path("no-run")),
         ("checkpoint", "no-run", "does not exist"), ("pass a step directory",), real_process=True),
    Case("export-a-staged-dataset", "export", lambda e: export_argv(e, e.data),
         ("holds no complete checkpoint",), ("pass the checkpoints root of a run",)),
    Case("export-checkpoints-of-another-program", "export",
         lambda e: export_argv(e, e.foreign_checkpoints("theirs")),
         ("theirs/step-000005", MARKER), ("fresh checkpoint root",)),
    Case("export-output-is-an-existing-file", "export", lambda e: export_argv(e, output=e.file("notes.txt")),
         ("notes.txt already exists", "not part of an earlier export"), ("or move that file away",)),
    Case("export-config-would-replace-a-staging-manifest", "export",
         lambda e: export_argv(e, output=e.copied(e.data, "data") / "manifest.safetensors"),
         ("JSON config file", "data/manifest.json already exists"), ("export into a directory of its own",)),
    Case("export-named-lineage", "export", lambda e: export_argv(e, output=e.path("m/lineage.safetensors")),
         ("its JSON config file and its lineage file would both be", "m/lineage.json"),
         ("use another name, such as", "m/model.safetensors")),
    Case("export-beside-another-models-lineage", "export",
         lambda e: export_argv(e, output=e.copied(e.run.model.parent, "exported") / "second.safetensors"),
         ("exported/lineage.json already exists", "another model exported into"),
         ("export into a directory of its own",)),
    Case("export-output-is-a-directory", "export", lambda e: export_argv(e, output=e.file("out/keep").parent),
         ("output", "is a directory"), ("pass a file path such as",)),
    Case("export-output-inside-its-checkpoint", "export",
         lambda e: export_argv(e, output=e.run.checkpoints / "step-000002" / WEIGHTS_FILE),
         ("is inside the checkpoint", "step-000002"), ("write the model outside the checkpoint",)),
    Case("export-output-read-only", "export",
         lambda e: export_argv(e, output=e.read_only("ro") / "m.safetensors"),
         ("cannot write", "ro/m.safetensors", "is not writable"), ("choose an --output",)),
    Case("export-output-under-a-file", "export",
         lambda e: export_argv(e, output=e.file("plain") / WEIGHTS_FILE),
         ("plain", "is a file, not a directory"), ("choose an --output",)),
    # -- traincore.evaluate: model files that are not what export writes, data it was not trained for ----
    Case("evaluate-not-safetensors", "evaluate", lambda e: evaluate_argv(e, pickle_claiming_safetensors(e)),
         ("copy/model.safetensors", "is not a safetensors file"), ("written by python -m traincore.export",),
         real_process=True),
    Case("evaluate-truncated-config", "evaluate",
         lambda e: evaluate_argv(e, copied_model(e, config_text=e.run.model.with_suffix(".json")
                                                 .read_text()[:90])),
         ("copy/model.json", "is not valid JSON"), ("export it again",)),
    Case("evaluate-model-is-its-config", "evaluate",
         lambda e: evaluate_argv(e, e.run.model.with_suffix(".json")),
         ("model.json", "is the JSON config"), ("pass the weights file beside it",)),
    Case("evaluate-model-missing", "evaluate", lambda e: evaluate_argv(e, e.path("gone.safetensors")),
         ("gone.safetensors", "is missing"), ("python -m traincore.export",)),
    Case("evaluate-bad-device", "evaluate", lambda e: evaluate_argv(e, None, "--device", "gpu:first"),
         ("device 'gpu:first'", "--device"), ("use cpu",)),
    Case("evaluate-other-classes", "evaluate", lambda e: evaluate_argv(e, data=e.three_classes),
         ("expects 4 classes", "holds 3 classes"), ("data staged with the training settings",)),
    Case("evaluate-other-channels", "evaluate", lambda e: evaluate_argv(e, data=e.one_channel),
         ("shape (3, 12, 12)", "shape (1, 12, 12)"), ("data staged with the training settings",)),
    Case("evaluate-unknown-split", "evaluate", lambda e: evaluate_argv(e, None, "--split", "holdout"),
         ("split 'holdout'",), ("train, val, test",)),
    # -- plan_run: what the workflow validates before anything stages or trains --------------------------
    Case("plan-text-for-a-number", "plan", lambda e: dict(config_overrides='{"loader": {"batch_size": "8"}}'),
         ("input config_overrides", "loader.batch_size='8'"), ('{"loader.batch_size": 8}',)),
    Case("plan-unknown-parallelism", "plan", lambda e: dict(parallelism="zero3"),
         ("input parallelism", "dist.parallelism='zero3'"), ("one of ddp, fsdp",)),
    Case("plan-nnodes-2-locally", "plan", lambda e: dict(nnodes="2"),
         ("input nnodes=2", "backend='local'"), ("set nnodes=1",)),
    Case("plan-async-checkpoints-without-cpu-backend", "plan",
         lambda e: dict(config_overrides='{"dist": {"backend": "nccl"}, "checkpoint": {"mode": "async"}}'),
         ("input config_overrides", "checkpoint.mode='async'"), ("'cpu:gloo,cuda:nccl'",)),
    Case("plan-vit-on-12px", "plan",
         lambda e: dict(config_overrides='{"model": {"name": "vit_b_16"}, "data": {"image_size": 12}}'),
         ("model.name='vit_b_16'", "data.image_size=12"), ("multiple of 16",)),
    Case("plan-image-too-small-for-the-model", "plan",
         lambda e: dict(config_overrides='{"data": {"image_size": 2}}'),
         ("model.name='small_cnn'", "data.image_size=2"), ("larger data.image_size",)),
    Case("plan-dataset-path-missing", "plan", lambda e: dict(source=f"imagefolder:{e.path('photos')}"),
         ("input source=", "photos", "does not exist"), ("<root>/<class>/<image>",)),
    Case("plan-unknown-uri-scheme", "plan", lambda e: dict(source="imagefolder:ftps3://bucket/photos"),
         ("input source=", "unknown scheme ftps3://"), ("s3://bucket/path",)),
    Case("plan-checkpoint-uri-is-a-file", "plan", lambda e: dict(checkpoint_uri=str(e.file("ckpt"))),
         ("input checkpoint_uri=", "is a file, not a directory"), ("set checkpoint_uri to a directory",)),
    Case("plan-checkpoint-uri-read-only", "plan", lambda e: dict(checkpoint_uri=str(e.read_only("ro"))),
         ("input checkpoint_uri=", "is not writable"), ("set checkpoint_uri to a directory you can write",)),
    Case("plan-synthetic-fewer-samples-than-classes", "plan",
         lambda e: dict(source="synthetic",
                        config_overrides='{"data": {"synthetic_samples": 3, "synthetic_classes": 10}}'),
         ("input source='synthetic'", "data.synthetic_samples=3"), ("raise --samples",)),
    # -- stage_dataset: the staging task -----------------------------------------------------------------
    Case("stage-task-non-image-file", "stage_task",
         lambda e: DataConfig(source=f"imagefolder:{e.images('broken', broken='scan.jpg')}", image_size=12,
                              decode_workers=1),
         ("cannot read image", "scan.jpg"), ("Remove or replace the file",)),
    Case("stage-task-uri-missing", "stage_task",
         lambda e: DataConfig(source="imagefolder:memory://bucket/missing", image_size=12),
         ("memory://bucket/missing", "does not exist"), ("check the path or URI",)),
    Case("stage-task-synthetic-fewer-samples-than-classes", "stage_task",
         lambda e: DataConfig(source="synthetic", synthetic_samples=4, synthetic_classes=5, image_size=12),
         ("data.synthetic_samples=4", "data.synthetic_classes=5"), ("raise --samples",)),
    # -- the train task's execute: checked before any worker starts --------------------------------------
    Case("train-task-wandb-malformed-key", "train_task",
         lambda e: (CONFIG.with_overrides({"telemetry.wandb_mode": "online"}), e.data),
         ("W&B API key in WANDB_API_KEY is malformed",), ("https://wandb.ai/authorize",),
         env=(("WANDB_API_KEY", "0123456789abcdef0123456789abcdef"),)),
    Case("train-task-not-a-dataset", "train_task", lambda e: (CONFIG, e.file("data/readme.txt").parent),
         ("is not a staged dataset",), ("stage it first",)),
    Case("train-task-batch-larger-than-the-data", "train_task",
         lambda e: (CONFIG.with_overrides({"loader.batch_size": 4096}), e.data),
         ("loader.batch_size=4096", "exceeds the 384 training samples"), ("lower loader.batch_size",)),
    Case("train-task-nccl-without-cuda", "train_task",
         lambda e: (CONFIG.with_overrides({"dist.backend": "nccl"}), e.data),
         ("dist.backend='nccl'", "needs CUDA"), ("use 'auto' or 'gloo'",), no_cuda=True),
    # -- training_pipeline's inputs ----------------------------------------------------------------------
    Case("workflow-epochs-and-max-steps", "workflow", lambda e: dict(epochs=2, max_steps=5),
         ("epochs=2 and max_steps=5",), ("give one of them",)),
    Case("workflow-slurm-without-target", "workflow", lambda e: dict(backend="slurm"),
         ("input backend='slurm' needs slurm_target",), ("scripts/slurm-loopback up",)),
    Case("workflow-slurm-unknown-alias", "workflow",
         lambda e: dict(backend="slurm", slurm_target="no-such-cluster-alias"),
         ("slurm_target='no-such-cluster-alias'", "cannot resolve host"),
         ("use a Host alias defined in ~/.ssh/config",), stages_first=True),
    Case("workflow-slurm-inputs-without-slurm", "workflow", lambda e: dict(slurm_partition="gpu"),
         ("inputs slurm_* are set but backend='local'",), ("set backend='slurm'",)),
    Case("workflow-zero-processes", "workflow", lambda e: dict(nproc_per_node=0),
         ("input nproc_per_node=0",), ("must be >= 1",)),
    Case("workflow-negative-stage-partitions", "workflow", lambda e: dict(stage_partitions=-1),
         ("input stage_partitions=-1",), ("give a whole number >= 1 of partitions",)),
    Case("workflow-text-for-a-bool", "workflow",
         lambda e: dict(config_overrides='{"loader": {"shuffle": "no"}}'),
         ("input config_overrides", "loader.shuffle='no'"), ('{"loader.shuffle": false}',)),
    Case("workflow-wrong-input-type", "workflow", lambda e: dict(epochs="3"),
         ("Failed argument 'epochs'",), ("Expected value of type <class 'int'>",)),
]
CLIS = {"stage": stage_main, "train": train_main, "export": export_main, "evaluate": evaluate_main}


def complete_looking(roots: list[Path]) -> set[Path]:
    """Files under ``roots`` that declare an output complete, and temporary files left behind."""
    found = set()
    for root in roots:
        if root.is_dir():
            found.update(p for p in root.rglob("*") if p.name in COMPLETE_LOOKING or p.name.endswith(".tmp"))
    return found


@pytest.fixture
def env(fault_data, other_data, trained, tmp_path) -> Iterator[Env]:
    with contextlib.ExitStack() as stack:
        yield Env(tmp_path, fault_data, other_data, trained, stack)


def watched(env: Env) -> list[Path]:
    """Everywhere a case could write: its directory, the user cache (local stagings) and the shared run."""
    return [env.tmp, Path(os.environ["XDG_CACHE_HOME"]), env.run.checkpoints.parent, env.run.model.parent]


def invoke(case: Case, env: Env, made: Any) -> tuple[int | None, str]:
    """Call ``case.target`` with ``made``: (exit code, "") for a CLI, whose message goes to stderr; (None,
    the exception's text) for a task or the workflow."""
    if case.target in CLIS:
        try:
            return CLIS[case.target](made), ""
        except SystemExit as exc:  # argparse
            return exc.code, ""
    if case.target == "plan":
        call = lambda: plan_run(**PLAN | made)  # noqa: E731
    elif case.target == "stage_task":
        call = lambda: stage_dataset(data=made, source_fingerprint="not-fingerprinted")  # noqa: E731
    elif case.target == "train_task":
        config, directory = made
        task = train_task_for(Topology(nproc_per_node=2), config)
        call = lambda: task.execute(config=config, dataset=env.staged_dataset(directory),  # noqa: E731
                                    checkpoint_root=str(env.path("checkpoints")))
    else:
        call = lambda: training_pipeline(**made)  # noqa: E731
    with pytest.raises(Exception) as info:
        call()
    return None, str(info.value)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_refused_clearly(case: Case, env: Env, capsys, monkeypatch):
    if case.no_cuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name, value in case.env:
        monkeypatch.setenv(name, value.format(tmp=env.tmp))
    made = case.make(env)  # the bad input, in place: from here on nothing may look complete that did not
    before = complete_looking(watched(env))
    code, message = invoke(case, env, made)
    out, err = capsys.readouterr()
    if case.works:  # mixed image sizes: each image is resized (shorter side) and centre-cropped
        assert code == 0, err
        manifest = Manifest.load(env.path("staged"))
        assert manifest.shape == (3, 12, 12) and sum(s.count for s in manifest.splits.values()) == 8
        return
    if case.target in CLIS:
        assert code == 2, f"exit code {code}\n{out}\n{err}"
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, err
        message = errors[0]
    for part in (*case.names, *case.fix):
        assert part in message, f"{part!r} not in: {message}"
    assert "Traceback" not in err
    after = complete_looking(watched(env))
    if case.stages_first:  # plan_run never contacts a cluster: a staged dataset is a finished product
        before, after = ({path for path in paths if "staged" not in path.parts} for paths in (before, after))
    assert after == before


def test_the_table_covers_every_entry_point():
    """At least 30 cases, each CLI, task and the workflow among them, one real process per CLI."""
    targets = {case.target for case in CASES}
    assert len(CASES) >= 30 and targets == {*CLIS, "plan", "stage_task", "train_task", "workflow"}
    assert sorted(case.target for case in CASES if case.real_process) == sorted(CLIS)
    assert len({case.id for case in CASES}) == len(CASES)


def test_refused_export_leaves_its_checkpoint_as_committed(env, capsys):
    """The output-inside-the-checkpoint case, once more: the checkpoint still verifies, file for file."""
    step = env.run.checkpoints / "step-000002"
    files = sorted(p.name for p in step.iterdir())
    assert export_main(export_argv(env, output=step / WEIGHTS_FILE)) == 2
    assert "is inside the checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in step.iterdir()) == files
    verify_checkpoint(step)


# ---- an s3:// source without credentials: the staging CLI and the stage task, as real processes ---------

@pytest.fixture(scope="module")
def s3_images() -> Iterator[tuple[str, str]]:
    """(URI, endpoint): an ImageFolder of 2 classes x 4 PNGs in a bucket of a local S3 API (moto's server,
    in this process), which the child processes reach over HTTP."""
    import io

    import boto3
    from moto.server import ThreadedMotoServer
    from PIL import Image

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")  # moto's dummies
        client.create_bucket(Bucket="photos")
        for index in range(8):
            buffer = io.BytesIO()
            Image.new("RGB", (14, 10), (30 * index, 90, 200)).save(buffer, format="PNG")
            client.put_object(Bucket="photos", Key=f"set/class_{index % 2}/{index}.png",
                              Body=buffer.getvalue())
        yield "s3://photos/set", endpoint
    finally:
        server.stop()


def store_env(home: Path, **settings: str) -> dict[str, str]:
    """The environment of a child process with no S3 credentials anywhere (no AWS_* or FLYTE_AWS_*
    variables, no ~/.aws, no instance metadata), then ``settings``."""
    env = {name: value for name, value in child_env().items() if not name.startswith(("AWS_", "FLYTE_AWS_"))}
    missing = str(home / "no-such-file")
    return {**env, "HOME": str(home), "AWS_SHARED_CREDENTIALS_FILE": missing, "AWS_CONFIG_FILE": missing,
            "AWS_EC2_METADATA_DISABLED": "true", **settings}


CREDENTIALS_NAMED = ("no credentials", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                     "FLYTE_AWS_ACCESS_KEY_ID", "FLYTE_AWS_ENDPOINT")


def test_s3_source_without_credentials_stage_cli(s3_images, tmp_path):
    """Today's raw NoCredentialsError traceback is one line naming the URI and what to set; with those set,
    the same command stages (the store was there, only the credentials were missing)."""
    uri, endpoint = s3_images
    command = [sys.executable, "-m", "traincore.stage", "--source", f"imagefolder:{uri}", "--output",
               str(tmp_path / "staged"), "--image-size", "12"]
    refused = subprocess.run(command, env=store_env(tmp_path, AWS_ENDPOINT_URL=endpoint), capture_output=True,
                             text=True, timeout=120, cwd=REPO)
    assert refused.returncode == 2, refused.stderr
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in refused.stderr, refused.stderr
    for part in (f"imagefolder location {uri!r}", *CREDENTIALS_NAMED):
        assert part in errors[0], f"{part!r} not in: {errors[0]}"
    assert not (tmp_path / "staged").exists()
    aws = store_env(tmp_path, AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing",
                    AWS_SECRET_ACCESS_KEY="testing")
    staged = subprocess.run(command, env=aws, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert staged.returncode == 0, staged.stderr
    assert Manifest.load(tmp_path / "staged").classes == ["class_0", "class_1"]


STAGE_TASK = """
import sys
from tasks.stage import stage_dataset
from traincore.config.schema import DataConfig
try:
    staged = stage_dataset(data=DataConfig(source=sys.argv[1], image_size=12, decode_workers=2),
                           source_fingerprint="not-fingerprinted")
except Exception as exc:
    print("refused:", type(exc).__name__, " ".join(str(exc).split()), file=sys.stderr)
    sys.exit(3)
print("staged", sum(staged.counts.values()), "images of", staged.classes)
"""


def test_s3_source_without_credentials_stage_task(s3_images, tmp_path):
    """The stage task names the URI and the settings, FLYTE_AWS_* among them, and those alone then work:
    the task reads the source with the store settings Flyte gives its tasks (listing and decode processes)."""
    uri, endpoint = s3_images
    command = [sys.executable, "-c", STAGE_TASK, f"imagefolder:{uri}"]
    refused = subprocess.run(command, env=store_env(tmp_path), capture_output=True, text=True, timeout=180,
                             cwd=REPO)
    assert refused.returncode == 3, refused.stderr[-3000:]
    # the stage task's StagingError, shown by pyflyte run without a traceback (tasks.errors)
    [message] = [line for line in refused.stderr.splitlines()
                 if line.startswith("refused: SourceStagingError ")]
    for part in (uri, *CREDENTIALS_NAMED):
        assert part in message, f"{part!r} not in: {message}"
    flyte_store = store_env(tmp_path, FLYTE_AWS_ENDPOINT=endpoint, FLYTE_AWS_ACCESS_KEY_ID="testing",
                            FLYTE_AWS_SECRET_ACCESS_KEY="testing")
    staged = subprocess.run(command, env=flyte_store, capture_output=True, text=True, timeout=180, cwd=REPO)
    assert staged.returncode == 0, staged.stderr[-3000:]
    assert "staged 8 images of ['class_0', 'class_1']" in staged.stdout


# ---- real processes: one per CLI, and torchrun with two ranks -------------------------------------------

@dataclass
class Launched:
    case: Case
    env: Env
    process: subprocess.Popen
    before: set[Path]

    def wait(self, timeout: float = 240) -> tuple[int, str, str]:
        out, err = self.process.communicate(timeout=timeout)
        return self.process.returncode, out, err


TORCHRUN = Case("torchrun-resume-another-model", "train",
                lambda e: train_argv(e, "--checkpoint-dir", str(e.run.checkpoints),
                                     config=tiny(model={"width": 16})),
                ("was written by a run of model", "'width': 16"), ("use that run's model config", FRESH))


@pytest.fixture(scope="module")
def launched(fault_data, other_data, trained, tmp_path_factory) -> Iterator[dict[str, Launched]]:
    """Every real-process case and the torchrun case, started at once (their torch imports overlap)."""
    with contextlib.ExitStack() as stack:
        started = {}
        for case in [*(c for c in CASES if c.real_process), TORCHRUN]:
            env = Env(tmp_path_factory.mktemp(case.id), fault_data, other_data, trained, stack)
            argv = case.make(env)
            if case is TORCHRUN:
                command = torchrun(2, "traincore.train", *argv)
            else:
                command = [sys.executable, "-m", f"traincore.{case.target}", *argv]
            before = complete_looking(watched(env))
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env=child_env(), cwd=REPO)
            stack.callback(process.kill)
            started[case.id] = Launched(case, env, process, before)
        yield started


@pytest.mark.parametrize("case", [c for c in CASES if c.real_process], ids=lambda c: c.id)
def test_cli_in_a_real_process(case: Case, launched):
    run = launched[case.id]
    code, out, err = run.wait()
    assert code == 2, f"exit code {code}\n{out}\n{err}"
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: "), err
    for part in (*case.names, *case.fix):
        assert part in errors[0], f"{part!r} not in: {errors[0]}"
    assert complete_looking(watched(run.env)) == run.before


def test_torchrun_prints_the_error_once(launched):
    """Both ranks find the error before any process group starts; only rank 0 prints it. torchrun's own
    report (its ChildFailedError box) follows, but no traceback from traincore."""
    run = launched[TORCHRUN.id]
    code, out, err = run.wait()
    assert code != 0, err
    errors = [line for line in err.splitlines() if re.match(r"error\b", line)]
    assert len(errors) == 1, err
    assert errors[0].startswith("error: "), errors  # rank 0's line, not another rank's
    for part in (*TORCHRUN.names, *TORCHRUN.fix):
        assert part in errors[0], f"{part!r} not in: {errors[0]}"
    assert f'File "{REPO / "traincore"}' not in err, err  # torchrun's traceback is its own, not the workers'
    assert "traincore.train FAILED" in err and "exitcode  : 2" in err
    assert complete_looking(watched(run.env)) == run.before
