"""Export of sync and DCP checkpoints to safetensors, loading it back, and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import traincore.export
from traincore.checkpoint import Checkpointer
from traincore.checkpoint_files import CheckpointError, sha256_file, step_dir, verify_checkpoint
from traincore.config import CheckpointConfig, Config, ModelConfig
from traincore.export import ExportError, export, load_exported, main
from traincore.models import build_model, parameter_count
from traincore.state import ModelState, OptimizerState, RunMeta, StateRegistry

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

REPO = Path(__file__).resolve().parents[2]
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


def test_export_from_a_step_directory(tmp_path):
    trained_checkpoint(tmp_path, "sync", steps=2)
    assert export(step_dir(tmp_path, 2), tmp_path / "m.safetensors").step == 2


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
    ("checkpoints/step-000004/model.safetensors", "inside the checkpoint .* being exported"),
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

    monkeypatch.setattr(traincore.export, "build_model", broken)
    with pytest.raises(ExportError, match=match):
        export(tmp_path / "checkpoints", tmp_path / "out" / "model.safetensors")
    assert list((tmp_path / "out").iterdir()) == []  # neither the model, nor its config, nor a .tmp


def test_a_failed_write_leaves_no_tmp_file(tmp_path, monkeypatch):
    trained_checkpoint(tmp_path / "checkpoints", "sync")

    def disk_full(tensors, path):
        Path(path).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(traincore.export, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export(tmp_path / "checkpoints", tmp_path / "out" / "model.safetensors")
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
