"""Launch-input validation: every bad input fails in the plan with a message naming the input."""

from __future__ import annotations

import sys

import pytest
import torch

from tasks.plan import (
    LaunchInputError,
    check_backend,
    check_checkpoint_uri,
    check_range_input,
    check_source,
    check_topology,
    launch_config,
    plan_run,
)
from tasks.types import Topology
from traincore.config.presets import preset
from traincore.data.fingerprint import source_fingerprint

PLAN_DEFAULTS = dict(source="digits", preset="digits", config_overrides="", epochs=0, max_steps=0,
                     backend="local", nnodes="1", nproc_per_node=2, gpus_per_node=0, accelerator="",
                     max_restarts=0, parallelism="ddp", checkpoint_uri="", slurm_target="",
                     slurm_partition="", slurm_account="", slurm_time_limit="", slurm_sbatch_flags="",
                     slurm_setup="")


def test_launch_config_layers_preset_overrides_and_inputs():
    cfg = launch_config("digits", '{"loader": {"batch_size": 48}}', "synthetic", epochs=3, max_steps=0)
    assert ((cfg.loader.batch_size, cfg.data.source, cfg.train.epochs, cfg.train.max_steps)
            == (48, "synthetic", 3, 0))
    assert cfg.model == preset("digits").model
    assert launch_config("digits", "", "", epochs=0, max_steps=7).train.max_steps == 7


@pytest.mark.parametrize("kwargs, names", [
    (dict(preset_name="nope"), "input preset"),
    (dict(config_overrides="{not json"), "input config_overrides"),
    (dict(config_overrides='{"loader": {"batch_size": 0}}'), "loader.batch_size"),
    (dict(source="ftp"), "input source"),
    (dict(epochs=-1), "input epochs"),
    (dict(epochs=2, max_steps=5), "epochs=2 and max_steps=5"),
])
def test_launch_config_names_the_bad_input(kwargs, names):
    args = dict(preset_name="digits", config_overrides="", source="", epochs=0, max_steps=0) | kwargs
    with pytest.raises(LaunchInputError, match=names):
        launch_config(**args)


def test_without_a_source_input_the_preset_s_own_source_stands_and_the_plan_says_so(capsys, monkeypatch,
                                                                                      tmp_path):
    debug = plan_run(**PLAN_DEFAULTS | dict(source="", preset="debug", max_steps=2, nproc_per_node=1))
    assert debug.data.source == preset("debug").data.source == "synthetic"
    assert "source synthetic (preset debug's source;" in capsys.readouterr().out
    overridden = plan_run(**PLAN_DEFAULTS | dict(source="", config_overrides='{"data": {"source": "digits"}}',
                                                 preset="debug", max_steps=2, nproc_per_node=1))
    assert overridden.data.source == "digits"
    assert "source digits (config_overrides' data.source;" in capsys.readouterr().out
    plan_run(**PLAN_DEFAULTS | dict(source="synthetic", max_steps=2, nproc_per_node=1))
    assert "source synthetic (input source;" in capsys.readouterr().out
    # imagenet_like's own source is a folder this machine lacks: refused, naming the preset and the fix,
    # never replaced by digits.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LaunchInputError, match=r"preset imagenet_like's source='imagefolder:./data/imagenet'"
                       r": the dataset path .* does not exist .*give the source input \(--source"):
        plan_run(**PLAN_DEFAULTS | dict(source="", preset="imagenet_like"))


def test_missing_dataset_path_is_named(tmp_path):
    with pytest.raises(LaunchInputError, match=r"input source=.*does not exist"):
        check_source(f"imagefolder:{tmp_path / 'missing'}")
    with pytest.raises(LaunchInputError, match="does not exist"):
        check_source(f"imagefolder:file://{tmp_path / 'missing'}")
    check_source(f"imagefolder:{tmp_path}")  # exists
    check_source("imagefolder:s3://bucket/images")  # remote: left to the staging task


@pytest.mark.parametrize("changes, local_run, message", [
    (dict(backend="mesos"), True, r"input backend='mesos' is unknown"),
    (dict(nnodes=2, backend="local"), True, r"input nnodes=2 needs backend=.kubernetes. or .slurm."),
    (dict(nproc_per_node=0), True, r"input nproc_per_node=0 is invalid"),
    (dict(nnodes=0), True, r"input nnodes=0 is invalid"),
    (dict(gpus_per_node=-1), True, r"input gpus_per_node=-1"),
    (dict(nnodes=2), False, r"input nnodes=2 needs backend='kubernetes' or 'slurm'"),
    (dict(nnodes=2, backend="kubernetes"), True, r"input nnodes=2 needs a Flyte cluster"),
    (dict(accelerator="nvidia-tesla-a100"), True,
     r"input accelerator='nvidia-tesla-a100' needs gpus_per_node"),
    (dict(gpus_per_node=2, nproc_per_node=4), True, r"input nproc_per_node=4 exceeds gpus_per_node=2"),
    (dict(gpus_per_node=64, nproc_per_node=1), True,
     r"input gpus_per_node=64: this machine has \d+ CUDA device\(s\): lower gpus_per_node \(0 trains on the "
     r"CPU\)"),
])
def test_bad_topology_is_named(changes, local_run, message):
    with pytest.raises(LaunchInputError, match=message):
        check_topology(Topology(**changes), local_run=local_run)


@pytest.mark.parametrize("changes, local_run", [
    ({}, True),
    (dict(backend="kubernetes", nnodes=4, nproc_per_node=8, gpus_per_node=8, accelerator="nvidia-h100"),
     False),
])
def test_good_topology_passes(changes, local_run):
    check_topology(Topology(**changes), local_run=local_run)


@pytest.mark.parametrize("mode", ["sync", "dcp", "async"])
def test_several_nodes_checkpoint_into_an_object_store_in_every_mode_with_restarts(mode):
    """Every rank writes its own part straight into the store, so no mode or restart count is refused."""
    plan = plan_run(**{**PLAN_DEFAULTS, "backend": "slurm", "nnodes": "2", "nproc_per_node": 1,
                       "max_restarts": 1, "slurm_target": "login.example", "parallelism": "fsdp",
                       "checkpoint_uri": "s3://bucket/run",
                       "config_overrides": f'{{"checkpoint": {{"mode": "{mode}"}}}}'})
    assert (plan.config.checkpoint.mode, plan.topology.nnodes, plan.topology.max_restarts) == (mode, 2, 1)


def test_plan_task_runs_locally_and_rejects_multi_node():
    plan = plan_run(**PLAN_DEFAULTS | dict(source="synthetic", max_steps=12, nproc_per_node=1))
    assert plan.config.data == plan.data and plan.data.source == "synthetic"
    assert plan.source_fingerprint == source_fingerprint(plan.data)
    assert plan.config.train.max_steps == 12
    assert plan.topology == Topology(nproc_per_node=1, rdzv_timeout_s=plan.config.dist.init_timeout_s)
    with pytest.raises(Exception, match="needs a Flyte cluster"):
        plan_run(**PLAN_DEFAULTS | dict(backend="kubernetes", nnodes="2"))


@pytest.mark.parametrize("overrides, message", [
    ('{"model": {"name": "vit_b_16"}, "data": {"image_size": 12}}', r"model.name='vit_b_16' cannot take "
     r"data.image_size=12, data.channels=1.*multiple of 16"),
    ('{"data": {"image_size": 3}}', r"model.name='small_cnn' cannot take data.image_size=3.*Output size is "
     r"too small.*stage the data with a larger data.image_size"),
    ('{"checkpoint": {"mode": "async"}, "dist": {"backend": "nccl"}}',
     r"input config_overrides: checkpoint.mode='async' with dist.backend='nccl'"),
    ('{"train": {"epochs": "4"}}', r"input config_overrides: train.epochs='4' is invalid: expected an "
     "integer"),
    ('{"optim": {"param_groups": [{"pattern": "backbone.*", "freeze": true}]}}',
     r"input config_overrides \(or preset\): optim.param_groups\[0\] pattern 'backbone.\*' matches no "
     r"parameter of the model"),
    # Once refused only by the evaluation, after staging and training (val: after staging).
    ('{"data": {"test_fraction": 0.0}}', r"input config_overrides: data.test_fraction=0 stages an empty test "
     r"split, which the workflow evaluates on: give it a fraction above 0, e.g. 0.1"),
    ('{"data": {"val_fraction": 0}}', r"data.val_fraction=0 stages an empty val split, which the workflow "
     r"validates on"),
    # Once refused by the train task's preflight, after staging.
    ('{"model.init_from": "/nonexistent/w.safetensors"}', r"input config_overrides \(or preset\): "
     r"model.init_from='/nonexistent/w.safetensors' does not exist: pass the path or URI of the weights"),
])
def test_config_that_cannot_run_is_refused_in_the_plan(overrides, message):
    with pytest.raises(LaunchInputError, match=message):
        plan_run(**PLAN_DEFAULTS | dict(config_overrides=overrides))


def test_nccl_needs_gpus(monkeypatch):
    nccl = preset("digits").with_overrides({"dist.backend": "nccl"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LaunchInputError, match=r"dist.backend='nccl' needs GPUs, but this machine has no"):
        check_backend(nccl, Topology(), local_run=True)
    with pytest.raises(LaunchInputError, match=r"gpus_per_node=0 gives the nodes no GPU.*request GPUs"):
        check_backend(nccl, Topology(backend="kubernetes"), local_run=False)
    check_backend(nccl, Topology(backend="kubernetes", gpus_per_node=2, nproc_per_node=2), local_run=False)
    check_backend(preset("digits"), Topology(), local_run=True)  # auto: gloo without CUDA


def test_checkpoint_uri_is_checked_before_anything_runs(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(LaunchInputError, match=r"input checkpoint_uri='.*file': checkpoint directory .* is a "
                                               "file, not a directory: set checkpoint_uri to a directory"):
        check_checkpoint_uri(str(tmp_path / "file"), local_run=True)
    with pytest.raises(LaunchInputError, match=r"cannot be created \(Not a directory\)"):
        check_checkpoint_uri(f"file://{tmp_path}/file/sub", local_run=True)
    with pytest.raises(LaunchInputError, match=r"input checkpoint_uri='nfs4://host/x'.* unknown scheme nfs4://"):
        check_checkpoint_uri("nfs4://host/x", local_run=True)
    check_checkpoint_uri(str(tmp_path / "new" / "root"), local_run=True)  # created, proven writable
    assert (tmp_path / "new" / "root").is_dir() and not any((tmp_path / "new" / "root").iterdir())
    check_checkpoint_uri("s3://bucket/run", local_run=True)  # a known scheme: nothing is contacted
    # Known to fsspec but no store (it would fail after training, in a botocore or socket traceback):
    with pytest.raises(LaunchInputError, match=r"input checkpoint_uri='ftp://host/ck': ftp:// cannot hold "
                                               r"checkpoints or models: use a local path or an object store"):
        check_checkpoint_uri("ftp://host/ck", local_run=True)
    with pytest.raises(LaunchInputError, match=r"input checkpoint_uri='s3://': 's3://' names no bucket: "
                                               r"write s3://BUCKET/PATH"):
        check_checkpoint_uri("s3://", local_run=True)
    check_checkpoint_uri(str(tmp_path / "file"), local_run=False)  # a cluster's plan pod need not mount it


def test_unknown_uri_scheme_of_the_source_is_named():
    with pytest.raises(LaunchInputError, match=r"input source='imagefolder:htps://x/y': 'htps://x/y' has the "
                                               "unknown scheme htps://"):
        check_source("imagefolder:htps://x/y")


def test_plan_fingerprints_the_source_as_it_is_at_each_run(image_folder_factory, capsys):
    root = image_folder_factory(per_class=3, classes=2)
    run = PLAN_DEFAULTS | dict(source=f"imagefolder:{root}", nproc_per_node=1)
    first = plan_run(**run).source_fingerprint
    assert first.startswith("imagefolder:sha256:") and first in capsys.readouterr().out
    assert plan_run(**run).source_fingerprint == first  # not cached, and the same for the same folder
    (root / "class_1" / "added.jpg").write_bytes((root / "class_1" / "img_000.jpg").read_bytes())
    assert plan_run(**run).source_fingerprint not in (first, "")


def test_an_imagefolder_the_staging_would_refuse_fails_the_plan(image_folder_factory):
    root = image_folder_factory(per_class=3, classes=1)
    with pytest.raises(LaunchInputError, match=r"input source='imagefolder:.*' has images for only one "
                                               "class"):
        plan_run(**PLAN_DEFAULTS | dict(source=f"imagefolder:{root}"))


@pytest.mark.parametrize("changes, message", [
    (dict(nnodes="0:2"), r"input nnodes='0:2' is invalid: give a node count N \(e.g. 2\) or a range "),
    (dict(nnodes="3:2"), r"input nnodes='3:2' is invalid"),
    (dict(nnodes="a:b"), r"input nnodes='a:b' is not a node count"),
    (dict(nnodes="0"), r"input nnodes='0' is invalid"),
    (dict(nnodes="1:2"), r"input nnodes='1:2' is a range, but backend='local' runs one agent on this "
                         r"machine.*start torchrun agents yourself with --nnodes 1:2"),
    (dict(nnodes="1:2", backend="slurm", slurm_target="hpc"),
     r"input nnodes='1:2' is a range, but a Slurm job's allocation has a fixed node count: give nnodes=2"),
    (dict(nnodes="1:2", backend="kubernetes"), r"input nnodes='1:2' is a range.*give max_restarts >= 1"),
    (dict(nnodes="2:3", backend="kubernetes", max_restarts=1), r"input nnodes='2:3': train.global_batch=192 "
     r"cannot be split into whole batches of loader.batch_size=32 on 2 node\(s\) of 2 process\(es\).*a "
     r"multiple of 384"),
])
def test_a_bad_node_count_or_range_is_refused_before_anything_stages(changes, message):
    with pytest.raises(LaunchInputError, match=message):
        plan_run(**PLAN_DEFAULTS | dict(preset="digits", source="") | changes)


def test_a_range_on_kubernetes_keeps_the_global_batch_of_its_largest_world():
    topology = Topology(backend="kubernetes", nnodes=4, min_nnodes=2, nproc_per_node=2, max_restarts=1)
    cfg = preset("digits").with_overrides({"loader.batch_size": 16, "train.global_batch": 384})
    assert (topology.elastic, topology.nodes) == (True, "2:4")
    assert check_range_input(cfg, topology) is cfg  # 384 = 16 x 2 x 12 splits at 2, 3 and 4 nodes
    pair = Topology(backend="kubernetes", nnodes=2, min_nnodes=1, nproc_per_node=2, max_restarts=1)
    assert check_range_input(preset("digits"), pair).train.global_batch == 32 * 2 * 2
    fixed = Topology(backend="kubernetes", nnodes=4, nproc_per_node=2)
    assert (fixed.elastic, fixed.nodes, check_range_input(cfg, fixed)) == (False, "4", cfg)


def test_slurm_inputs_are_checked_as_given_without_contacting_the_cluster():
    """A cluster's plan pod need not reach the login node: the connector checks the cluster at submission."""
    slurm = PLAN_DEFAULTS | dict(backend="slurm", nproc_per_node=1, max_steps=5, nnodes="64",
                                 slurm_target="login.no-such-cluster.invalid", slurm_partition="nowhere")
    plan = plan_run(**slurm)  # an unresolvable host and a partition nobody has: not this task's business
    assert plan.topology.slurm.target == "login.no-such-cluster.invalid" and plan.topology.nnodes == 64
    assert plan.topology.slurm.setup == f"source {sys.prefix}/bin/activate"  # a local run's own environment
    with pytest.raises(LaunchInputError, match=r"input backend='slurm' needs slurm_target"):
        plan_run(**slurm | dict(slurm_target=""))
    with pytest.raises(LaunchInputError, match=r"input slurm_target='two words'"):
        plan_run(**slurm | dict(slurm_target="two words"))
    with pytest.raises(LaunchInputError, match=r"input slurm_sbatch_flags='--comment=.open' is not valid"):
        plan_run(**slurm | dict(slurm_sbatch_flags='--comment="open'))
    # The time limit, from the inputs alone: once refused only at submission, after staging.
    with pytest.raises(LaunchInputError, match=r"input slurm_time_limit='0:30' \(30 s\) is not longer than"):
        plan_run(**slurm | dict(slurm_time_limit="0:30"))


@pytest.mark.parametrize("changes, message", [
    (dict(store_secret="Bad_Name"), r"input store_secret='Bad_Name' is not a Kubernetes secret name"),
    (dict(store_secret="ckpt", backend="slurm", slurm_target="login.example"),
     r"input store_secret is for backend 'local' or 'kubernetes'"),
    (dict(store_secret="ckpt", checkpoint_uri="gs://bucket/run"),
     r"checkpoint_uri='gs://bucket/run' is not on"),
])
def test_store_secret_is_checked_in_the_plan(changes, message):
    with pytest.raises(LaunchInputError, match=message):
        plan_run(**{**PLAN_DEFAULTS, **changes})


def test_a_store_secret_reaches_the_topology_and_the_train_pods_mount_it():
    from tasks.launch import train_task_for
    from tasks.storage import STORE_SECRET_KEYS

    plan = plan_run(**{**PLAN_DEFAULTS, "store_secret": "ckpt-store", "checkpoint_uri": "s3://bucket/run"})
    assert plan.topology.store_secret == "ckpt-store"
    task = train_task_for(plan.topology, plan.config)
    mounted = [(s.group, s.key) for s in task.security_context.secrets]
    assert mounted == [("ckpt-store", key) for key in STORE_SECRET_KEYS]
    assert task.name != train_task_for(Topology(), plan.config).name  # another template, another task
