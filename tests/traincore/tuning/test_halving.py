"""Successive halving's arithmetic: budgets, rung sizes, who goes on, the steps spent."""

from __future__ import annotations

import pytest

from traincore.tuning import rung_budgets, rung_sizes, steps_spent, survivors


def test_eight_trials_three_rungs_spend_half_the_steps_of_training_all():
    budgets, sizes = rung_budgets(400, 3, 2), rung_sizes(8, 3, 2)
    assert budgets == [100, 200, 400] and sizes == [8, 4, 2]
    assert steps_spent(budgets, sizes) == 8 * 100 + 4 * 100 + 2 * 200 == 1600 == 8 * 400 // 2
    assert rung_sizes(5, 3, 3) == [5, 2, 1] and rung_budgets(90, 3, 3) == [10, 30, 90]
    assert rung_budgets(7, 1, 2) == [7] and steps_spent([7], [3]) == 21  # one rung: no halving


def test_the_best_go_on_ties_to_the_lower_trial_and_loss_ranks_low_first():
    values = {0: 0.5, 1: 0.9, 2: 0.9, 3: 0.1, 4: 0.7}
    assert survivors(values, 3, "val_accuracy") == [1, 2, 4]
    assert survivors(values, 2, "val_loss") == [3, 0]


def test_rungs_that_leave_the_first_less_than_a_step_are_named():
    with pytest.raises(ValueError, match=r"rungs=4 with reduction 3 give the first rung max_steps / 27 = "
                                         r"0.37037 steps: lower rungs, or raise max_steps to at least 27"):
        rung_budgets(10, 4, 3)
    with pytest.raises(ValueError, match="a search needs rungs >= 1 and a reduction >= 2"):
        rung_budgets(10, 2, 1)
