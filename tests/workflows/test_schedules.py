"""The scheduled retraining launch plan: its schedule, its inputs and the champion/challenger gate."""

from __future__ import annotations

from flytekit import CronSchedule

from workflows.pipeline import training_pipeline
from workflows.schedules import (
    SCHEDULED_REGISTRY,
    retrain_and_promote,
    scheduled_gpu_retraining,
    scheduled_retraining,
)


def test_launch_plan_carries_its_cron_schedule_and_a_value_for_every_input():
    assert scheduled_retraining.name == "scheduled_retraining"
    assert isinstance(scheduled_retraining.schedule, CronSchedule)
    assert scheduled_retraining.schedule.cron_schedule.schedule == "0 3 * * 1"
    fixed = {name: literal.scalar.primitive
             for name, literal in scheduled_retraining.fixed_inputs.literals.items()}
    assert fixed["threshold"].float_value == 0.95 and fixed["preset"].string_value == "digits"
    defaults = scheduled_retraining.parameters.parameters
    # The source is a default, changed at launch (a team's own data) without a new launch plan; by default
    # the preset's own (digits).
    assert "source" not in fixed and defaults["source"].default.scalar.primitive.string_value == ""
    # A schedule launches with no one to type a value: every input is fixed or has a default.
    assert set(fixed) | set(defaults) == set(retrain_and_promote.python_interface.inputs)
    assert defaults["promoted_uri"].default.scalar.primitive.string_value == SCHEDULED_REGISTRY
    assert SCHEDULED_REGISTRY.startswith("s3://")  # a pod's own disk would forget the champion
    assert defaults["champion"].default.scalar.none_type is not None  # none: the registry's latest
    assert defaults["tolerance"].default.scalar.primitive.float_value == 0.01
    assert "threshold" not in defaults


def test_retraining_checks_its_inputs_first_and_ends_in_the_promotion_gate():
    nodes = retrain_and_promote.nodes
    assert nodes[0].flyte_entity.name == "tasks.promote.check_promotion"
    assert nodes[1].upstream_nodes == [nodes[0]]  # training waits for the check
    assert nodes[-1].flyte_entity.name == "tasks.promote.promotion_gate"
    assert nodes[1].flyte_entity.name == "tasks.promote.warm_start_overrides"
    inputs = retrain_and_promote.python_interface.inputs
    assert set(inputs) >= {"source", "preset", "threshold", "tolerance", "champion", "promoted_uri"}
    assert "baseline_accuracy" not in inputs
    # Retraining takes every training input of the pipeline, under the same names and types (the cluster's
    # GPUs, a durable checkpoint root, the store's secret), and whether to start from the model in service.
    pipeline = training_pipeline.python_interface.inputs
    assert {name: inputs[name] for name in pipeline} == pipeline and inputs["warm_start"] is bool


def test_the_gpu_schedule_retrains_on_kubernetes_gpus_warm_started_with_every_input_set():
    fixed = {name: literal.scalar.primitive
             for name, literal in scheduled_gpu_retraining.fixed_inputs.literals.items()}
    assert fixed["backend"].string_value == "kubernetes" and fixed["gpus_per_node"].integer == 8
    assert fixed["nnodes"].string_value == "2" and fixed["nproc_per_node"].integer == 8
    defaults = scheduled_gpu_retraining.parameters.parameters
    assert set(fixed) | set(defaults) == set(retrain_and_promote.python_interface.inputs)
    assert defaults["warm_start"].default.scalar.primitive.boolean is True
    assert defaults["store_secret"].default.scalar.primitive.string_value == "store-credentials"
    # Each night's run keeps its checkpoints under its own execution: none resumes another night's.
    assert "checkpoint_uri" not in fixed
    assert defaults["checkpoint_uri"].default.scalar.primitive.string_value == ""
