"""Export of sync and DCP checkpoints to safetensors, loading it back, and the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from traincore.artifacts.export import ExportError, export, load_exported, main
from traincore.checkpoint import Checkpointer, CheckpointError, step_dir, verify_checkpoint
from traincore.config.schema import CheckpointConfig, Config, ModelConfig
from traincore.files import sha256_file
from traincore.model.build import build_model, parameter_count
from traincore.run.state import ModelState, OptimizerState, RunMeta, StateRegistry

export_module = sys.modules["traincore.artifacts.export"]  # the package's `export` is the function
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

REPO = Path(__file__).resolve().parents[3]
SHAPE = (1, 8, 8)


def trained_checkpoint(root: Path, mode: str, steps: int = 4) -> nn.Module:
    """Train a tiny small_cnn (BatchNorm buffers included) a few steps, save it under ``root``, return it."""
    torch.manual_seed(0)
    model_cfg = ModelConfig(name="small_cnn", width=4)
    model = build_model(model_cfg, 3, SHAPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    meta = {"config": Config(model=model_cfg).to_dict(), "num_classes": 3, "shape": list(SHAPE),
            "classes": ["a", "b", "c"], "mean": [0.5], "std": [0.25], "source": "synthetic", "world_size": 1}
    for _ in range(steps):
        F.cross_entropy(model(torch.randn(8, *SHAPE)), torch.randint(0, 3, (8,))).backward()
        optimizer.step()
        optimizer.zero_grad()
    registry = StateRegistry()
    registry.register("model", ModelState(model))
    registry.register("optimizer", OptimizerState(model, optimizer))
    registry.register("run", RunMeta(meta))
    Checkpointer(root, CheckpointConfig(mode=mode), registry).save(steps)
    return model


@pytest.mark.parametrize("mode", ["sync", "dcp"])
def test_export_matches_the_trained_model(tmp_path, mode):
    model = trained_checkpoint(tmp_path / "checkpoints", mode)
    output = tmp_path / "out" / "model.safetensors"
    result = export(tmp_path / "checkpoints", output)  # the root: latest complete step

    config = json.loads((tmp_path / "out" / "model.json").read_text())
    assert result.path == str(output) and result.config_path == str(tmp_path / "out" / "model.json")
    assert result.sha256 == config["sha256"] == sha256_file(output)
    assert result.num_bytes == output.stat().st_size
    assert result.step == config["step"] == 4
    assert result.num_parameters == config["num_parameters"] == parameter_count(model)
    assert config["classes"] == ["a", "b", "c"] and config["shape"] == list(SHAPE)
    assert config["model"]["name"] == "small_cnn" and config["checkpoint_mode"] == mode

    exported, loaded_config = load_exported(output)
    assert loaded_config == config and not exported.training
    x = torch.randn(5, *SHAPE)
    with torch.no_grad():
        assert torch.equal(exported(x), model.eval()(x))


@pytest.mark.parametrize("dtype, cast", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_export_stores_the_weights_in_the_dtype_asked_for(tmp_path, dtype, cast):
    model = trained_checkpoint(tmp_path / "checkpoints", "sync")
    full = export(tmp_path / "checkpoints", tmp_path / "full" / "model.safetensors")
    half = export(tmp_path / "checkpoints", tmp_path / "half" / "model.safetensors", dtype=dtype)
    from safetensors.torch import load_file

    stored = load_file(half.path)
    floats = {name for name, tensor in model.state_dict().items() if tensor.is_floating_point()}
    assert {name for name, tensor in stored.items() if tensor.dtype == cast} == floats
    assert stored["features.0.1.num_batches_tracked"].dtype == torch.int64  # integers keep theirs
    assert half.dtype == dtype and json.loads(Path(half.config_path).read_text())["dtype"] == dtype
    assert half.num_bytes < full.num_bytes
    exported, _ = load_exported(half.path)  # computes in float32, within the cast's rounding
    x = torch.randn(5, *SHAPE)
    with torch.no_grad():
        reference = model.eval()(x)
        assert torch.allclose(exported(x), reference, atol=0.1 * reference.abs().max().item())
    with pytest.raises(ExportError, match=r"dtype 'int8' \(--dtype\) is not one of float32, bfloat16"):
        export(tmp_path / "checkpoints", tmp_path / "bad" / "model.safetensors", dtype="int8")
    assert not (tmp_path / "bad").exists()


def test_export_from_a_step_directory(tmp_path):
    trained_checkpoint(tmp_path, "sync", steps=2)
    previous = os.umask(0o027)
    try:
        result = export(step_dir(tmp_path, 2), tmp_path / "m.safetensors")
    finally:
        os.umask(previous)
    assert result.step == 2
    # The weights are as readable as the config beside them (safetensors alone would leave them 0600).
    modes = {Path(path).stat().st_mode & 0o777 for path in (result.path, result.config_path)}
    assert modes == {0o640}


def test_corrupted_export_is_rejected(tmp_path):
    trained_checkpoint(tmp_path / "checkpoints", "sync")
    output = tmp_path / "model.safetensors"
    export(tmp_path / "checkpoints", output)
    data = bytearray(output.read_bytes())
    data[-1] ^= 0xFF
    output.write_bytes(data)
    with pytest.raises(ExportError, match="sha256 .* corrupt or was replaced"):
        load_exported(output)


def test_corrupted_checkpoint_is_not_exported(tmp_path):
    trained_checkpoint(tmp_path, "sync")
    state_file = step_dir(tmp_path, 4) / "state.pt"
    state_file.write_bytes(state_file.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated"):
        export(tmp_path, tmp_path / "model.safetensors")
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize("name, match", [
    ("out", "is a directory: pass a file path such as"),
    ("m.json", "use a .safetensors name such as"),
    ("checkpoints/step-000004/model.safetensors", "inside the checkpoint .*step-000004, which must not"),
])
def test_export_refuses_an_output_it_cannot_own(tmp_path, name, match):
    trained_checkpoint(tmp_path / "checkpoints", "sync")
    (tmp_path / "out").mkdir()
    before = sorted(p.name for p in (tmp_path / "checkpoints" / "step-000004").iterdir())
    with pytest.raises(ExportError, match=match):
        export(tmp_path / "checkpoints", tmp_path / name)
    assert not (tmp_path / "m.json").exists() and not any((tmp_path / "out").iterdir())
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "step-000004").iterdir()) == before
    verify_checkpoint(step_dir(tmp_path / "checkpoints", 4))


def wrong_logits(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros(len(x), 7)


def shape_error(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")


@pytest.mark.parametrize("forward, match", [
    (wrong_logits, r"maps a batch of 2 to logits of shape \(2, 7\), expected \(2, 3\)"),
    (shape_error, r"fails on a batch of 2 inputs of shape \(1, 8, 8\) \(mat1 and mat2"),
])
def test_a_model_that_fails_the_forward_pass_is_not_published(tmp_path, monkeypatch, forward, match):
    trained_checkpoint(tmp_path / "checkpoints", "sync")

    def broken(*args) -> nn.Module:  # the checkpoint's weights load, but the model does not work
        model = build_model(*args)
        model.forward = forward
        return model

    monkeypatch.setattr(export_module, "build_model", broken)
    with pytest.raises(ExportError, match=match):
        export(tmp_path / "checkpoints", tmp_path / "out" / "model.safetensors")
    assert list((tmp_path / "out").iterdir()) == []  # neither the model, nor its config, nor a .tmp


def test_a_failed_write_leaves_no_tmp_file(tmp_path, monkeypatch):
    trained_checkpoint(tmp_path / "checkpoints", "sync")

    def disk_full(tensors, path):
        Path(path).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_module, "save_file", disk_full)
    output = tmp_path / "out" / "model.safetensors"
    with pytest.raises(ExportError, match=f"cannot write {output}: No space left on device: free space"):
        export(tmp_path / "checkpoints", output)
    assert list((tmp_path / "out").iterdir()) == []


def test_cli_missing_checkpoint_exits_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "traincore.export", "--checkpoint", str(tmp_path / "nope"),
               "--output", str(tmp_path / "m.safetensors")]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 2
    assert f"error: checkpoint {tmp_path / 'nope'} does not exist" in done.stderr


def test_cli_empty_root_exits_2_and_success_prints_summary(tmp_path, capsys):
    assert main(["--checkpoint", str(tmp_path), "--output", str(tmp_path / "m.safetensors")]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err

    trained_checkpoint(tmp_path, "dcp")
    assert main(["--checkpoint", str(tmp_path), "--output", str(tmp_path / "m.safetensors")]) == 0
    line = capsys.readouterr().out.strip()
    digest = sha256_file(tmp_path / "m.safetensors")
    assert line.startswith(f"exported {tmp_path / 'm.safetensors'} (") and f"sha256 {digest[:12]}" in line
    assert "step 4" in line and "parameters" in line


def test_output_inside_another_committed_checkpoint_is_refused(tmp_path):
    trained_checkpoint(tmp_path / "checkpoints", "sync", steps=2)
    trained_checkpoint(tmp_path / "checkpoints", "sync", steps=4)
    older = step_dir(tmp_path / "checkpoints", 2)
    with pytest.raises(ExportError, match=f"inside the checkpoint {older}, which must not change"):
        export(tmp_path / "checkpoints", older / "model.safetensors")  # exports step 4, writes into step 2
    assert not (older / "model.safetensors").exists()
    verify_checkpoint(older)


def test_unwritable_output_is_refused_before_any_work_and_creates_nothing(tmp_path, monkeypatch):
    trained_checkpoint(tmp_path / "checkpoints", "sync")
    (tmp_path / "plain").write_text("a file")

    def must_not_read(*args):
        raise AssertionError("the checkpoint was read before the output was checked")

    monkeypatch.setattr(export_module, "read_checkpoint", must_not_read)
    with pytest.raises(ExportError, match=f"cannot write {tmp_path}/plain/m/model.safetensors: "
                                          f"{tmp_path}/plain is a file, not a directory: choose an --output"):
        export(tmp_path / "checkpoints", tmp_path / "plain" / "m" / "model.safetensors")
    with pytest.raises(ExportError, match="is a directory: pass a file path such as"):
        export(tmp_path / "checkpoints", f"{tmp_path}/new/")  # a trailing slash means a directory
    assert not (tmp_path / "new").exists()


def test_a_checkpoint_that_is_a_file_is_named(tmp_path):
    (tmp_path / "state.pt").write_bytes(b"\0" * 10)
    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path}/state.pt is a file: pass a step"):
        export(tmp_path / "state.pt", tmp_path / "m.safetensors")


def test_weights_without_their_config_are_not_left_behind(tmp_path, monkeypatch):
    """The config is published last; when that fails, the weights and lineage just published go too."""
    trained_checkpoint(tmp_path / "checkpoints", "sync")
    write_atomically = export_module.write_atomically

    def fail_config(path, text):
        if path.name != "m.json":
            return write_atomically(path, text)
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(export_module, "write_atomically", fail_config)
    with pytest.raises(ExportError, match=r"No space left on device \(.*m\.json\)"):
        export(tmp_path / "checkpoints", tmp_path / "out" / "m.safetensors")
    assert list((tmp_path / "out").iterdir()) == []


def test_ctrl_c_during_an_export_leaves_nothing_and_is_one_line(tmp_path, monkeypatch, capsys):
    """Ctrl-C as the config is written: the weights and lineage already published go, and the CLI says so
    in one line with exit 130 instead of a traceback."""
    trained_checkpoint(tmp_path / "checkpoints", "sync")
    write_atomically = export_module.write_atomically

    def interrupted(path, text):
        if path.name == "m.json":
            raise KeyboardInterrupt
        return write_atomically(path, text)

    monkeypatch.setattr(export_module, "write_atomically", interrupted)
    output = tmp_path / "out" / "m.safetensors"
    assert main(["--checkpoint", str(tmp_path / "checkpoints"), "--output", str(output)]) == 130
    assert capsys.readouterr().err == f"interrupted: no model was exported to {output}\n"
    assert list((tmp_path / "out").iterdir()) == []


def test_a_checkpoint_that_cannot_be_read_is_an_export_error(tmp_path, monkeypatch):
    trained_checkpoint(tmp_path / "checkpoints", "sync")

    def unpickling_fails(directory):
        raise RuntimeError("PytorchStreamReader failed reading zip archive")

    monkeypatch.setattr(export_module, "read_checkpoint", unpickling_fails)
    with pytest.raises(ExportError, match=r"step-000004 cannot be read \(RuntimeError: PytorchStreamReader.*"
                                          "export a checkpoint written by traincore.train"):
        export(tmp_path / "checkpoints", tmp_path / "m.safetensors")


@pytest.fixture
def exported(tmp_path) -> Path:
    trained_checkpoint(tmp_path / "checkpoints", "sync")
    return Path(export(tmp_path / "checkpoints", tmp_path / "model" / "m.safetensors").path)


def test_load_exported_names_a_damaged_or_foreign_file(exported):
    config_path = exported.with_suffix(".json")
    config = json.loads(config_path.read_text())
    weights = exported.read_bytes()
    with pytest.raises(ExportError, match=f"model {exported.parent} is a directory: pass the exported file"):
        load_exported(exported.parent)
    with pytest.raises(ExportError, match=f"model {config_path} is the JSON config of an export: pass"):
        load_exported(config_path)

    config_path.write_text(json.dumps(config)[:50])
    with pytest.raises(ExportError, match=f"model config {config_path} is not valid JSON .* export it again"):
        load_exported(exported)
    config_path.write_text(json.dumps({**config, "num_classes": "3"}))
    with pytest.raises(ExportError, match=r"has num_classes='3', expected an integer: export it again"):
        load_exported(exported)
    config_path.write_text(json.dumps({**config, "model": {**config["model"], "width": "4"}}))
    with pytest.raises(ExportError, match=r"cannot be built \(model.width='4' is invalid"):
        load_exported(exported)

    import hashlib
    import io

    buffer = io.BytesIO()
    torch.save({"weight": torch.zeros(3)}, buffer)  # a pickle under a .safetensors name, its sha256 recorded
    exported.write_bytes(buffer.getvalue())
    config_path.write_text(json.dumps({**config, "sha256": hashlib.sha256(buffer.getvalue()).hexdigest()}))
    with pytest.raises(ExportError, match=f"{exported} is not a safetensors file"):
        load_exported(exported)
    exported.write_bytes(weights)
    config_path.write_text(json.dumps(config))
    load_exported(exported)  # restored: loads again


def test_cli_reports_unwritable_output_with_exit_2(exported, tmp_path, capsys):
    (tmp_path / "plain").write_text("a file")
    output = tmp_path / "plain" / "m.safetensors"
    assert main(["--checkpoint", str(tmp_path / "checkpoints"), "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {tmp_path}/plain/m.safetensors") and "Traceback" not in err


def test_exporting_again_to_the_same_output_replaces_that_export(exported, tmp_path):
    again = export(tmp_path / "checkpoints", exported)
    assert again.path == str(exported) and load_exported(exported)[1]["sha256"] == again.sha256


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def colliding_output(case: str, target: Path, exported: Path) -> Path:
    """An output in ``target`` whose weights, config or lineage path holds something else already."""
    if case == "existing file":
        (target / "notes.txt").write_text("mine")
        return target / "notes.txt"
    if case == "a staging's manifest":
        (target / "manifest.json").write_text("{}")
        return target / "manifest.safetensors"
    if case == "another model's directory":
        shutil.copytree(exported.parent, target, dirs_exist_ok=True)
        return target / "other.safetensors"
    if case == "config is a directory":
        (target / "m.json").mkdir()
    elif case == "config is a link to the lineage":
        (target / "m.json").symlink_to(target / "lineage.json")
    return target / ("lineage.safetensors" if case == "named lineage" else "m.safetensors")


@pytest.mark.parametrize("case, match", [
    ("existing file", r"notes.txt already exists and is not part of an earlier export to .*notes.txt"),
    ("a staging's manifest", r"JSON config file .*manifest.json already exists"),
    ("named lineage", r"its JSON config file and its lineage file would both be .*lineage.json"),
    ("another model's directory", r"lineage.json already exists and is not the lineage of an earlier export"),
    ("config is a directory", r"JSON config file .*m.json already exists"),
    ("config is a link to the lineage", r"JSON config file and its lineage file would both be"),
])
def test_an_export_replaces_no_file_but_its_own_earlier_version(exported, tmp_path, case, match):
    """Each output collides with a file the export also writes; it is refused before anything is written."""
    target = tmp_path / "target"
    target.mkdir()
    output = colliding_output(case, target, exported)
    before = files_of(target) if all(p.is_file() for p in target.iterdir()) else None
    with pytest.raises(ExportError, match=match):
        export(tmp_path / "checkpoints", output)
    if before is not None:
        assert files_of(target) == before
    assert not list(target.glob(".*"))  # no temporary file either
