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

from traincore.artifacts.evaluate import main as evaluate_main
from traincore.artifacts.export import main as export_main
from traincore.checkpoint import complete_steps, read_checkpoint, read_marker, step_dir
from traincore.config.presets import debug
from traincore.config.schema import ConfigError, ModelConfig, model_identity
from traincore.model.build import ModelImportError, build_model, check_trusted, default_units, shard_units
from traincore.run.cli import main as train_main
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


        class Weightless(nn.Module):
            def __init__(self, num_classes):
                super().__init__()
                self.num_classes = num_classes

            def forward(self, x):
                return x.new_zeros(x.shape[0], self.num_classes)


        def weightless(num_classes, in_channels, image_size):
            return Weightless(num_classes)


        def wrong_head(num_classes, in_channels, image_size):
            return build(num_classes + 1, in_channels, image_size)
        ''',
    "acmenet/hooked.py": '''
        from acmenet.models import build


        def shard_units(model):
            return [model.stem, *model.blocks]
        ''',
    "acmenet/broken.py": "import a_module_that_is_not_installed\n",
    "acmenet/exits.py": '''
        import sys

        from torch import nn

        from acmenet.models import build


        def exits(num_classes, in_channels, image_size):
            sys.exit(0)


        def interrupted(num_classes, in_channels, image_size):
            raise KeyboardInterrupt


        def dataset():
            sys.exit("no data here")


        def shard_units(model):
            sys.exit(3)


        class Quits(nn.Module):
            def forward(self, x):
                sys.exit(0)


        class Broken(nn.Module):
            def forward(self, x):
                return self.missing(x)


        def quits(num_classes, in_channels, image_size):
            return Quits()


        def broken(num_classes, in_channels, image_size):
            return Broken()
        ''',
    # A training script without `if __name__ == "__main__":`: importing it runs it.
    "acmenet/script.py": '''
        import sys

        from acmenet.models import build

        sys.exit(0)
        ''',
    # Factories that take none of the data's arguments, or hand them all on (as torchvision's builders do).
    "acmenet/fixed.py": '''
        from torch import nn


        def rgb_net(image_size):
            return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.Linear(8, 1000))


        def lazy():
            return nn.Sequential(nn.LazyConv2d(4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(4, 1000))


        def grouped():
            return nn.Sequential(nn.Conv2d(3, 6, 3, groups=3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(6, 1000))


        class Classifier(nn.Module):
            def __init__(self, num_classes, width=4):
                super().__init__()
                self.net = nn.Sequential(nn.Conv2d(3, width, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                         nn.Linear(width, num_classes))

            def forward(self, x):
                return self.net(x)


        def forwarding(**kwargs):
            return Classifier(**kwargs)


        class Branchy(nn.Module):
            """Reads a value in its forward, which tensors on the meta device do not have."""

            def __init__(self, num_classes):
                super().__init__()
                self.head = nn.Linear(3, num_classes)

            def forward(self, x):
                x = x.mean(dim=(2, 3))
                return self.head(x) if float(x.abs().sum()) >= 0 else -self.head(x)


        def branchy(num_classes):
            return Branchy(num_classes)
        ''',
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


def write_package(root: Path) -> Path:
    """The team's package, written under ``root``."""
    for name, text in PACKAGE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def python_path(root: Path) -> str:
    """PYTHONPATH with ``root`` first."""
    return os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))


@pytest.fixture
def package(tmp_path, monkeypatch) -> Path:
    """The team's package on this process's path and on the PYTHONPATH its children inherit."""
    root = write_package(tmp_path / "site")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", python_path(root))
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
    # Once refused by the optimizer ("got an empty parameter list") after the workers had started:
    with pytest.raises(ValueError, match=r"model.name='acmenet.models:weightless' builds a model with no "
                                         r"parameters: there is nothing to train"):
        check_model_input(ModelConfig(name="acmenet.models:weightless"), 10, shape, data)


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
        check_trusted(FACTORY, False, "exported model m.safetensors")
    # --model-name naming another factory: the message names both, not "allow it"
    with pytest.raises(ModelImportError, match=r"'acmenet.models:build', not 'acmenet.models:other' that "
                                               r"you allowed: pass the import path it names "
                                               r"\(acmenet.models:build\)"):
        check_trusted(FACTORY, "acmenet.models:other", "exported model m.safetensors")


def _cli(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture(scope="module")
def team_digits(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The team's dataset factory (python:<module>:<callable>) staged by the staging CLI, the package on its
    PYTHONPATH, once for the module's runs (which only read it): the staged directory and the command."""
    site = write_package(tmp_path_factory.mktemp("team") / "site")
    digits_dir = tmp_path_factory.mktemp("team-digits") / "staged"
    staged = _cli("traincore.stage", "--source", "python:acmenet.data:digits", "--output", str(digits_dir),
                  "--image-size", "16", "--channels", "1", env={"PYTHONPATH": python_path(site)})
    return digits_dir, staged


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_an_imported_model_trains_on_two_workers_resumes_exports_and_evaluates(package, team_digits, tmp_path,
                                                                               capsys, parallelism):
    """The team's dataset factory is staged (python:<module>:<callable>); two forked workers train the
    team's model on it (dcp checkpoints), a second command resumes it; after the sharded run, export and
    evaluate (their CLIs' main(), in this process) rebuild it only when allowed, and the result classifies
    the test split."""
    digits_dir, staged = team_digits
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
    capsys.readouterr()
    refused = export_main(["--checkpoint", str(run / "checkpoints"), "--output", str(exported)])
    stderr = capsys.readouterr().err
    assert refused == 2 and "--trust-model-code" in stderr and not exported.exists()
    done = export_main(["--checkpoint", str(run / "checkpoints"), "--output", str(exported),
                            "--model-name", FACTORY])
    assert done == 0, capsys.readouterr().err[-3000:]
    assert json.loads(exported.with_suffix(".json").read_text())["model"]["kwargs"] == model["kwargs"]
    capsys.readouterr()
    refused = evaluate_main(["--model", str(exported), "--data", str(digits_dir)])
    stderr = capsys.readouterr().err
    assert refused == 2 and f"imported model {FACTORY!r}" in stderr, stderr
    scored = evaluate_main(["--model", str(exported), "--data", str(digits_dir), "--trust-model-code"])
    printed = capsys.readouterr()
    assert scored == 0, printed.err[-3000:]
    accuracy = float(printed.out.split("accuracy: ")[1].split()[0])
    print(f"[imported model, {parallelism}] test accuracy {accuracy:.3f}")
    assert accuracy >= 0.9, printed.out

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


@pytest.mark.parametrize("factory", ["acmenet.models:not_a_model", "acmenet.exits:exits"])
def test_a_bad_factory_fails_the_cli_before_any_worker_starts(package, digits_dir, tmp_path, factory,
                                                              monkeypatch, capfd):
    """A factory that returns no module, or calls sys.exit(0) (which once ended the run with exit code 0 and
    nothing written), is one error line and exit code 2: the CLI's main() in this process, which would fork
    the workers (what reaches file descriptor 2, theirs too)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = json.dumps({"model": {"name": factory}})
    code = train_main(["--data", str(digits_dir), "--output", str(tmp_path / "run"), "--preset", "debug",
                       "--config", config, "--nproc-per-node", "2"])
    stderr = capfd.readouterr().err
    assert code == 2
    assert stderr.strip().splitlines()[-1].startswith(f"error: model.name={factory!r}:")
    assert "global batch" not in stderr  # no worker reached its loader
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_module_hook_may_only_name_parts_of_the_model(package, monkeypatch):
    import acmenet.hooked

    monkeypatch.setattr(acmenet.hooked, "shard_units", lambda model: [nn.Linear(2, 2)])
    model = build_model(ModelConfig(name="acmenet.hooked:build"), 10, (1, 8, 8))
    with pytest.raises(ModelImportError, match="returned modules that are not part of the model"):
        shard_units(model, "acmenet.hooked:build")
    assert isinstance(model(torch.zeros(2, 1, 8, 8)), torch.Tensor)


def test_a_sys_exit_in_the_users_code_is_an_error_naming_it(package):
    """sys.exit() in a factory, in a module's import (a script without its `if __name__ == "__main__":`),
    in a shard_units hook or in a data source's factory would end the run quietly, with exit code 0 for
    sys.exit(0): each is an error naming the code instead. KeyboardInterrupt still stops the run."""
    from traincore.data.manifest import StagingError
    from traincore.data.pysource import open_dataset

    shape = (1, 8, 8)
    exits = {
        "acmenet.exits:exits": "model.name='acmenet.exits:exits': acmenet.exits:exits() called sys.exit(0)",
        "acmenet.script:build": "model.name='acmenet.script:build': importing module acmenet.script called "
                                "sys.exit(0)",
    }
    for name, expected in exits.items():
        with pytest.raises(ModelImportError, match=r"if __name__ == \"__main__\"") as error:
            check_model_input(ModelConfig(name=name), 10, shape, "the data")
        assert str(error.value).startswith(expected), str(error.value)
    with pytest.raises(ModelImportError, match=r"'acmenet.exits:quits': its forward called sys.exit\(0\)"):
        check_model_input(ModelConfig(name="acmenet.exits:quits"), 10, shape, "the data")
    with pytest.raises(ValueError, match=r"'acmenet.exits:broken': its forward on the data \(zeros of shape "
                                         r"\(1, 8, 8\)\) raised AttributeError: .*'missing': fix the model"):
        check_model_input(ModelConfig(name="acmenet.exits:broken"), 10, shape, "the data")
    model = build_model(ModelConfig(name="acmenet.exits:build"), 10, shape)
    with pytest.raises(ModelImportError, match=r"its module's shard_units\(model\) called sys.exit\(3\)"):
        shard_units(model, "acmenet.exits:build")
    with pytest.raises(StagingError, match=r"acmenet.exits:dataset\(\) called sys.exit\('no data here'\)"):
        open_dataset("acmenet.exits:dataset")
    with pytest.raises(KeyboardInterrupt):
        build_model(ModelConfig(name="acmenet.exits:interrupted"), 10, shape)


def test_a_model_that_reads_values_in_its_forward_is_checked_on_cpu(package):
    """Preflight runs an imported model on the meta device, which has no values: one whose forward reads
    one (.item(), a branch on a tensor) is checked on CPU zeros instead of being refused."""
    check_model_input(ModelConfig(name="acmenet.fixed:branchy"), 10, (3, 8, 8), "the data")
    with pytest.raises(ValueError, match=r"'acmenet.fixed:branchy' cannot take the data: samples of shape "
                                         r"\(1, 8, 8\) .*mat1 and mat2 shapes cannot be multiplied"):
        check_model_input(ModelConfig(name="acmenet.fixed:branchy"), 10, (1, 8, 8), "the data")


def test_a_torchvision_builder_is_called_with_what_it_takes_and_fitted_to_the_data(package, caplog):
    """torchvision.models:resnet18 (whose **kwargs reach ResNet, which takes num_classes only) trains on
    one-channel data: called with num_classes, its RGB stem replaced by one for the data's channels. A
    factory that takes none of the three gets its head fitted too; one whose stem cannot be refit says what
    to write."""
    import logging

    caplog.set_level(logging.INFO)
    shape = (1, 16, 16)
    resnet = ModelConfig(name="torchvision.models:resnet18")
    check_model_input(resnet, 10, shape, "the data")  # on the meta device
    model = build_model(resnet, 10, shape)
    assert (model.conv1.in_channels, model.conv1.out_channels, model.fc.out_features) == (1, 64, 10)
    assert ("its first layer conv1 (a Conv2d for 3 channels) is replaced by a fresh one for the data's 1"
            in caplog.text)

    fixed = build_model(ModelConfig(name="acmenet.fixed:rgb_net"), 10, shape)
    assert fixed[0].in_channels == 1 and fixed[-1].out_features == 10
    assert fixed(torch.zeros(2, *shape)).shape == (2, 10)
    assert "its last layer 4 (a Linear of 1000 outputs) is replaced by a fresh one of 10" in caplog.text
    lazy = build_model(ModelConfig(name="acmenet.fixed:lazy"), 10, shape)  # fits its first input itself
    assert isinstance(lazy[0], nn.LazyConv2d) and lazy(torch.zeros(2, *shape)).shape == (2, 10)
    forwarded = build_model(ModelConfig(name="acmenet.fixed:forwarding", kwargs={"width": 6}), 10, shape)
    assert forwarded.net[0].in_channels == 1 and forwarded.net[-1].out_features == 10
    with pytest.raises(ModelImportError, match=r"first layer 0 is a grouped Conv2d for 3 channels, "
                                               r"which cannot be refit to the data's 1: write a factory of "
                                               r"your own that takes in_channels"):
        build_model(ModelConfig(name="acmenet.fixed:grouped"), 10, shape)
    # A misspelt argument of the user's own is never dropped: it is the user's to fix.
    with pytest.raises(ModelImportError, match=r"forwarding\(num_classes=10, widht=6\) raised TypeError: "
                                               r".*unexpected keyword argument 'widht'"):
        build_model(ModelConfig(name="acmenet.fixed:forwarding", kwargs={"widht": 6}), 10, shape)


def test_preflight_checks_the_fsdp_units_of_an_imported_model(package, synthetic_dir, monkeypatch):
    """Under FSDP a module's shard_units hook runs in every worker: preflight runs it first."""
    import acmenet.hooked

    from traincore.run.preflight import preflight

    config = debug().with_overrides({"model.name": "acmenet.hooked:build", "dist.parallelism": "fsdp",
                                     "telemetry.tensorboard": False})
    preflight(config, synthetic_dir)
    monkeypatch.setattr(acmenet.hooked, "shard_units", lambda model: [nn.Linear(2, 2)])
    with pytest.raises(ModelImportError, match="returned modules that are not part of the model"):
        preflight(config, synthetic_dir)
    monkeypatch.setattr(acmenet.hooked, "shard_units", lambda model: model.missing)
    with pytest.raises(ModelImportError, match=r"its module's shard_units\(model\) raised AttributeError"):
        preflight(config, synthetic_dir)
