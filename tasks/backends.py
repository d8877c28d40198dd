"""Training backends by name: what plan_run checks the ``backend`` input against, and what each runs.

A module of its own so that checking a launch input never imports a train task (kfpytorch, a task built at
import time).
"""

ELASTIC_BACKENDS = ("local", "kubernetes")  # both run the kfpytorch Elastic train task (tasks/train.py)
BACKENDS = ELASTIC_BACKENDS  # every backend a launch may name today
PLANNED_BACKENDS = ("slurm",)  # accepted by name so the error can say it is coming, not that it is unknown
