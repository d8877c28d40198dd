"""A model of the user's own: ``model.name = "<module>:<callable>"``, from a package outside the project.

The package is written by the test into a temporary directory and reaches every process through
PYTHONPATH, as a team's installed package would: nothing of it is part of traincore.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from traincore.checkpoint import complete_steps, read_checkpoint, read_marker, step_dir
from traincore.config.presets import debug
from traincore.config.schema import ConfigError, ModelConfig, model_identity
from traincore.model.build import ModelImportError, build_model, check_trusted, default_units, shard_units
from traincore.run.preflight import check_model_input
from traincore.run.trainer import Trainer

FACTORY = "acmenet.models:build"
PACKAGE = {
    "acmenet/__init__.py": "",
    "acmenet/models.py": '''
        from torch import nn


        class Net(nn.Module):
            """A residual MLP: a stem, `depth` blocks and a head."""

            def __init__(self, features, num_classes, hidden, depth):
                super().__init__()
                self.stem = nn.Sequential(nn.Flatten(), nn.Linear(features, hidden))
                self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.GELU())
                                            for _ in range(depth))
                self.head = nn.Linear(hidden, num_classes)

            def forward(self, x):
                x = self.stem(x)
                for block in self.blocks:
                    x = x + block(x)
                return self.head(x)


        def build(num_classes, in_channels, image_size, hidden=32, depth=2):
            return Net(in_channels * image_size * image_size, num_classes, hidden, depth)


        def not_a_model(num_classes, in_channels, image_size):
            return {"weights": None}


        def wrong_head(num_classes, in_channels, image_size):
            return build(num_classes + 1, in_channels, image_size)
        ''',
    "acmenet/hooked.py": '''
        from acmenet.models import build


        def shard_units(model):
            return [model.stem, *model.blocks]
        ''',
    "acmenet/broken.py": "import a_module_that_is_not_installed\n",
    "acmenet/data.py": '''
        import numpy as np
        from sklearn.datasets import load_digits


        class Digits:
            """scikit-learn's 8x8 digits as the team keeps them: uint8 HxW arrays and int labels."""

            def __init__(self):
                bunch = load_digits()
                self.images = np.round(bunch.images * (255 / 16)).astype(np.uint8)
                self.labels = bunch.target
                self.classes = [f"digit {d}" for d in range(10)]

            def __len__(self):
                return len(self.labels)

            def __getitem__(self, index):
                return self.images[index], int(self.labels[index])


        def digits():
            return Digits()
        ''',
}


@pytest.fixture
def package(tmp_path, monkeypatch) -> Path:
    """The team's package on this process's path and on the PYTHONPATH its children inherit."""
    root = tmp_path / "site"
    for name, text in PACKAGE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    yield root
    for name in [m for m in sys.modules if m == "acmenet" or m.startswith("acmenet.")]:
        del sys.modules[name]


def test_the_name_and_kwargs_are_checked_where_the_config_is_built():
    assert ModelConfig(name=FACTORY, kwargs={"hidden": 8}).kwargs == {"hidden": 8}
    with pytest.raises(ConfigError, match=r"model.name='acmenet models' is invalid: .*<module>:<callable>"):
        ModelConfig(name="acmenet models")
    with pytest.raises(ConfigError, match="num_classes come from the staged data"):
        ModelConfig(name=FACTORY, kwargs={"num_classes": 3})
    with pytest.raises(ConfigError, match="resnet18 takes none"):
        ModelConfig(name="resnet18", kwargs={"hidden": 8})
    with pytest.raises(ConfigError, match="model.kwargs=.* expected a JSON object"):
        ModelConfig(name=FACTORY, kwargs=[1])
    # The kwargs decide the tensors, so they are part of what a checkpoint must match.
    assert model_identity({"name": FACTORY, "kwargs": {"depth": 3}, "width": 8}) == {
        "name": FACTORY, "kwargs": {"depth": 3}}


def test_preflight_names_the_import_path_of_a_factory_that_fails(package):
    shape, data = (1, 8, 8), "the data in staged/"
    check_model_input(ModelConfig(name=FACTORY, kwargs={"depth": 3}), 10, shape, data)
    cases = {
        "acmenet.broken:build": "module acmenet.broken cannot be imported (ModuleNotFoundError",
        "acmenet.absent:build": "module acmenet.absent cannot be imported",
        "acmenet.models:missing": f"module acmenet.models has no missing: name a callable defined in "
                                  f"{package / 'acmenet' / 'models.py'}",
        "acmenet.models:not_a_model": "returned a dict, not a torch.nn.Module",
    }
    for name, expected in cases.items():
        with pytest.raises(ModelImportError) as error:
            check_model_input(ModelConfig(name=name), 10, shape, data)
        assert str(error.value).startswith(f"model.name={name!r}: ") and expected in str(error.value), name
    with pytest.raises(ModelImportError, match=r"build\(num_classes=10, in_channels=1, image_size=8, "
                                               r"widht=4\) raised TypeError"):
        check_model_input(ModelConfig(name=FACTORY, kwargs={"widht": 4}), 10, shape, data)
    with pytest.raises(ValueError, match=r"'acmenet.models:wrong_head' maps the data in staged/ to logits of "
                                         r"shape \(11,\), not \(10,\): make it return logits"):
        check_model_input(ModelConfig(name="acmenet.models:wrong_head"), 10, shape, data)


def test_fsdp_units_come_from_the_module_hook_or_the_largest_stack(package):
    model = build_model(ModelConfig(name=FACTORY, kwargs={"depth": 3}), 10, (1, 8, 8))
    assert [id(unit) for unit in shard_units(model, FACTORY)] == [id(block) for block in model.blocks]
    hooked = build_model(ModelConfig(name="acmenet.hooked:build"), 10, (1, 8, 8))
    assert shard_units(hooked, "acmenet.hooked:build") == [hooked.stem, *hooked.blocks]
    # Without a repeated stack: the direct children that hold parameters.
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    assert default_units(nn.ModuleDict({"a": flat, "b": nn.ReLU()})) == [flat]


def test_rebuilding_an_imported_model_is_the_users_choice():
    check_trusted("resnet18", False, "x")  # built-in: nothing to allow
    check_trusted(FACTORY, True, "x")
    check_trusted(FACTORY, FACTORY, "x")
    with pytest.raises(ModelImportError, match=r"exported model m.safetensors was trained with the imported "
                                               r"model 'acmenet.models:build': .* --trust-model-code"):
        check_trusted(FACTORY, "acmenet.models:other", "exported model m.safetensors")


def _cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_an_imported_model_trains_on_two_workers_resumes_exports_and_evaluates(package, tmp_path,
                                                                               parallelism):
    """The team's dataset factory is staged (python:<module>:<callable>); two forked workers train the
    team's model on it (dcp checkpoints), a second command resumes it; after the sharded run, export and
    evaluate rebuild it only when allowed, and the result classifies the test split."""
    digits_dir = tmp_path / "staged"
    staged = _cli("traincore.stage", "--source", "python:acmenet.data:digits", "--output", str(digits_dir),
                  "--image-size", "16", "--channels", "1")
    assert staged.returncode == 0, staged.stderr[-3000:]
    assert "staging: 1,797 / 1,797 samples (100%)" in staged.stderr
    model = {"name": FACTORY, "kwargs": {"hidden": 48, "depth": 2}}
    config = json.dumps({"model": model, "loader": {"batch_size": 32}, "optim": {"lr": 0.003},
                         "telemetry": {"tensorboard": False, "progress": "off"}})
    run = tmp_path / "run"
    common = ("--data", str(digits_dir), "--output", str(run), "--preset", "debug", "--config", config,
              "--nproc-per-node", "2", "--parallelism", parallelism, "--checkpoint-mode", "dcp",
              "--checkpoint-every", "40")
    first = _cli("traincore.train", *common, "--max-steps", "40")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = _cli("traincore.train", *common, "--max-steps", "120")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from" in second.stderr and complete_steps(run / "checkpoints")[-1] == 120
    marker = read_marker(step_dir(run / "checkpoints", 120))
    assert marker["world_size"] == 2 and marker["mode"] == "dcp"
    weights, info = read_checkpoint(step_dir(run / "checkpoints", 120))
    saved = info["meta"]["config"]["model"]
    assert (saved["name"], saved["kwargs"]) == (FACTORY, model["kwargs"]) and "blocks.1.0.weight" in weights

    val_accuracy = float(second.stdout.split("val accuracy ")[1].split(";")[0])
    assert val_accuracy >= 0.9, second.stdout
    if parallelism == "ddp":
        return  # export and evaluation read any checkpoint alike: checked once, on the sharded run's
    exported = tmp_path / "model" / "model.safetensors"
    refused = _cli("traincore.export", "--checkpoint", str(run / "checkpoints"), "--output", str(exported))
    assert refused.returncode == 2 and "--trust-model-code" in refused.stderr and not exported.exists()
    done = _cli("traincore.export", "--checkpoint", str(run / "checkpoints"), "--output", str(exported),
                "--model-name", FACTORY)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(exported.with_suffix(".json").read_text())["model"]["kwargs"] == model["kwargs"]
    refused = _cli("traincore.evaluate", "--model", str(exported), "--data", str(digits_dir))
    assert refused.returncode == 2 and f"imported model {FACTORY!r}" in refused.stderr, refused.stderr
    scored = _cli("traincore.evaluate", "--model", str(exported), "--data", str(digits_dir),
                  "--trust-model-code")
    assert scored.returncode == 0, scored.stderr[-3000:]
    accuracy = float(scored.stdout.split("accuracy: ")[1].split()[0])
    print(f"[imported model, {parallelism}] test accuracy {accuracy:.3f}")
    assert accuracy >= 0.9, scored.stdout

    # A warm start from that export, its head excluded, against a start from scratch: the same few steps.
    short = debug().with_overrides({"model": model, "loader.batch_size": 32, "train.max_steps": 8,
                                    "optim": {"lr": 0.003, "warmup_steps": 0},
                                    "telemetry.tensorboard": False})
    scratch = Trainer(short, digits_dir, tmp_path / "scratch").train()
    warm = Trainer(short.with_overrides({"model.init_from": str(exported), "model.init_exclude": ["head.*"]}),
                   digits_dir, tmp_path / "warm").train()
    print(f"[imported model] val accuracy after 8 steps: {warm.val_accuracy:.3f} warm, "
          f"{scratch.val_accuracy:.3f} from scratch")
    assert warm.val_accuracy >= scratch.val_accuracy + 0.2


def test_a_bad_factory_fails_the_cli_before_any_worker_starts(package, digits_dir, tmp_path):
    config = json.dumps({"model": {"name": "acmenet.models:not_a_model"}})
    done = _cli("traincore.train", "--data", str(digits_dir), "--output", str(tmp_path / "run"), "--preset",
                "debug", "--config", config, "--nproc-per-node", "2")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: model.name='acmenet.models:not_a_model':")
    assert "global batch" not in done.stderr  # no worker reached its loader
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_module_hook_may_only_name_parts_of_the_model(package, monkeypatch):
    import acmenet.hooked

    monkeypatch.setattr(acmenet.hooked, "shard_units", lambda model: [nn.Linear(2, 2)])
    model = build_model(ModelConfig(name="acmenet.hooked:build"), 10, (1, 8, 8))
    with pytest.raises(ModelImportError, match="returned modules that are not part of the model"):
        shard_units(model, "acmenet.hooked:build")
    assert isinstance(model(torch.zeros(2, 1, 8, 8)), torch.Tensor)
