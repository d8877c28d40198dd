"""Hyperparameter search by successive halving: every trial trains to the first rung's step budget; the
best 1/reduction go on, each from its own checkpoint, to the next rung's; the best of the last rung is
exported and evaluated on the test split.

    pyflyte run workflows/tuning.py tune_pipeline --max_steps 160 --trials 8 --rungs 3 \\
        --search_space '{"optim.lr": {"low": 1e-4, "high": 1e-2, "log": true},
                         "model.width": {"choices": [8, 16, 32]}}'

Each trial runs on the chosen backend (local processes, a PyTorchJob, a Slurm job) as training_pipeline's
train node does, in a checkpoint root of its own under the search's root; at most ``parallel`` trials
train at a time. The search's record (study.json) sits in that root too: the same command run again
continues it, and a trial that finished a rung resumes from its checkpoint there, training nothing twice.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from flytekit import dynamic, workflow

from tasks.evaluate import evaluate_model
from tasks.export import export_model
from tasks.plan import plan_run
from tasks.stage import stage_dataset
from tasks.tuning import finish_search, plan_search, rung_record, search_report
from tasks.types import (
    EvalReport,
    ModelArtifact,
    RungResult,
    Search,
    SearchFinish,
    SearchOutcome,
    StagedDataset,
    Topology,
    TrainResult,
)
from traincore.config import Config
from traincore.tuning import trial_config
from workflows.pipeline import train_node


@dynamic
def run_rung(search: Search, config: Config, rung: int, dataset: StagedDataset, topology: Topology,
             capacity: str, done: list[RungResult]) -> SearchFinish:
    """Train this rung's trials (rung 0: every trial; then the survivors of the rung before) to its budget,
    each from its own last checkpoint, at most ``search.parallel`` at a time (but those whose result at
    this rung an earlier run recorded); then the next rung, or the outcome. Each trial is a train node of
    this dynamic workflow (train_node): no node of its own around it."""
    trials = done[-1].survivors if done else list(range(len(search.params)))
    base = config.with_overrides({"train.metric": search.metric})
    known = search.known(rung)  # recorded by an earlier run of this search: nothing to train again
    results = []
    for index, trial in enumerate(t for t in trials if t not in known):
        trained = train_node(
            config=trial_config(base, json.loads(search.params[trial]), search.budgets[rung]),
            dataset=dataset, topology=topology, checkpoint_root=search.trial_root(trial), capacity=capacity)
        if index >= search.parallel:  # a trial starts once the one `parallel` places before it is done
            results[index - search.parallel] >> trained
        results.append(trained)
    if rung == len(search.budgets) - 1:
        return finish_search(search=search, rung=rung, trials=trials, results=results, done=done)
    record = rung_record(search=search, rung=rung, trials=trials, results=results)
    return run_rung(search=search, config=config, rung=rung + 1, dataset=dataset, topology=topology,
                    capacity=capacity, done=[*done, record])


class TuningOutputs(NamedTuple):
    model: ModelArtifact
    report: EvalReport
    search: SearchOutcome
    best: TrainResult
    summary: str


@workflow
def tune_pipeline(
    search_space: str,
    trials: int = 8,
    parallel: int = 2,
    rungs: int = 3,
    metric: str = "val_accuracy",
    reduction: int = 2,
    source: str = "",
    preset: str = "digits",
    config_overrides: str = "",
    epochs: int = 0,
    max_steps: int = 0,
    backend: str = "local",
    nnodes: str = "1",
    nproc_per_node: int = 2,
    gpus_per_node: int = 0,
    accelerator: str = "",
    max_restarts: int = 0,
    parallelism: str = "ddp",
    checkpoint_uri: str = "",
    capacity: str = "on-demand",
    slurm_target: str = "",
    slurm_partition: str = "",
    slurm_account: str = "",
    slurm_time_limit: str = "",
    slurm_sbatch_flags: str = "",
    slurm_setup: str = "",
    store_secret: str = "",
    stage_partitions: int = 0,
    resources: str = "",
) -> TuningOutputs:
    """Search hyperparameters by successive halving, then export and evaluate the best trial's model.

    The inputs after ``reduction`` are training_pipeline's, with the same meaning, for every trial.

    Args:
        search_space: JSON object of dotted config keys, each {"choices": [...]}, {"low": a, "high": b} or
            {"low": a, "high": b, "log": true}, e.g. '{"optim.lr": {"low": 1e-4, "high": 1e-2, "log": true}}'.
        trials: Configurations drawn from the space (Optuna's quasi-random sampler, seeded by train.seed).
        parallel: Trials that train at the same time, at most.
        rungs: Rungs of successive halving; the last trains to max_steps.
        metric: What ranks the trials: 'val_accuracy' (higher is better) or 'val_loss' (lower).
        reduction: Each rung keeps the best 1/reduction of the trials and gives them reduction x the steps.
        source: See training_pipeline.
        preset: See training_pipeline.
        config_overrides: See training_pipeline (the search space's keys override it, trial by trial).
        epochs: See training_pipeline (a search needs max_steps).
        max_steps: Steps of the last rung (the whole run of a trial that reaches it).
        backend: See training_pipeline.
        nnodes: See training_pipeline.
        nproc_per_node: See training_pipeline.
        gpus_per_node: See training_pipeline.
        accelerator: See training_pipeline.
        max_restarts: See training_pipeline.
        parallelism: See training_pipeline.
        checkpoint_uri: The search's root (its record and one checkpoint root per trial); empty = a local
            directory named by the search (~/.cache/flyte-torch-pipeline/searches/<key>), or the execution's
            raw-output prefix on a cluster.
        capacity: See training_pipeline.
        slurm_target: See training_pipeline.
        slurm_partition: See training_pipeline.
        slurm_account: See training_pipeline.
        slurm_time_limit: See training_pipeline.
        slurm_sbatch_flags: See training_pipeline.
        slurm_setup: See training_pipeline.
        store_secret: See training_pipeline.
        stage_partitions: See training_pipeline.
        resources: See training_pipeline ('train': each trial's nodes).

    Returns:
        model: The best trial's exported model; its lineage names the search, the trial, its parameters.
        report: Its test-split evaluation.
        search: Every rung's trials and metrics, and the best trial.
        best: The best trial's training run (its checkpoints, records and summary).
        summary: "steps spent: N of M", the best trial and its "test accuracy".
    """
    plan = plan_run(source=source, preset=preset, config_overrides=config_overrides, epochs=epochs,
                    max_steps=max_steps, backend=backend, nnodes=nnodes, nproc_per_node=nproc_per_node,
                    gpus_per_node=gpus_per_node, accelerator=accelerator, max_restarts=max_restarts,
                    parallelism=parallelism, checkpoint_uri=checkpoint_uri, slurm_target=slurm_target,
                    slurm_partition=slurm_partition, slurm_account=slurm_account,
                    slurm_time_limit=slurm_time_limit, slurm_sbatch_flags=slurm_sbatch_flags,
                    slurm_setup=slurm_setup, store_secret=store_secret, capacity=capacity,
                    stage_partitions=stage_partitions, resources=resources)
    search = plan_search(config=plan.config, search_space=search_space, trials=trials, parallel=parallel,
                         rungs=rungs, reduction=reduction, metric=metric, checkpoint_uri=checkpoint_uri)
    dataset = stage_dataset(data=plan.data, source_fingerprint=plan.source_fingerprint,
                            partitions=stage_partitions, resources=plan.stage_resources)
    search >> dataset  # a bad search fails before anything stages
    outcome, best, lineage = run_rung(search=search, config=plan.config, rung=0, dataset=dataset,
                                      topology=plan.topology, capacity=capacity, done=[])
    model = export_model(trained=best, dataset=dataset, search=lineage)
    report = evaluate_model(model=model, dataset=dataset, trained=best)
    summary = search_report(search=search, outcome=outcome, report=report)
    return TuningOutputs(model=model, report=report, search=outcome, best=best, summary=summary)
