"""Sharded training (FSDP2) on real gloo ranks: bitwise resume, and checkpoints of every mode that continue
on another world size and under the other parallelism with exactly the state they saved."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from ranks import start_script, wait_exit
from safetensors.torch import load_file
from trainruns import CHECKPOINTED, final_weights, killed_and_resumed, run_train

from traincore.artifacts.export import export
from traincore.checkpoint import complete_steps
from traincore.config.schema import ModelConfig
from traincore.model.build import build_model, shard_units

FSDP = ("--parallelism", "fsdp")

# `python check_loaded.py DATA ROOT PARALLELISM STEPS REPORT CONFIG NPROC`, run as a child forked from
# tests/ranks.py's server: on NPROC ranks (torch elastic's workers, forked from that child as the train CLI
# forks its own), build a Trainer on a checkpoint root (a Trainer loads the latest checkpoint when it is
# built), compare the whole state it loaded with the checkpoint's files read by torch's own tools, bit for
# bit, before any step; then train to the end. Rank 0 writes what it found to REPORT.
CHECK_LOADED = r'''
import json, sys
from pathlib import Path
import torch, torch._dynamo, torch.distributed as dist  # torch._dynamo: the optimizer's, imported once here
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from traincore.checkpoint import latest_complete, read_marker
from traincore.config.presets import build_config
from traincore.run.launch import launch_local
from traincore.run.state import ModelState, OptimizerState
from traincore.run.trainer import Trainer


def tensors(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from tensors(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            yield f"{prefix}{key}", value


def check(data, root, parallelism, steps, report, config):
    cfg = build_config("debug", config, {"dist.parallelism": parallelism, "train.max_steps": int(steps)})
    latest = latest_complete(root)
    trainer = Trainer(cfg, data, Path(root).parent / "continued", root)
    loaded = {"model": ModelState(trainer.model).full_state_dict(),
              "optimizer": OptimizerState(trainer.model, trainer.optimizer).full_state_dict()}
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        if read_marker(latest)["format"] == "torch_save":
            saved = torch.load(latest / "state.pt", weights_only=True)["shared"]
        else:
            dcp_to_torch_save(latest, Path(root).parent / "saved.pt")
            saved = torch.load(Path(root).parent / "saved.pt", weights_only=True)
        mine = dict(tensors(loaded))
        theirs = {name: value for name, value in tensors(saved) if name.split(".")[0] in loaded}
        different = [name for name in theirs if name not in mine or not torch.equal(mine[name], theirs[name])]
        Path(report).write_text(json.dumps({"step": trainer.progress.step, "compared": len(theirs),
                                            "different": different, "world_size": trainer.ctx.world_size}))
    summary = trainer.train()
    assert summary.steps == int(steps) and summary.resumed_from == int(latest.name.split("-")[1])


if __name__ == "__main__":
    launch_local(check, (*sys.argv[1:6], json.loads(sys.argv[6])), int(sys.argv[7]))
'''

CONFIG = CHECKPOINTED  # the config of conftest.py's ``saved`` runs, which these continue


@pytest.mark.parametrize("written, nproc, parallelism", [
    ("fsdp-dcp-2", 1, "fsdp"), ("fsdp-dcp-2", 3, "fsdp"), ("fsdp-dcp-2", 2, "ddp"),
    ("fsdp-sync-2", 3, "ddp"), ("fsdp-async-2", 1, "fsdp"), ("ddp-dcp-1", 2, "fsdp"),
])
def test_a_checkpoint_continues_on_another_world_size_and_parallelism(saved, data_dir, tmp_path, written,
                                                                       nproc, parallelism):
    root = tmp_path / "checkpoints"
    shutil.copytree(saved(written), root)
    script, report, log = tmp_path / "check_loaded.py", tmp_path / "report.json", tmp_path / "check.log"
    script.write_text(CHECK_LOADED)
    args = [data_dir, root, parallelism, 15, report, json.dumps(CONFIG), nproc]
    assert wait_exit(start_script(script, args, log), timeout=300) == 0, log.read_text()[-6000:]
    found = json.loads(report.read_text())
    assert found["step"] == 10 and found["world_size"] == nproc
    assert found["compared"] > 10 and found["different"] == [], found  # model and optimizer, bit for bit
    assert complete_steps(root)[-1] == 15


# Sharded, with the knobs that hold state beside the model: the average of the weights is sharded as the
# model is, a frozen stem and a head at its own rate in the optimizer's groups, and a step schedule.
TUNED = {**CONFIG, "optim": {**CONFIG["optim"], "schedule": "step", "ema_decay": 0.9,
                             "param_groups": [{"pattern": "head.*", "lr_mult": 5},
                                              {"pattern": "features.0.*", "freeze": True}]}}


def test_a_killed_fsdp_run_resumes_to_the_weights_of_an_uninterrupted_one(data_dir, forked_train, tmp_path):
    reference = tmp_path / "reference"
    forked_train(data_dir, reference, 2, "--max-steps", "30", "--checkpoint-mode", "dcp", *FSDP,
                 config=TUNED)
    killed = tmp_path / "killed"
    killed_and_resumed(data_dir, killed, 30, "--checkpoint-mode", "dcp", *FSDP, config=TUNED)
    expected, actual = final_weights(reference), final_weights(killed)
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


def test_the_export_of_a_sharded_checkpoint_equals_that_of_the_same_state_saved_whole(saved, tmp_path):
    """dcp (every rank wrote its shards) and sync (rank 0 wrote the gathered state) of the same run: one
    plain process, no process group, turns either into the same safetensors file."""
    export(saved("fsdp-dcp-2"), tmp_path / "dcp" / "model.safetensors")  # an export directory each: its
    export(saved("fsdp-sync-2"), tmp_path / "sync" / "model.safetensors")  # lineage.json is per directory
    sharded = load_file(tmp_path / "dcp" / "model.safetensors")
    whole = load_file(tmp_path / "sync" / "model.safetensors")
    assert sharded.keys() == whole.keys() and len(sharded) > 4
    assert all(torch.equal(sharded[name], whole[name]) for name in sharded)


@pytest.mark.parametrize("name", ["small_cnn", "mlp", "resnet18", "vit_tiny"])
def test_every_model_names_its_blocks_for_sharding(name):
    shape = (3, 32, 32)
    with torch.device("meta"):
        model = build_model(ModelConfig(name=name), 10, shape)
    units = shard_units(model)
    assert len(units) >= 3 and all(any(unit is module for module in model.modules()) for unit in units)


def test_telemetry_reports_the_model_state_each_rank_holds(saved):
    """Under FSDP on 2 ranks each holds about half of the parameters and optimizer state that one rank
    holding the whole model does."""
    def memory(name: str) -> dict:
        rows = [json.loads(line) for line in (saved(name).parent / "metrics.jsonl").read_text().splitlines()]
        return next(row for row in rows if row["kind"] == "memory")

    whole, sharded = memory("ddp-dcp-1"), memory("fsdp-dcp-2")
    assert whole["param_bytes_total"] == sharded["param_bytes_total"] > 0
    # AdamW's two moments per parameter; each rank also keeps its own 4-byte step counter per parameter
    assert whole["optimizer_bytes_total"] > 1.9 * whole["param_bytes_total"]
    assert sharded["optimizer_bytes_total"] == pytest.approx(whole["optimizer_bytes_total"], rel=0.01)
    for kind in ("param", "optimizer"):
        share = sharded[f"{kind}_bytes_per_rank"] / whole[f"{kind}_bytes_per_rank"]
        assert 0.45 < share < 0.6, (kind, share)  # 1/2, plus the padding of odd-sized shards


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fsdp_on_two_gpus_computes_in_bf16_and_resumes(data_dir, tmp_path):
    """NCCL, FSDP's mixed precision (bf16 parameters, fp32 reduction) and an async save on two devices."""
    run_train(data_dir, tmp_path / "run", 2, "--max-steps", "10", "--checkpoint-mode", "async", *FSDP,
              config=CONFIG)
    done = run_train(data_dir, tmp_path / "run", 2, "--max-steps", "15", "--checkpoint-mode", "async", *FSDP,
                     config=CONFIG)
    assert "resumed from step 10" in done.stdout + done.stderr
    assert complete_steps(tmp_path / "run" / "checkpoints")[-1] == 15
