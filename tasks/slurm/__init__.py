"""The Slurm backend: a Flyte connector that runs the train task as a Slurm job over SSH.

    connector  the Flyte side: task type ``slurm_train`` and its connector (create / get / delete)
    job        the batch job a run becomes: sbatch flags and the script, built from a Topology; the nodes'
               failures and the job's outcome from its state and their markers
    report     what a finished job tells its user: summary, or first failure, stderr, resume step
    client     a small Slurm client: sbatch / scontrol / sacct / scancel over SSH
    ssh        asyncssh connections to the login node, host keys always verified
    states     every Slurm job state mapped to an outcome; parsers for scontrol, sacct, versions
"""
