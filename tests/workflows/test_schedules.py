"""The scheduled retraining launch plan: its schedule, its fixed inputs and the gate it ends in."""

from __future__ import annotations

from flytekit import CronSchedule

from workflows.schedules import retrain_and_promote, scheduled_retraining


def test_launch_plan_carries_its_cron_schedule_and_fixed_inputs():
    assert scheduled_retraining.name == "scheduled_retraining"
    assert isinstance(scheduled_retraining.schedule, CronSchedule)
    assert scheduled_retraining.schedule.cron_schedule.schedule == "0 3 * * 1"
    fixed = {name: literal.scalar.primitive
             for name, literal in scheduled_retraining.fixed_inputs.literals.items()}
    assert fixed["threshold"].float_value == 0.95 and fixed["source"].string_value == "digits"
    assert "baseline_accuracy" in scheduled_retraining.parameters.parameters  # operators may raise it
    assert "threshold" not in scheduled_retraining.parameters.parameters


def test_retraining_ends_in_the_promotion_gate():
    last = retrain_and_promote.nodes[-1]
    assert last.flyte_entity.name == "tasks.promote.promotion_gate"
    assert set(retrain_and_promote.python_interface.inputs) >= {"threshold", "baseline_accuracy"}
