"""Hyperparameter search by successive halving: which configurations to try, how many steps each rung
gives, which trials go on, and the study's record that a rerun finds.

    space    the search space (JSON: choices, ranges, log ranges over dotted config keys), checked
             against the config tree, and sampled through Optuna's ask interface
    halving  rung budgets, how many trials each rung keeps, and the steps a search spends
    study    the study's record in its root (trials, parameters, every rung's results) and Optuna's view of it

Other packages import from here, never from the modules.
"""

from traincore.tuning.halving import rung_budgets, rung_sizes, steps_spent, survivors
from traincore.tuning.space import SearchSpaceError, parse_space, trial_config
from traincore.tuning.study import RECORD_FILE, StudyError, StudyRecord, load_or_create, spec_key

__all__ = [
    "load_or_create", "parse_space", "RECORD_FILE", "rung_budgets", "rung_sizes", "SearchSpaceError",
    "spec_key", "steps_spent", "StudyError", "StudyRecord", "survivors", "trial_config",
]
