"""Training backends by name: what plan_run checks the ``backend`` input against.

A module of its own so that checking a launch input never imports a train task (kfpytorch, a task built at
import time).
"""

ELASTIC_BACKENDS = ("local", "kubernetes")  # the kfpytorch Elastic train task (tasks/train.py)
SLURM_BACKEND = "slurm"  # the same task submitted through the Slurm connector (tasks/slurm/connector.py)
BACKENDS = (*ELASTIC_BACKENDS, SLURM_BACKEND)
# The ``capacity`` input: what nodes the train pods may run on. "preemptible" marks the train node
# interruptible, so Flyte may place its pods on spot / preemptible nodes (Kubernetes only: on Slurm a
# preemptible partition or QOS says it).
CAPACITIES = ("on-demand", "preemptible")
