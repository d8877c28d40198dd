"""traincore.evaluate: the metric maths against scikit-learn, and a real exported model end to end."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import confusion_matrix as sk_confusion
from sklearn.metrics import precision_score, recall_score

from traincore.artifacts.evaluate import confusion_matrix, evaluate, main, precision_recall, resolve_device
from traincore.artifacts.export import export, load_exported
from traincore.artifacts.export import main as export_main
from traincore.config.presets import preset
from traincore.data.loader import StagedSplit
from traincore.data.manifest import StagingError
from traincore.run.trainer import Trainer


def test_metric_maths_matches_scikit_learn():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 5, size=300)
    labels[labels == 4] = 0  # class 4 never occurs: recall undefined -> 0
    # Class 4 is never predicted either: precision undefined -> 0.
    predictions = np.where(rng.random(300) < 0.7, labels, rng.integers(0, 4, size=300))
    confusion = confusion_matrix(torch.from_numpy(labels), torch.from_numpy(predictions), num_classes=5)
    assert confusion.tolist() == sk_confusion(labels, predictions, labels=range(5)).tolist()
    precision, recall = precision_recall(confusion)
    kwargs = dict(labels=range(5), average=None, zero_division=0)
    np.testing.assert_allclose(precision, precision_score(labels, predictions, **kwargs))
    np.testing.assert_allclose(recall, recall_score(labels, predictions, **kwargs))


@pytest.fixture(scope="module")
def exported(synthetic_dir, tmp_path_factory):
    """A small CNN trained for a few steps on the synthetic data, exported to safetensors."""
    run = tmp_path_factory.mktemp("evaluate-run")
    cfg = preset("debug").with_overrides({"train.max_steps": 15, "loader.batch_size": 16})
    Trainer(cfg, synthetic_dir, run / "train").train()
    return export(run / "train" / "checkpoints", run / "model" / "model.safetensors").path


def reference_metrics(model_path, data_dir) -> tuple[list[list[int]], float]:
    """Confusion and mean loss computed in one batch, normalising by hand from the model's config."""
    model, meta = load_exported(model_path)
    split = StagedSplit(data_dir, "test")
    images, labels = split.read(np.arange(len(split)))
    mean = torch.tensor(meta["mean"]).view(1, -1, 1, 1)
    std = torch.tensor(meta["std"]).view(1, -1, 1, 1)
    with torch.no_grad():
        logits = model((images.float() / 255 - mean) / std)
    confusion = sk_confusion(labels.numpy(), logits.argmax(1).numpy(), labels=range(len(meta["classes"])))
    return confusion.tolist(), F.cross_entropy(logits, labels).item()


def test_evaluate_measures_the_exported_model(exported, synthetic_dir):
    result = evaluate(exported, synthetic_dir, "test", batch_size=3)  # batches that do not divide the split
    confusion, loss = reference_metrics(exported, synthetic_dir)
    assert result.confusion == confusion and result.count == 10
    assert result.accuracy == pytest.approx(np.trace(confusion) / 10)
    assert result.loss == pytest.approx(loss, rel=1e-5)
    assert result.classes == [f"class_{k}" for k in range(4)] and len(result.precision) == 4
    assert evaluate(exported, synthetic_dir, "test", batch_size=256).confusion == result.confusion


def test_evaluate_refuses_data_the_model_was_not_trained_for(exported, digits_dir):
    with pytest.raises(StagingError, match=r"expects 4 classes of shape \(3, 8, 8\).*10 classes"):
        evaluate(exported, digits_dir)
    with pytest.raises(ValueError, match="batch_size=0"):
        evaluate(exported, digits_dir, batch_size=0)


def test_cli_prints_the_accuracy_line(exported, synthetic_dir, capsys):
    assert main(["--model", str(exported), "--data", str(synthetic_dir)]) == 0
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(r"test accuracy: \d\.\d{3} \(10 samples, loss \d+\.\d{4}\)", line)
    assert main(["--model", str(exported), "--data", str(synthetic_dir), "--split", "nope"]) == 2
    assert "split 'nope'" in capsys.readouterr().err


def test_ctrl_c_is_one_line_and_exit_130(exported, synthetic_dir, capsys, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(sys.modules["traincore.artifacts.evaluate"], "evaluate", interrupted)  # the package's
    # `evaluate` is the function
    assert main(["--model", str(exported), "--data", str(synthetic_dir)]) == 130
    assert capsys.readouterr().err == "interrupted: no score (the evaluation writes nothing)\n"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_evaluate_on_cuda_matches_cpu(exported, synthetic_dir):
    on_gpu = evaluate(exported, synthetic_dir, "test", device="cuda")
    on_cpu = evaluate(exported, synthetic_dir, "test", device="cpu")
    assert on_gpu.confusion == on_cpu.confusion
    assert on_gpu.loss == pytest.approx(on_cpu.loss, rel=1e-3)


@pytest.mark.parametrize("device, message", [
    ("gpu:first", "device 'gpu:first' (--device) is not a device name: use cpu"),
    ("cuda:-1", "device 'cuda:-1' (--device) is not a device name"),
    ("meta", "device 'meta' (--device) is not available on this machine: use cpu"),
    ("cuda:99", "device 'cuda:99' (--device) is not available on this machine: use cpu"),
])
def test_a_device_this_machine_lacks_is_named(device, message):
    with pytest.raises(ValueError) as info:
        resolve_device(device)
    assert str(info.value).startswith(message)


def test_default_and_cpu_devices_resolve():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_cli_names_bad_inputs_without_a_traceback(exported, synthetic_dir, tmp_path, capsys):
    import json
    import shutil

    model = tmp_path / "m.safetensors"
    shutil.copy(exported, model)
    config = json.loads(Path(exported).with_suffix(".json").read_text())
    model.with_suffix(".json").write_text(json.dumps({**config, "classes": None}))
    assert main(["--model", str(model), "--data", str(synthetic_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: model config {model.with_suffix('.json')} has classes=None") and (
        "export the model again" in err)
    model.with_suffix(".json").write_text('{"sha256": "')  # truncated
    assert main(["--model", str(model), "--data", str(synthetic_dir)]) == 2
    err = capsys.readouterr().err
    assert "is not valid JSON" in err and "export it again" in err and "Traceback" not in err
    assert main(["--model", str(exported), "--data", str(synthetic_dir), "--device", "tpu"]) == 2
    assert "error: device 'tpu' (--device)" in capsys.readouterr().err


@pytest.mark.parametrize("given", ["run output", "checkpoints root", "step directory", "file in a step"])
def test_a_checkpoint_given_as_the_model_gets_an_export_command_that_works(given, exported, synthetic_dir,
                                                                           capsys):
    """The command the error suggests exports (run as printed; as a real process for a step directory, the
    case a user hits first), and evaluating its output works."""
    train = Path(exported).parent.parent / "train"
    step = next((train / "checkpoints").glob("step-*"))
    model = {"run output": train, "checkpoints root": train / "checkpoints", "step directory": step,
             "file in a step": step / "model.safetensors"}[given]
    assert main(["--model", str(model), "--data", str(synthetic_dir)]) == 2
    error = capsys.readouterr().err
    assert "not an exported model" in error or "cannot be made there" in error, error
    command = shlex.split(re.search(r"`(python -m traincore\.export [^`]+)`", error).group(1))
    assert command[:3] == ["python", "-m", "traincore.export"]
    output = Path(command[command.index("--output") + 1])
    assert step not in output.parents and train / "checkpoints" not in output.parents
    if given == "step directory":
        done = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.startswith(f"exported {output}"), done.stderr
    else:
        assert export_main(command[3:]) == 0
        assert capsys.readouterr().out.startswith(f"exported {output}")
    assert main(["--model", str(output), "--data", str(synthetic_dir)]) == 0
    assert capsys.readouterr().out.startswith("test accuracy: ")
