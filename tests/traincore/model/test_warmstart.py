"""``model.init_from``: starting weights from a safetensors or torch state-dict file."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import logging

import pytest
import torch
import torchvision
from safetensors.torch import save_file

from traincore.artifacts.export import export
from traincore.checkpoint import MARKER
from traincore.config.presets import debug
from traincore.config.schema import ConfigError, ModelConfig
from traincore.data.manifest import Manifest
from traincore.model.build import build_model
from traincore.model.initfile import read_init_file, read_init_header
from traincore.model.warmstart import InitError, check, plan, warm_start
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
    found = read_init_file(str(path))
    tensors, digest = found.tensors, found.sha256
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest() and not found.layout
    model = small_cnn(classes=10)
    shapes = model.state_dict()

    report = plan(shapes, tensors, ["head.*", "nothing.*"], str(path), digest)
    assert report.excluded == ["head.2.weight", "head.2.bias"] and report.unexpected == ["extra.weight"]
    assert not report.missing and not report.mismatched and report.unused_patterns == ["nothing.*"]
    caplog.set_level(logging.WARNING)
    check(report, strict=True)
    assert "'nothing.*' matches none of the model's tensors" in caplog.text

    strict = plan(shapes, tensors, [], str(path), digest)
    with pytest.raises(InitError, match=r"2 of another shape or dtype: head.2.weight: \[4, 32\] in the "
                                        r"file, \[10, 32\] in the model, .* model.init_strict=false"):
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
    assert read_init_file(str(tmp_path / "wrapped.pt")).tensors.keys() == state.keys()

    torch.save({"weights": argparse.Namespace(code="runs when unpickled")}, tmp_path / "pickled.pth")
    with pytest.raises(InitError, match="pickled.pth' holds pickled objects other than tensors, which "
                                        "loading with weights_only refuses .*argparse.Namespace"):
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
    report = plan(vit.state_dict(), theirs, ["heads.*"], "vit_b_16")
    assert report.excluded == ["heads.head.weight", "heads.head.bias"]
    assert not report.missing and not report.mismatched and not report.unexpected


def test_bad_init_files_fail_preflight_before_any_worker(synthetic_dir, tmp_path):
    config = debug().with_overrides({"telemetry.tensorboard": False})
    wrong = tmp_path / "wide.safetensors"
    save_file(build_model(ModelConfig(name="small_cnn", width=16), 4, (3, 8, 8)).state_dict(), wrong)
    cases = {str(tmp_path / "gone.safetensors"): "does not exist",
             str(wrong): r"does not fit the model: tensors .* of another shape or dtype: features.0.0.weight"}
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


def _init_error(location, model: torch.nn.Module, exclude=()) -> str:
    with pytest.raises(InitError) as error:
        warm_start(model, str(location), list(exclude), strict=True)
    return str(error.value)


def test_training_script_checkpoints_are_unwrapped_and_what_was_found_is_said(tmp_path, caplog):
    """torchvision's reference scripts, Lightning, DDP and torch.compile save the state dict inside a
    checkpoint or under prefixed names: where that is unambiguous it loads, and the log says how."""
    state = small_cnn().state_dict()
    lightning = {"state_dict": {f"model.{k}": v for k, v in state.items()}, "epoch": 3, "global_step": 30}
    layouts = {
        "torchvision.pth": ({"model": state, "optimizer": {"state": {}}, "epoch": 3},
                            "the state dict under 'model', beside optimizer, epoch"),
        "lightning.ckpt.pt": (lightning, "names without their prefix 'model.'"),
        "ddp.pt": ({f"module.{k}": v for k, v in state.items()}, "names without their prefix 'module.'"),
        "compiled-ddp.pt": ({f"module._orig_mod.{k}": v for k, v in state.items()},
                            "names without their prefix 'module._orig_mod.'"),
    }
    caplog.set_level(logging.INFO)
    for name, (saved, said) in layouts.items():
        torch.save(saved, tmp_path / name)
        model = small_cnn()
        torch.nn.init.zeros_(model.head[2].weight)
        report = warm_start(model, str(tmp_path / name), [], strict=True)
        assert len(report.loaded) == len(state) and not report.unexpected, name
        assert torch.equal(model.head[2].weight, state["head.2.weight"]), name
        assert said in caplog.text, (name, caplog.text)

    torch.save({"model": state, "model_ema": state, "epoch": 3}, tmp_path / "two.pt")
    assert ("holds several state dicts, under 'model' and 'model_ema' (its top-level keys: 'model' (20 "
            "tensors), 'model_ema' (20 tensors), 'epoch' (int)): save the one to start from alone, e.g. "
            "torch.save(torch.load(FILE, weights_only=True)['model'], 'weights.pt')") in _init_error(
                tmp_path / "two.pt", small_cnn())
    torch.save({"net": {"weights": [1.0]}, "epoch": 3}, tmp_path / "none.pt")
    assert ("holds no state dict: its top-level keys are 'net' (a dict of 1), 'epoch' (int), and none of "
            "model, state_dict") in _init_error(tmp_path / "none.pt", small_cnn())
    torch.save(small_cnn(), tmp_path / "whole.pt")
    assert "a whole model saved with torch.save(model)" in _init_error(tmp_path / "whole.pt", small_cnn())


def test_nothing_to_load_says_why_and_dtypes_are_checked(tmp_path):
    state = small_cnn().state_dict()
    torch.save(state, tmp_path / "w.pt")
    assert ("model.init_exclude excluded every tensor of the model (20), so nothing of model.init_from="
            in _init_error(tmp_path / "w.pt", small_cnn(), ["*"]))
    torch.save({f"encoder.{k}": v for k, v in state.items()} | {"x": torch.ones(1)}, tmp_path / "other.pt")
    message = _init_error(tmp_path / "other.pt", small_cnn())
    assert "tensors 20 missing from the file" in message
    with pytest.raises(InitError, match=r"shares no tensor .*its names are like encoder.features.0.0.weight, "
                                        r".*the model's like features.0.0.weight"):
        warm_start(small_cnn(), str(tmp_path / "other.pt"), [], strict=False)

    # Half precision converts (a published file often is); integers where the model has floats do not.
    half = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
    save_file(half, tmp_path / "h.safetensors")
    model = small_cnn()
    assert len(warm_start(model, str(tmp_path / "h.safetensors"), [], strict=True).loaded) == len(state)
    assert model.head[2].weight.dtype == torch.float32
    torch.testing.assert_close(model.head[2].weight, state["head.2.weight"].half().float())
    save_file(state | {"head.2.bias": torch.zeros(10, dtype=torch.int64)}, tmp_path / "i.safetensors")
    assert ("1 of another shape or dtype: head.2.bias: int64 in the file, float32 in the model"
            in _init_error(tmp_path / "i.safetensors", small_cnn()))


def test_a_directory_in_place_of_a_weights_file_is_named_with_what_to_pass(tmp_path):
    export_dir = tmp_path / "exported"
    export_dir.mkdir()
    save_file(small_cnn().state_dict(), export_dir / "model.safetensors")
    (export_dir / "model.json").write_text("{}")
    step = tmp_path / "run" / "checkpoints" / "step-000010"
    step.mkdir(parents=True)
    (step / MARKER).write_text("{}")
    (tmp_path / "empty").mkdir()
    weights = export_dir / "model.safetensors"
    cases = {export_dir: f"is a directory: pass the weights file in it, e.g. {weights}",
             step.parent: "is a training checkpoint, not a weights file: export it with `python -m "
                          f"traincore.export --checkpoint {step.parent} --output model.safetensors`",
             step: "is a training checkpoint",
             tmp_path / "empty": "is a directory and holds no weights file"}
    for location, expected in cases.items():
        for read in (read_init_file, read_init_header):
            with pytest.raises(InitError) as error:
                read(str(location))
            assert expected in str(error.value), (location, read, str(error.value))


def test_preflight_reads_only_the_header_and_builds_the_model_once(synthetic_dir, tmp_path, monkeypatch):
    """Preflight checks init_from against the model without reading its tensors (a worker reads them,
    once): a safetensors file by its JSON header, a local torch file memory-mapped. A truncated file is
    found from its header alone."""
    config = debug().with_overrides({"telemetry.tensorboard": False})
    model = build_model(config.model, 4, (3, 8, 8))  # the synthetic data's classes and shape
    save_file(model.state_dict(), tmp_path / "w.safetensors")
    torch.save({"model": model.state_dict(), "epoch": 1}, tmp_path / "w.pt")
    header = read_init_header(str(tmp_path / "w.safetensors"))
    assert {k: (list(v.shape), v.dtype) for k, v in header.tensors.items()} == {
        k: (list(v.shape), v.dtype) for k, v in model.state_dict().items()} and header.sha256 == ""

    import safetensors.torch

    real_load, builds = torch.serialization.load, []  # torch.load itself, kept before the patch below

    def mapped_only(*args, **kwargs):
        assert kwargs.get("mmap"), "preflight read a torch file whole"
        return real_load(*args, **kwargs)

    def counted(*args, **kwargs):
        builds.append(args)
        return build_model(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "load", lambda *a, **k: pytest.fail("preflight read the tensors"))
    monkeypatch.setattr(torch, "load", mapped_only)
    # traincore.run binds the name preflight to the function: the module is reached by its full name.
    monkeypatch.setattr(importlib.import_module("traincore.run.preflight"), "build_model", counted)
    for name in ("w.safetensors", "w.pt"):
        builds.clear()
        preflight(config.with_overrides({"model.init_from": str(tmp_path / name)}), synthetic_dir)
        assert len(builds) == 1, name

    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])
    cut = config.with_overrides({"model.init_from": str(tmp_path / "cut.safetensors")})
    with pytest.raises(InitError, match=f"holds {len(data) - 10} bytes, but its header describes "
                                        f"{len(data)}: the file is truncated"):
        preflight(cut, synthetic_dir)


def test_an_object_store_file_fails_as_one_error_naming_it_and_the_fix(s3_server, synthetic_dir, tmp_path,
                                                                       monkeypatch):
    """Through the checkpoint store layer: read with the checkpoint root's credentials and endpoint (in
    preflight from the header alone); without credentials, with an unreachable endpoint, for a missing
    object or a prefix, one InitError naming the URI and the fix, never the store library's traceback."""
    import uuid

    import safetensors.torch

    from traincore.checkpoint import Store
    from traincore.model.initfile import store_options

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    config = debug().with_overrides({"telemetry.tensorboard": False})
    data = safetensors.torch.save(build_model(config.model, 4, (3, 8, 8)).state_dict())
    prefix = f"init-{uuid.uuid4().hex[:8]}"
    s3_server.client().put_object(Bucket=s3_server.bucket, Key=f"{prefix}/model.safetensors", Body=data)
    uri = f"s3://{s3_server.bucket}/{prefix}/model.safetensors"
    root = Store(f"s3://{s3_server.bucket}/{prefix}/checkpoints", s3_server.storage_options)
    options = store_options(uri, root)
    assert options == s3_server.storage_options and store_options("/local/w.pt", root) == {}
    assert read_init_file(uri, options).sha256 == hashlib.sha256(data).hexdigest()
    with monkeypatch.context() as patch:  # preflight reads the header only: two ranged reads
        patch.setattr(safetensors.torch, "load", lambda *a, **k: pytest.fail("preflight read the tensors"))
        preflight(config.with_overrides({"model.init_from": uri}), synthetic_dir, tmp_path / "run", root)

    fix = "check that the object exists and that this machine reaches the store with credentials"
    # Nothing listens on port 9; one attempt (botocore retries a refused connection for seconds).
    unreachable = {**options, "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
                   "config_kwargs": {"retries": {"max_attempts": 1}}}
    cases = [(uri, {"client_kwargs": options["client_kwargs"]},
              rf"cannot be read \(NoCredentialsError: Unable to locate credentials\): {fix}"),
             (uri, unreachable, rf"cannot be read \(EndpointConnectionError: .*\): {fix}"),
             (uri.replace("model.", "absent."), options, "does not exist: pass the path or URI"),
             (uri.rsplit("/", 1)[0], options, f"is a directory: pass the weights file in it, e.g. {uri}")]
    for location, given, expected in cases:
        for read in (read_init_header, read_init_file):
            with pytest.raises(InitError, match=f"^model.init_from='{location}'.*{expected}"):
                read(location, given)
