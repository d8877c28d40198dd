"""The training core end to end through its CLI, with real gloo ranks (the CLI's forked workers)."""

from __future__ import annotations

import gc
import hashlib
import json
import shutil

import pytest
import torch
from ranks import start_script, wait_exit, warm
from trainruns import TINY, final_weights, killed_and_resumed, run_train, train_losses

from traincore.checkpoint import complete_steps, open_saved, read_marker, step_dir
from traincore.config.schema import ModelConfig
from traincore.run.cli import main
from traincore.run.preflight import check_model_input
from traincore.run.trainer import gc_paused


@pytest.fixture(scope="module", autouse=True)
def child_server() -> None:
    """The children's server (tests/ranks.py) imports while the first test's run trains, not when the first
    child starts."""
    warm()


def test_two_process_training_learns_and_matches_golden_losses(data_dir, tmp_path):
    done = run_train(data_dir, tmp_path / "run", 2, "--max-steps", "20")
    losses = train_losses(tmp_path / "run")
    assert len(losses) == 10 and losses[-1] < 0.5 * losses[0], losses
    # Recorded from this configuration (2 gloo ranks, seed 0); guards the loop's numerics against drift.
    golden = torch.tensor([1.4081, 1.2062, 0.9831, 0.9097, 0.8773])
    torch.testing.assert_close(torch.tensor(losses[:5]), golden, atol=2e-3, rtol=0)
    assert "trained 20 steps" in done.stdout
    # Rank 0 alone reports where start-up went: one log line, one record.
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    startup = [row for row in rows if row["kind"] == "startup"]
    assert len(startup) == 1 and startup[0]["step"] == 1, startup
    assert startup[0]["imports_s"] > 0 and startup[0]["process_group_s"] >= 0
    assert done.stderr.count("to first step: imports") == 1, done.stderr[-3000:]


def test_gc_paused_freezes_what_exists_and_restores_the_collector():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with gc_paused():
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0  # existing objects are out of the loop's collections
        garbage = [[]]
        garbage[0].append(garbage)  # a cycle made inside the loop is still collected there
        del garbage
        assert gc.collect() >= 1
    assert gc.isenabled() and gc.get_freeze_count() == 0


# What people tune, each resumed exactly: a one-cycle schedule, an average of the weights (exported in place
# of the live ones), the normalisation of pretrained weights, a head at 5x the rate and a frozen stem. And W&B
# with its entity, run name and tags: its run starts inside the loop (at the first record, or where a resume
# starts), so its start must leave the training bitwise as it was; each attempt logs to an offline run of its
# own (that the name, tags and entity reach W&B, test_sinks.py checks). The other schedules resume as every
# LambdaLR schedule does, by its step count (test_schedule.py).
KNOBS = {**TINY, "optim": {**TINY["optim"], "schedule": "onecycle", "ema_decay": 0.9,
                           "param_groups": [{"pattern": "head.*", "lr_mult": 5},
                                            {"pattern": "features.0.*", "freeze": True}]},
         "data": {"mean": [0.4, 0.45, 0.5], "std": [0.25, 0.2, 0.3]},
         "telemetry": {**TINY["telemetry"], "wandb_mode": "offline", "wandb_entity": "vision-team",
                       "wandb_run_name": "lr-sweep-7", "wandb_tags": ["digits", "resumed"]}}


@pytest.mark.parametrize("config", [TINY, KNOBS], ids=["defaults", "tuned knobs, W&B offline"])
def test_killed_run_resumes_to_bitwise_identical_weights(data_dir, forked_train, tmp_path, monkeypatch,
                                                         config):
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # W&B's files stay in tmp_path
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    ref = tmp_path / "reference"
    forked_train(data_dir, ref, 2, "--max-steps", "40", "--checkpoint-every", "5", config=config)
    killed = tmp_path / "killed"
    killed_and_resumed(data_dir, killed, 40, "--checkpoint-every", "5", config=config)
    expected, actual = final_weights(ref), final_weights(killed)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    if config is KNOBS:  # what was exported and compared is the average, which the checkpoints hold
        last = step_dir(killed / "checkpoints", 40)
        state = open_saved(last, read_marker(last)).shared
        assert all(torch.equal(actual[name], state["ema"][name]) for name in actual)
        assert not all(torch.equal(state["model"][name], state["ema"][name]) for name in actual)
        assert state["run"]["mean"] == KNOBS["data"]["mean"]  # and the normalisation the run used
    if config is KNOBS:  # W&B was on: one offline run per attempt
        assert len(list((ref / "wandb").glob("offline-run-*"))) == 1
        assert len(list((killed / "wandb").glob("offline-run-*"))) == 2


@pytest.mark.parametrize("resume_nproc", [1, 3])
def test_resume_on_a_different_world_size(data_dir, saved, forked_train, tmp_path, resume_nproc):
    out = tmp_path / "run"
    shutil.copytree(saved("ddp-dcp-2").parent, out)  # 10 steps on 2 ranks, dcp checkpoints every 5
    printed = forked_train(data_dir, out, resume_nproc, "--max-steps", "20", "--checkpoint-every", "5",
                           "--checkpoint-mode", "dcp")
    assert "resumed from step 10" in printed
    assert complete_steps(out / "checkpoints")[-1] == 20
    losses = train_losses(out)
    assert all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("flags, message", [
    (["--config", '{"loader": {"batch_size": 0}}'], "loader.batch_size=0"),
    (["--config", '{"optim": {"lr": -1}}'], "optim.lr=-1"),
    (["--config", '{"loader": {"batch_size": 100000}}'], "lower loader.batch_size"),
    (["--config", '{"nope": {}}'], "unknown config section 'nope'"),
    (["--checkpoint-mode", "dcp", "--config", "{not json"], "not valid JSON"),
    # staging's settings, once ignored in silence: the staged data (12 px, 480 samples) is read as it is
    (["--config", '{"data": {"image_size": 64}}'], "--config sets data.image_size=64 (12 staged), but "),
    (["--config", '{"data.synthetic_samples": 100, "data.seed": 3}'],
     "--config sets data.seed=3 (0 staged), data.synthetic_samples=100 (480 staged), but training reads"),
    (["--config", '{"data.samples_per_shard": 64}'], "--config sets data.samples_per_shard=64 (100 staged)"),
])
def test_bad_config_is_rejected_before_any_process_group(data_dir, tmp_path, flags, message, monkeypatch,
                                                         capsys, listening_port):
    """The CLI's main() in this process, as a torchrun worker of rank 0 would run it: a process-group start
    would fail at once on the busy MASTER_PORT (a RuntimeError, not this exit code and message); the
    error must come first."""
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(listening_port)}.items():
        monkeypatch.setenv(name, value)
    code = main(["--data", str(data_dir), "--output", str(tmp_path / "o"), "--preset", "debug", *flags])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["small_cnn", "resnet18"])
def test_a_batch_of_one_is_refused_where_batch_norm_sees_one_value_per_channel(name):
    # small_cnn pools 4x4 samples down to 1x1, resnet18 16x16 ones: BatchNorm then normalises over the batch
    # alone. Our own models check on CPU zeros, torchvision's on the meta device; both must refuse.
    model, size = ModelConfig(name=name, width=8), 4 if name == "small_cnn" else 16
    check_model_input(model, 3, (1, size, size), "the data", batch_size=2)
    with pytest.raises(ValueError, match=rf"model.name='{name}' cannot take the data: samples of shape "
                       rf"\(1, {size}, {size}\) in batches of 1 \(Expected more than 1 value per channel"):
        check_model_input(model, 3, (1, size, size), "the data", batch_size=1)


def test_images_too_small_for_the_model_are_refused():
    with pytest.raises(ValueError, match=r"model.name='small_cnn' cannot take 2x2 data: .*Output size is too "
                       "small.*stage the data with a larger data.image_size"):
        check_model_input(ModelConfig(name="small_cnn", width=8), 3, (1, 2, 2), "2x2 data")
    # Trains on a batch of 1 without BatchNorm, whatever the image size.
    check_model_input(ModelConfig(name="mlp", width=8), 3, (1, 2, 2), "2x2 data", batch_size=1)


def test_missing_data_directory_is_a_clear_error(tmp_path, capsys):
    code = main(["--data", str(tmp_path / "absent"), "--output", str(tmp_path)])  # the CLI, in this process
    assert code == 2 and "is not a staged dataset" in capsys.readouterr().err


def test_a_trainer_is_complete_once_built_and_restores_process_settings(data_dir, tmp_path):
    """Built = ready (parts up, checkpoint loaded); closing restores deterministic mode and the root
    logger, so a process that trains in-process keeps its own settings."""
    import logging

    from traincore.config.schema import Config
    from traincore.run.trainer import Trainer

    cfg = Config().with_overrides({**TINY, "data": {"source": "synthetic"}, "train": {"max_steps": 4,
                                   "deterministic": True}, "checkpoint": {"every": 2}})
    root = logging.getLogger()
    def process_settings():
        return torch.are_deterministic_algorithms_enabled(), list(root.handlers), root.level

    before = process_settings()
    assert not before[0]
    first = Trainer(cfg, data_dir, tmp_path / "run")
    assert torch.are_deterministic_algorithms_enabled()  # for the run only
    assert first.resumed_from is None and first.progress.step == 0
    assert {"model", "optimizer", "telemetry"} <= set(first.registry.shared)
    assert first.train().steps == 4
    assert process_settings() == before
    with pytest.raises(RuntimeError, match="build a new Trainer"):
        first.train()
    with Trainer(cfg.with_overrides({"train.max_steps": 6}), data_dir, tmp_path / "run") as second:
        assert second.resumed_from == 4 and second.progress.step == 4  # loaded at construction
    assert process_settings() == before


# `python warm.py DATA OUT WEIGHTS REPORT`, run as a child forked from tests/ranks.py's server: on two ranks
# (torch elastic's workers, forked from that child as the train CLI forks its own), a Trainer warm-starts from
# WEIGHTS (init_exclude head.*) under FSDP; rank 0 gathers the whole model it built and writes which tensors
# equal the file's to REPORT.
WARM_SHARDED = r'''
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from traincore.config.presets import build_config
from traincore.run.launch import launch_local
from traincore.run.state import ModelState
from traincore.run.trainer import Trainer


def warm_start(data, out, weights, report):
    config = {"model": {"name": "small_cnn", "width": 8, "init_from": weights, "init_exclude": ["head.*"]}}
    cfg = build_config("debug", config, {"dist.parallelism": "fsdp", "telemetry.tensorboard": False})
    with Trainer(cfg, data, out) as trainer:
        sharded = any(isinstance(p, DTensor) for p in trainer.model.parameters())
        loaded = ModelState(trainer.model).full_state_dict()
        if trainer.ctx.is_main:
            saved = load_file(weights)
            same = sorted(name for name in loaded if torch.equal(loaded[name], saved[name]))
            found = {"same": same, "sharded": sharded, "init": trainer.run_meta["init"]}
            Path(report).write_text(json.dumps(found))


if __name__ == "__main__":
    launch_local(warm_start, tuple(sys.argv[1:5]), 2)
'''


def _start_weights(tmp_path, seed: int = 7):
    from safetensors.torch import save_file

    from traincore.model.build import build_model

    state = build_model(ModelConfig(name="small_cnn", width=8), 4, (3, 12, 12), seed=seed).state_dict()
    save_file(state, tmp_path / "start.safetensors")
    return tmp_path / "start.safetensors", state


def test_a_sharded_run_warm_starts_every_rank_from_the_file(data_dir, tmp_path):
    """The warm start loads into the model as the run holds it (here sharded by FSDP on two ranks): the
    whole model gathered afterwards is the file's, but for the excluded head."""
    weights, state = _start_weights(tmp_path)
    script, log = tmp_path / "warm.py", tmp_path / "warm.log"
    script.write_text(WARM_SHARDED)
    args = [data_dir, tmp_path / "run", weights, tmp_path / "report.json"]
    assert wait_exit(start_script(script, args, log), timeout=300) == 0, log.read_text()[-6000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["sharded"]
    assert report["same"] == sorted(name for name in state if not name.startswith("head."))
    assert report["init"]["from"] == str(weights) and len(report["init"]["sha256"]) == 64


def test_a_warm_start_takes_the_checkpointers_decision_and_lists_nothing_itself(data_dir, tmp_path,
                                                                                 monkeypatch):
    """Whether the run resumes is the checkpointer's choice, made once: the warm start lists nothing of its
    own in the checkpoint root (in an object store, each listing is a round trip on every rank), and a
    resumed run never reads the file."""
    from traincore.checkpoint import Store
    from traincore.config.schema import Config
    from traincore.run.trainer import Trainer

    weights, state = _start_weights(tmp_path)
    cfg = Config().with_overrides({**TINY, "train": {"max_steps": 2}, "telemetry": {"tensorboard": False}})
    warm = cfg.with_overrides({"model.init_from": str(weights)})
    listings: list[str] = []
    entries = Store.entries
    monkeypatch.setattr(Store, "entries", lambda store: listings.append(store.uri) or entries(store))

    counts = []
    for config, run in ((cfg, "cold"), (warm, "warm")):
        listings.clear()
        with Trainer(config, data_dir, tmp_path / run) as trainer:
            counts.append(listings.count(str(tmp_path / run / "checkpoints")))
    assert counts[0] == counts[1], counts
    assert torch.equal(trainer.model.head[2].weight, state["head.2.weight"])

    Trainer(warm, data_dir, tmp_path / "warm").train()
    weights.unlink()  # a resumed run has no use for it
    with Trainer(warm.with_overrides({"train.max_steps": 4}), data_dir, tmp_path / "warm") as resumed:
        assert resumed.resumed_from == 2 and resumed.run_meta["init"]["from"] == str(weights)


def test_a_warm_start_reads_an_object_store_file_with_the_checkpoint_roots_credentials(s3_server, data_dir,
                                                                                       tmp_path, monkeypatch):
    """A task hands the Trainer its checkpoint root with the store's credentials and endpoint (Flyte's
    settings, a mounted secret), not the environment: an init_from in the same store is read with them."""
    import uuid

    from traincore.checkpoint import Store
    from traincore.config.schema import Config
    from traincore.run.trainer import Trainer

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    weights, state = _start_weights(tmp_path)
    prefix = f"warm-{uuid.uuid4().hex[:8]}"
    s3_server.client().put_object(Bucket=s3_server.bucket, Key=f"{prefix}/start.safetensors",
                                  Body=weights.read_bytes())
    uri = f"s3://{s3_server.bucket}/{prefix}/start.safetensors"
    root = Store(f"s3://{s3_server.bucket}/{prefix}/checkpoints", s3_server.storage_options)
    cfg = Config().with_overrides({**TINY, "train": {"max_steps": 2}, "telemetry": {"tensorboard": False},
                                   "model": {**TINY["model"], "init_from": uri}})
    with Trainer(cfg, data_dir, tmp_path / "run", root) as trainer:  # preflight, then the warm start
        assert torch.equal(trainer.model.head[2].weight, state["head.2.weight"])
        assert trainer.run_meta["init"]["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
