"""The scheduled retraining launch plan: its schedule, its inputs and the champion/challenger gate."""

from __future__ import annotations

from flytekit import CronSchedule

from workflows.schedules import SCHEDULED_REGISTRY, retrain_and_promote, scheduled_retraining


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
    inputs = set(retrain_and_promote.python_interface.inputs)
    assert inputs >= {"source", "preset", "threshold", "tolerance", "champion", "promoted_uri"}
    assert "baseline_accuracy" not in inputs
