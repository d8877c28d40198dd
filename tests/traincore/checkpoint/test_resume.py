"""Which step a resume loads and whether it fits: preflight and the checkpointer give one answer."""

from __future__ import annotations

import logging

import pytest

from traincore.checkpoint import (
    MARKER,
    Checkpointer,
    CheckpointError,
    RunFit,
    as_store,
    check_fit,
    choose_step,
    complete_steps,
    open_saved,
    read_marker,
    step_dir,
    step_store,
)
from traincore.checkpoint.format import SavedState
from traincore.config.presets import debug
from traincore.config.schema import CheckpointConfig, LoaderConfig, optimizer_identity
from traincore.data.loader import StagedLoader, StagedSplit
from traincore.data.manifest import Manifest
from traincore.run.preflight import check_resume
from traincore.run.state import RunMeta, StateRegistry
from traincore.run.trainer import Trainer


def test_a_checkpoint_of_other_data_is_refused_by_name(tmp_path):
    registry = StateRegistry()
    registry.register("run", RunMeta({"shape": [3, 32, 32], "classes": ["a", "b"]}))
    Checkpointer(tmp_path, CheckpointConfig(), registry).save(1)
    other = StateRegistry()
    other.register("run", RunMeta({"shape": [3, 16, 16], "classes": ["a", "b"]}))
    with pytest.raises(CheckpointError, match=r"step-000001 does not fit this run: it was trained on data of "
                       r"2 classes \(a, b\) and shape \(3, 32, 32\), but this run's data holds 2 classes "
                       r"\(a, b\) of shape \(3, 16, 16\)"):
        Checkpointer(tmp_path, CheckpointConfig(), other).load()


def test_a_record_left_out_fits_anything(tmp_path):
    """A checkpoint without a run record (older versions) and a run without one are not refused."""
    registry = StateRegistry()
    registry.register("run", RunMeta({}))
    Checkpointer(tmp_path, CheckpointConfig(), registry).save(1)
    directory = step_store(tmp_path, 1)
    saved = open_saved(directory, read_marker(directory))
    check_fit(directory, saved, RunFit({"name": "mlp", "width": 8}, ["a"], [1, 2, 2], 10))
    with pytest.raises(CheckpointError, match="saved by a run over 10 training samples, but data/ has 12"):
        check_fit(directory, SavedState(1, {"loader": {"num_samples": 10}}, [], {}),
                  RunFit(None, None, None, 12), data="data/")
    # Another optimizer, or other frozen parameters: another set of state tensors.
    adamw = {"run": {"config": {"optim": {"name": "adamw", "param_groups": []}}}}
    check_fit(directory, SavedState(1, adamw, [], {}), RunFit(None, None, None, None))  # unrecorded: fits
    for optim in ({"name": "sgd", "param_groups": []},
                  {"name": "adamw", "param_groups": [{"pattern": "stem.*", "freeze": True}]}):
        with pytest.raises(CheckpointError, match=r"its optimizer state was written by optimizer \{'name': "
                                                  r"'adamw', 'frozen': \[\]\}, this run's is .*resume with "
                                                  r"that run's"):
            check_fit(directory, SavedState(1, adamw, [], {}),
                      RunFit(None, None, None, None, optimizer_identity(optim)))


def test_a_loader_position_in_a_split_of_another_size_is_refused(synthetic_dir, tmp_path):
    """The loader's place in the epoch carries over only between splits of one size: a checkpoint of the
    80-sample train split does not load into a run over the 10-sample val split."""
    def registry(split: str) -> StateRegistry:
        registry = StateRegistry()
        loader = StagedLoader(StagedSplit(synthetic_dir, split), LoaderConfig(batch_size=2, num_workers=0))
        registry.register("loader", loader)
        return registry

    Checkpointer(tmp_path, CheckpointConfig(), registry("train")).save(1)
    with pytest.raises(CheckpointError, match="saved by a run over 80 training samples, but this run's data "
                                              "has 10"):
        Checkpointer(tmp_path, CheckpointConfig(), registry("val")).load()


def test_a_resume_names_the_settings_it_changes(synthetic_dir, tmp_path, caplog):
    """Another learning rate or batch size is the user's choice on resume, but never a silent one; a longer
    run (the usual reason to resume) is not named."""
    base = debug().with_overrides({"telemetry.tensorboard": False, "model.name": "mlp", "model.width": 8,
                                   "loader.batch_size": 16, "checkpoint.every": 2})
    Trainer(base.with_overrides({"train.max_steps": 2}), synthetic_dir, tmp_path / "run").train()
    changed = base.with_overrides({"train.max_steps": 4, "optim.lr": base.optim.lr * 2,
                                   "loader.batch_size": 8})
    caplog.set_level(logging.INFO, logger="traincore.checkpoint.checkpointer")
    Trainer(changed, synthetic_dir, tmp_path / "run").train()
    lines = [record.getMessage() for record in caplog.records]
    line = next(line for line in lines if "settings other than the checkpoint's" in line)
    assert line.endswith(f"optim.lr {base.optim.lr!r} -> {base.optim.lr * 2!r}, loader.batch_size 16 -> 8")
    assert "max_steps" not in line


def _damage(directory) -> None:
    """Flip a byte in the middle of every file the marker lists but the marker itself."""
    for name in read_marker(directory)["files"]:
        path = directory / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


def test_preflight_vets_the_step_a_load_falls_back_to(synthetic_dir, tmp_path, caplog):
    """Step 4 (width 16) is corrupt, so a resume falls back to step 2, which a width-8 run wrote. A width-16
    run is refused by preflight, before any worker starts, exactly as its load would refuse it: both pick
    step 2 through the same verification and fallback, and name the step they skipped."""
    base = debug().with_overrides({"telemetry.tensorboard": False, "model.name": "mlp",
                                   "loader.batch_size": 16})
    root = tmp_path / "checkpoints"
    Trainer(base.with_overrides({"model.width": 8, "train.max_steps": 2, "checkpoint.every": 2}),
            synthetic_dir, tmp_path / "narrow", root).train()
    wide = base.with_overrides({"model.width": 16, "train.max_steps": 4, "checkpoint.every": 4})
    Trainer(wide.with_overrides({"checkpoint.resume": "none"}), synthetic_dir, tmp_path / "wide",
            root).train()
    assert complete_steps(root) == [2, 4]
    _damage(step_dir(root, 4))

    caplog.set_level(logging.WARNING)
    assert choose_step(as_store(root), None, verify=True) == 2
    assert "falling back to the previous complete checkpoint" in caplog.text
    assert str(step_dir(root, 4)) in caplog.text
    with pytest.raises(CheckpointError) as preflight:
        check_resume(wide, Manifest.load(synthetic_dir), as_store(root), synthetic_dir)
    with pytest.raises(CheckpointError) as load:
        Trainer(wide, synthetic_dir, tmp_path / "again", root, manifest=Manifest.load(synthetic_dir))
    for error in (preflight.value, load.value):
        message = str(error)
        assert f"checkpoint {step_dir(root, 2)} does not fit this run" in message
        assert "'width': 8" in message and "'width': 16" in message
    assert choose_step(as_store(root), None, verify=False) == 4  # without verification: the newest


def test_every_corrupt_step_is_refused_before_any_worker(synthetic_dir, tmp_path):
    cfg = debug().with_overrides({"telemetry.tensorboard": False, "train.max_steps": 2, "checkpoint.every": 1,
                                  "loader.batch_size": 16})
    root = tmp_path / "checkpoints"
    Trainer(cfg, synthetic_dir, tmp_path / "run", root).train()
    for step in complete_steps(root):
        _damage(step_dir(root, step))
    with pytest.raises(CheckpointError, match=r"every complete checkpoint .* corrupt \(steps \[1, 2\]"):
        check_resume(cfg, Manifest.load(synthetic_dir), as_store(root), synthetic_dir)


def test_a_torn_save_with_nothing_committed_says_the_run_starts_fresh(tmp_path, caplog):
    registry = StateRegistry()
    registry.register("run", RunMeta({}))
    Checkpointer(tmp_path, CheckpointConfig(), registry).save(3)
    (step_dir(tmp_path, 3) / MARKER).unlink()  # stopped before its commit
    caplog.set_level(logging.WARNING)
    assert choose_step(as_store(tmp_path), None, verify=True) is None
    assert "no step is committed, so the run starts from the beginning" in caplog.text
    assert "resuming from the latest committed step" not in caplog.text
