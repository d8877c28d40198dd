"""``model.init_from``: starting weights from a safetensors or torch state-dict file."""

from __future__ import annotations

import argparse
import hashlib
import logging

import pytest
import torch
import torchvision
from safetensors.torch import save_file

from traincore.artifacts.export import export
from traincore.config.presets import debug
from traincore.config.schema import ConfigError, ModelConfig
from traincore.data.manifest import Manifest
from traincore.model.build import build_model
from traincore.model.warmstart import InitError, check, plan, read_init_file, warm_start
from traincore.run.preflight import preflight
from traincore.run.trainer import Trainer

SHAPE = (1, 16, 16)


def small_cnn(width: int = 8, classes: int = 10) -> torch.nn.Module:
    return build_model(ModelConfig(name="small_cnn", width=width), classes, SHAPE, seed=1)


def test_every_tensor_is_sorted_and_a_misfit_is_named(tmp_path, caplog):
    source = small_cnn(classes=4).state_dict()
    source["extra.weight"] = torch.ones(2)
    path = tmp_path / "w.safetensors"
    save_file(source, path)
    tensors, digest = read_init_file(str(path))
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    model = small_cnn(classes=10)
    shapes = {name: value.shape for name, value in model.state_dict().items()}

    report = plan(shapes, tensors, ["head.*", "nothing.*"], str(path), digest)
    assert report.excluded == ["head.2.weight", "head.2.bias"] and report.unexpected == ["extra.weight"]
    assert not report.missing and not report.mismatched and report.unused_patterns == ["nothing.*"]
    caplog.set_level(logging.WARNING)
    check(report, strict=True)
    assert "'nothing.*' matches none of the model's tensors" in caplog.text

    strict = plan(shapes, tensors, [], str(path), digest)
    with pytest.raises(InitError, match=r"2 of another shape: head.2.weight: \[4, 32\] in the file, "
                                        r"\[10, 32\] in the model, .* model.init_strict=false"):
        check(strict, strict=True)
    check(strict, strict=False)  # loads what fits

    loaded = warm_start(model, str(path), ["head.*"], strict=True)
    assert len(loaded.loaded) == len(shapes) - 2
    for name in loaded.loaded:
        assert torch.equal(model.state_dict()[name], source[name]), name
    assert not torch.equal(model.state_dict()["head.2.bias"][:4], source["head.2.bias"])


def test_a_torch_state_dict_is_read_with_weights_only_and_may_be_wrapped(tmp_path):
    state = small_cnn().state_dict()
    torch.save({"state_dict": state}, tmp_path / "wrapped.pt")
    assert read_init_file(str(tmp_path / "wrapped.pt"))[0].keys() == state.keys()

    torch.save({"weights": argparse.Namespace(code="runs when unpickled")}, tmp_path / "pickled.pth")
    with pytest.raises(InitError, match="pickled.pth' cannot be read .*Unpickl"):
        read_init_file(str(tmp_path / "pickled.pth"))
    (tmp_path / "torn.safetensors").write_bytes(b"\x10\x00\x00")
    with pytest.raises(InitError, match="torn.safetensors' cannot be read .*damaged"):
        read_init_file(str(tmp_path / "torn.safetensors"))
    with pytest.raises(InitError, match="absent.pt' does not exist"):
        read_init_file(str(tmp_path / "absent.pt"))
    with pytest.raises(InitError, match="a .bin file is neither safetensors nor a torch state dict"):
        read_init_file(str(tmp_path / "weights.bin"))


def test_torchvisions_state_dicts_load_into_the_built_in_models_without_renaming(tmp_path):
    """A state dict in the format torchvision publishes (its own models' state_dict(), saved with
    torch.save) loads into our resnet18 with only the head excluded for another class count; vit_b_16's
    names and shapes line up the same way (compared on the meta device: no 330 MB of weights)."""
    published = tmp_path / "resnet18-imagenet.pth"
    torch.save(torchvision.models.resnet18().state_dict(), published)
    ours = build_model(ModelConfig(name="resnet18"), 10, (3, 32, 32))
    report = warm_start(ours, str(published), ["fc.*"], strict=True)
    assert report.excluded == ["fc.weight", "fc.bias"] and not report.unexpected and not report.missing
    with torch.device("meta"):
        theirs = torchvision.models.vit_b_16().state_dict()
        vit = build_model(ModelConfig(name="vit_b_16"), 10, (3, 224, 224))
    shapes = {name: value.shape for name, value in vit.state_dict().items()}
    report = plan(shapes, theirs, ["heads.*"], "vit_b_16", "")
    assert report.excluded == ["heads.head.weight", "heads.head.bias"]
    assert not report.missing and not report.mismatched and not report.unexpected


def test_bad_init_files_fail_preflight_before_any_worker(synthetic_dir, tmp_path):
    config = debug().with_overrides({"telemetry.tensorboard": False})
    wrong = tmp_path / "wide.safetensors"
    save_file(build_model(ModelConfig(name="small_cnn", width=16), 4, (3, 8, 8)).state_dict(), wrong)
    cases = {str(tmp_path / "gone.safetensors"): "does not exist",
             str(wrong): r"does not fit the model: tensors .* of another shape: features.0.0.weight"}
    for location, message in cases.items():
        with pytest.raises(InitError, match=message):
            preflight(config.with_overrides({"model.init_from": location}), synthetic_dir, tmp_path / "run")
        assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run").rglob("step-*"))
    with pytest.raises(ConfigError, match="it applies to model.init_from, which is empty"):
        ModelConfig(init_exclude=["head.*"])


def test_a_warm_start_beats_scratch_resumes_without_it_and_is_in_the_lineage(synthetic_dir, tmp_path, caplog):
    """A model exported from a trained run, its head excluded, starts a run on the same data: after the
    same few steps it is clearly ahead of one from scratch. A resume of the warm run ignores init_from and
    says so; the export's lineage names the file's sha256."""
    base = debug().with_overrides({"telemetry.tensorboard": False, "train.eval_every": 0,
                                   "checkpoint.every": 0})
    Trainer(base.with_overrides({"train.max_steps": 120}), synthetic_dir, tmp_path / "teacher").train()
    weights = tmp_path / "teacher-model" / "model.safetensors"
    export(tmp_path / "teacher" / "checkpoints", weights)
    short = base.with_overrides({"train.max_steps": 6, "optim.warmup_steps": 0})
    scratch = Trainer(short, synthetic_dir, tmp_path / "scratch").train()
    warm_cfg = short.with_overrides({"model.init_from": str(weights), "model.init_exclude": ["head.*"]})
    caplog.set_level(logging.INFO)
    warm = Trainer(warm_cfg, synthetic_dir, tmp_path / "warm").train()
    assert f"model.init_from {weights}" in caplog.text
    assert "2 excluded (head.2.weight, head.2.bias)" in caplog.text
    print(f"[warm start] val accuracy after 6 steps: {warm.val_accuracy:.3f} warm, "
          f"{scratch.val_accuracy:.3f} from scratch")
    assert warm.val_accuracy >= scratch.val_accuracy + 0.2, (warm.val_accuracy, scratch.val_accuracy)

    caplog.clear()
    resumed = Trainer(warm_cfg.with_overrides({"train.max_steps": 8}), synthetic_dir, tmp_path / "warm",
                      manifest=Manifest.load(synthetic_dir)).train()
    assert resumed.resumed_from == 6 and "model.init_from" in caplog.text and "is ignored" in caplog.text
    model = export(tmp_path / "warm" / "checkpoints", tmp_path / "warm-model" / "model.safetensors")
    assert model.lineage.init_sha256 == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert export(tmp_path / "scratch" / "checkpoints", tmp_path / "s.safetensors").lineage.init_sha256 == ""
