"""The stage task run locally: where it stages, reuse of an earlier staging on a cache miss, and the
source fingerprint in the cache key: a grown folder is staged again, an unchanged one hits the cache."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
from dynamic_compile import compile_stage  # noqa: I001  (a module beside this file)
from flytekit import workflow
from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.type_engine import TypeEngine
from flytekit.models.task import Resources

import tasks.stage
from tasks.plan import plan_run
from tasks.stage import SourceStagingError, stage_dataset
from tasks.types import NodeResources, StagedDataset
from traincore.config.schema import DataConfig
from traincore.data.fingerprint import source_fingerprint
from traincore.data.manifest import Manifest
from traincore.data.staging import stage

DATA = DataConfig(source="synthetic", image_size=8, synthetic_samples=60, synthetic_classes=3)
FINGERPRINT = source_fingerprint(DATA)


def test_local_staging_lives_in_the_user_cache_not_under_tmp():
    staged = stage_dataset(data=DATA, source_fingerprint=FINGERPRINT)
    path = Path(staged.directory.path)
    assert path.is_relative_to(Path(os.environ["XDG_CACHE_HOME"]) / "flyte-torch-pipeline" / "staged")
    assert Manifest.load(path).splits["train"].count == staged.counts["train"]
    assert staged.source_fingerprint == FINGERPRINT


def test_a_different_config_stages_elsewhere_and_the_same_config_reuses(monkeypatch):
    first = Path(stage_dataset(data=DATA, source_fingerprint=FINGERPRINT).directory.path)
    seed = DataConfig(**{**DATA.__dict__, "seed": 1})
    other = Path(stage_dataset(data=seed, source_fingerprint=source_fingerprint(seed)).directory.path)
    assert first != other
    written = (first / "manifest.json").stat().st_mtime_ns
    calls = []
    monkeypatch.setattr(tasks.stage, "stage", lambda *a, **k: calls.append(a) or stage(*a, **k))
    # Flyte's own cache is bypassed here (a new cache version), so the task body runs and must reuse the
    # complete staging on disk instead of writing it again.
    monkeypatch.setattr(stage_dataset.metadata, "cache_version", "bypass-for-this-test")
    again = Path(stage_dataset(data=DATA, source_fingerprint=FINGERPRINT).directory.path)
    assert len(calls) == 1
    assert again == first and (first / "manifest.json").stat().st_mtime_ns == written


@workflow
def plan_and_stage(source: str) -> StagedDataset:
    """The pipeline's first two steps, wired as workflows/pipeline.py wires them."""
    plan = plan_run(source=source, preset="digits", config_overrides='{"data": {"image_size": 8}}', epochs=0,
                    max_steps=0, backend="local", nnodes="1", nproc_per_node=1, gpus_per_node=0,
                    accelerator="", max_restarts=0, parallelism="ddp", checkpoint_uri="", slurm_target="",
                    slurm_partition="", slurm_account="", slurm_time_limit="", slurm_sbatch_flags="",
                    slurm_setup="")
    return stage_dataset(data=plan.data, source_fingerprint=plan.source_fingerprint)


def test_a_growing_folder_is_staged_again_and_an_unchanged_one_hits_the_cache(image_folder_factory,
                                                                              monkeypatch):
    root = image_folder_factory("weekly", per_class=4, classes=3)
    calls = []
    monkeypatch.setattr(tasks.stage, "stage", lambda *a, **k: calls.append(a) or stage(*a, **k))
    source = f"imagefolder:{root}"

    first = plan_and_stage(source=source)
    assert len(calls) == 1 and sum(first.counts.values()) == 12
    for index in range(3):  # a week of new images
        shutil.copyfile(root / f"class_{index}" / "img_000.jpg", root / f"class_{index}" / "new_000.jpg")
    second = plan_and_stage(source=source)
    assert len(calls) == 2, "the grown folder hit the staging cache"
    assert sum(second.counts.values()) == 15
    assert second.source_fingerprint != first.source_fingerprint
    assert second.directory.path != first.directory.path
    third = plan_and_stage(source=source)
    assert len(calls) == 2, "the unchanged folder was staged again"
    assert third.source_fingerprint == second.source_fingerprint
    assert Path(third.directory.path) == Path(second.directory.path)
    assert Manifest.load(third.directory.path).source_fingerprint == second.source_fingerprint


def test_a_source_changed_after_the_plan_is_staged_as_read_and_says_so(image_folder_factory, caplog):
    root = image_folder_factory("moving", per_class=3, classes=2)
    data = DataConfig(source=f"imagefolder:{root}", image_size=8, decode_workers=1)
    planned = source_fingerprint(data)
    (root / "class_0" / "late.jpg").write_bytes((root / "class_0" / "img_000.jpg").read_bytes())
    caplog.set_level(logging.WARNING, logger="tasks.stage")
    staged = stage_dataset(data=data, source_fingerprint=planned)
    assert staged.source_fingerprint == source_fingerprint(data) != planned
    assert sum(staged.counts.values()) == 7
    assert f"changed after plan_run fingerprinted it ({planned})" in caplog.text


def test_the_partition_count_is_not_in_the_cache_key_and_partitions_stage_the_same_bytes(monkeypatch):
    data = DataConfig(source="synthetic", image_size=8, synthetic_samples=200, synthetic_classes=3,
                      samples_per_shard=40)
    fingerprint = source_fingerprint(data)
    one = Path(stage_dataset(data=data, source_fingerprint=fingerprint, partitions=1).directory.path)
    files = {p.name: p.read_bytes() for p in one.iterdir()}
    calls = []
    monkeypatch.setattr(tasks.stage, "stage", lambda *a, **k: calls.append(k) or stage(*a, **k))
    hit = Path(stage_dataset(data=data, source_fingerprint=fingerprint, partitions=3).directory.path)
    assert hit == one and calls == []  # the same bytes whatever the count: Flyte's cache answers
    monkeypatch.setattr(stage_dataset.metadata, "cache_version", "three-partitions")
    shutil.rmtree(one)
    three = Path(stage_dataset(data=data, source_fingerprint=fingerprint, partitions=3).directory.path)
    assert [k["partitions"] for k in calls] == [3]
    assert {p.name: p.read_bytes() for p in three.iterdir()} == files


def test_a_negative_partition_count_is_refused_by_the_staging_too(monkeypatch):
    # (the workflow's plan_run refuses it first: tests/faults/test_bad_inputs.py)
    monkeypatch.setattr(stage_dataset.metadata, "cache_version", "negative-partitions")  # the body runs
    with pytest.raises(SourceStagingError, match="partitions=-2: give a whole number >= 1"):
        stage_dataset(data=DATA, source_fingerprint=FINGERPRINT, partitions=-2)


def test_on_a_cluster_the_staging_is_a_map_task_of_partition_pods_sized_for_their_share():
    data = DataConfig(source="synthetic", image_size=64, synthetic_samples=1000, synthetic_classes=4,
                      samples_per_shard=100)
    spec = compile_stage(data, 3, NodeResources(mem="6Gi"))
    (array,) = [node for node in spec.nodes if node.array_node is not None]
    assert set(array.array_node._bound_inputs) == {"data", "location", "partitions", "source_fingerprint"}
    (indices,) = [b.binding.collection for b in array.inputs if b.var == "index"]
    assert [b.scalar.primitive.integer for b in indices.bindings] == [0, 1, 2]
    requests = {r.name: r.value for r in array.array_node.node.task_node.overrides.resources.requests}
    # A third of 12.3 MB staged, plus a quarter, plus 1 GiB, in whole GiB; the memory as given.
    assert requests == {Resources.ResourceName.CPU: "2", Resources.ResourceName.MEMORY: "6Gi",
                        Resources.ResourceName.EPHEMERAL_STORAGE: "2Gi"}
    published = [task.id.name for task in spec.tasks if "publish" in task.id.name]
    assert published == ["tasks.stage.publish_staging"]


def test_on_a_cluster_a_small_staging_of_one_partition_is_staged_in_the_dynamic_pod_itself():
    """No map task, no publish step: two pods fewer. The outputs are the staged dataset, its manifest
    written last under the location the shards went to, as publish_staging writes it."""
    outputs = compile_stage(DATA, 0)
    assert not hasattr(outputs, "nodes"), "a small staging still emitted a DynamicJobSpec"
    assert tasks.stage.estimated_bytes(DATA, 60) <= tasks.stage.IN_POD_STAGING_BYTES
    staged = TypeEngine.to_python_value(FlyteContextManager.current_context(), outputs.literals["o0"],
                                        StagedDataset)
    location = Path(staged.directory.remote_source or staged.directory.path)
    manifest = Manifest.load(location)
    assert sum(info.count for info in manifest.splits.values()) == 60
    assert staged.classes == ["class_0", "class_1", "class_2"] and manifest.source_fingerprint == FINGERPRINT
    shards = [shard.images for info in manifest.splits.values() for shard in info.shards]
    assert shards and all((location / name).is_file() for name in shards)
