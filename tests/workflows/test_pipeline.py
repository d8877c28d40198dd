"""The whole workflow, locally: two elastic gloo processes, a real report, the staging cache, bad inputs."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tasks.stage
from traincore.artifacts.evaluate import evaluate
from workflows.pipeline import training_pipeline

REPO = Path(__file__).resolve().parents[2]
# 10 learnable synthetic classes at 16x16; 60 steps of the debug model on 2 processes take a few seconds.
SMALL = dict(source="synthetic", preset="debug", config_overrides='{"data": {"synthetic_samples": 600}}',
             max_steps=60, nproc_per_node=2)


def forbid_staging(monkeypatch):
    def staging_started(*args, **kwargs):
        raise AssertionError("the dataset was staged")

    monkeypatch.setattr(tasks.stage, "stage", staging_started)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    checkpoints = tmp_path_factory.mktemp("run") / "checkpoints"
    model, report, dataset = training_pipeline(**SMALL, checkpoint_uri=str(checkpoints))
    return model, report, dataset, checkpoints


def test_pipeline_trains_exports_and_reports_a_real_accuracy(first_run):
    model, report, dataset, checkpoints = first_run
    weights = Path(model.directory.path) / model.weights_file
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert digest == model.export.sha256 == report.lineage.model_sha256
    assert report.lineage.source_fingerprint == dataset.source_fingerprint != ""
    assert (report.lineage.world_size, report.lineage.checkpoint_step) == (2, 60)
    assert model.export.step == 60 and (checkpoints / "step-000060").is_dir()
    report = report.result
    assert report.count == sum(map(sum, report.confusion)) == 60  # 10% of 600 samples
    assert report.accuracy == pytest.approx(sum(report.confusion[k][k] for k in range(10)) / report.count)
    assert report.accuracy > 0.3  # chance is 0.1
    assert len(report.precision) == len(report.recall) == len(report.classes) == 10
    assert dataset.counts["test"] == report.count
    return_trip = evaluate(weights, dataset.directory.path, "test")
    assert return_trip.accuracy == report.accuracy and return_trip.confusion == report.confusion


def test_rerun_hits_the_staging_cache(first_run, monkeypatch, tmp_path):
    forbid_staging(monkeypatch)
    model, report, dataset = training_pipeline(**SMALL | dict(max_steps=10),
                                               checkpoint_uri=str(tmp_path / "again"))
    assert model.export.step == 10 and report.result.count == first_run[1].result.count
    assert dataset.directory.path == first_run[2].directory.path


def test_the_digits_pipeline_with_a_sharded_model_reaches_its_accuracy(tmp_path):
    """The default run (`pyflyte run workflows/pipeline.py training_pipeline --parallelism fsdp`): the
    digits preset on two processes holding half the model each, to the test accuracy it promises."""
    model, report, _ = training_pipeline(parallelism="fsdp", checkpoint_uri=str(tmp_path / "checkpoints"))
    assert report.lineage.config["dist"]["parallelism"] == "fsdp" and report.lineage.world_size == 2
    assert report.result.accuracy >= 0.95, report.result


@pytest.mark.parametrize("bad, named", [
    (dict(backend="mesos"), "input backend='mesos' is unknown"),
    (dict(backend="slurm"), "input backend='slurm' needs slurm_target"),
    (dict(nproc_per_node=0), "input nproc_per_node=0"),
    (dict(nnodes="2"), "input nnodes=2 needs backend='kubernetes'"),
    (dict(source="imagefolder:/no/such/images"), "input source='imagefolder:/no/such/images'"),
])
def test_bad_inputs_fail_before_anything_runs(bad, named, monkeypatch):
    forbid_staging(monkeypatch)
    with pytest.raises(Exception, match=named):
        training_pipeline(**SMALL | bad)


def pyflyte_run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`pyflyte run workflows/pipeline.py training_pipeline ARGS` as a user runs it; caches of its own."""
    pyflyte = Path(sys.executable).parent / "pyflyte"
    env = {**os.environ, "FLYTE_LOCAL_CACHE_ENABLED": "false", "XDG_CACHE_HOME": str(cwd / "cache")}
    return subprocess.run([str(pyflyte), "run", str(REPO / "workflows" / "pipeline.py"), "training_pipeline",
                           *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_pyflyte_run_shows_a_bad_input_or_a_bad_image_as_its_message_alone(image_folder_factory, tmp_path):
    """What a user sees first: a bad input (the plan's) or an unreadable image (met while staging, in a
    decode process) ends `pyflyte run` with our message and no traceback, neither flytekit's nor the
    decode process's."""
    images = image_folder_factory("images", per_class=6)
    first = sorted(images.iterdir())[0]
    (first / "page.jpg").write_text("<html>not an image</html>")
    for args, message in ((("--nproc_per_node", "0"), "input nproc_per_node=0 is invalid: it must be >= 1"),
                          (("--source", f"imagefolder:{images}", "--max_steps", "2"),
                           f"cannot read image file://{first}/page.jpg: it is not an image")):
        run = pyflyte_run(*args, cwd=tmp_path)
        text = run.stdout + run.stderr
        assert run.returncode == 1 and "Traceback" not in text and "│ ❱" not in text, text[-3000:]
        # rich-click's "Error" panel folds the message, paths too: compare without whitespace
        panel = "".join(line.strip("│ ") for line in text.splitlines() if line.startswith("│"))
        assert "".join(message.split()) in "".join(panel.split()), text[-3000:]


@pytest.fixture
def examples_on_path(monkeypatch):
    """examples/ importable here and in the workers, as a team's installed package is; its modules are
    dropped again afterwards."""
    examples = Path(__file__).resolve().parents[2] / "examples"
    monkeypatch.syspath_prepend(str(examples))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(examples),
                                                                    os.environ.get("PYTHONPATH")])))
    yield
    for name in [name for name in sys.modules if name.split(".")[0] == "teamnet"]:
        del sys.modules[name]


def test_the_workflow_trains_a_teams_model_on_its_dataset(examples_on_path, tmp_path):
    """`pyflyte run workflows/pipeline.py training_pipeline --source python:teamnet.data:digits
    --config_overrides '{"model": {"name": "teamnet.models:resnet_tiny", ...}}'` with examples/ on the
    path: staged from the team's dataset factory, its model trained on two processes, exported and
    evaluated to a test accuracy well above chance."""
    overrides = ('{"model": {"name": "teamnet.models:resnet_tiny", "kwargs": {"width": 16}}, '
                 '"data": {"image_size": 16, "channels": 1}, "optim": {"lr": 0.01}}')
    model, report, dataset = training_pipeline(source="python:teamnet.data:digits", preset="debug",
                                               config_overrides=overrides, max_steps=120, nproc_per_node=2,
                                               checkpoint_uri=str(tmp_path / "checkpoints"))
    assert dataset.source_fingerprint.startswith("python:sha256:") and dataset.counts["test"] == 183
    assert report.lineage.config["model"]["name"] == "teamnet.models:resnet_tiny"
    assert report.result.accuracy >= 0.5, report.result  # ten classes: chance is 0.1
