"""The promotion gate: champion (the model in service) against challenger (the new model).

Both are evaluated on the new test split by the same code (traincore.evaluate). The challenger is promoted,
that is published to the registry at ``promoted_uri`` as a new version that ``latest`` then names, only when
its accuracy reaches the threshold and is not below the champion's by more than the tolerance. A champion
with another class list or input shape cannot be compared on this split: it is a refusal that says which
differs and what to do.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import flytekit
import fsspec
from flytekit import Resources, task
from flytekit.core.context_manager import FlyteContextManager
from flytekit.deck import DeckField

from tasks.evaluate import TEST_SPLIT
from tasks.plan import LaunchInputError, check_protocol
from tasks.report import promotion_deck_html
from tasks.storage import NODE_CACHE, dataset_location, is_uri, local_directory, local_path
from tasks.types import EvalReport, ModelArtifact, Promotion, StagedDataset
from traincore.artifacts import (
    WEIGHTS_FILE,
    Champion,
    ExportError,
    Lineage,
    Registry,
    check_exported,
    evaluate,
    load_exported,
    resolve_champion,
)
from traincore.files import sha256_file
from traincore.run import OutputError, ensure_writable_dir

MODEL_CACHE = NODE_CACHE / "models"  # champions downloaded from an object store
_EPSILON = 1e-12  # accuracies are ratios of counts: equal figures must compare equal


def check_fraction(name: str, value: float) -> None:
    """LaunchInputError unless the input ``name`` is in [0, 1]."""
    if not 0.0 <= value <= 1.0:
        raise LaunchInputError(f"input {name}={value} is invalid: it is a fraction of the test split "
                               "(an accuracy), so it must be in [0, 1]")


def decide(challenger: float, threshold: float, champion: float | None, tolerance: float) -> tuple[bool, str]:
    """(promoted, reason): the challenger must reach ``threshold`` and be at least ``champion - tolerance``
    (no champion: the first promotion). The reason names both accuracies."""
    check_fraction("threshold", threshold)
    check_fraction("tolerance", tolerance)
    if champion is None:
        figures = f"challenger test accuracy {challenger:.4f}, no champion in service"
    else:
        figures = (f"challenger test accuracy {challenger:.4f} vs champion {champion:.4f} on the same test "
                   f"split (tolerance {tolerance:.4f})")
    if challenger < threshold - _EPSILON:
        return False, f"{figures}: the challenger is below the threshold {threshold:.4f}"
    if champion is not None and champion - challenger > tolerance + _EPSILON:
        return False, (f"{figures}: the challenger is worse than the champion by "
                       f"{champion - challenger:.4f}, more than the tolerance")
    if champion is None:
        return True, f"{figures}: the challenger reaches the threshold {threshold:.4f}"
    return True, (f"{figures}: the challenger reaches the threshold {threshold:.4f} and is not worse than "
                  "the champion by more than the tolerance")


def _difference(what: str, champion: list, challenger: list) -> str:
    """"" when equal, else what differs, for the refusal message."""
    if champion == challenger:
        return ""
    text = f"the champion's {what} is {champion}, the new data's (and the challenger's) is {challenger}"
    if what != "class list":
        return text
    new = sorted(set(map(str, challenger)) - set(map(str, champion)))
    gone = sorted(set(map(str, champion)) - set(map(str, challenger)))
    return text + (f" (new: {new or 'none'}, gone: {gone or 'none'})" if new or gone
                   else " (the same classes in another order)")


def comparison_problem(champion: Champion, dataset: StagedDataset, by_hand: str) -> str:
    """Why ``champion`` cannot be evaluated on ``dataset``'s test split ("" when it can), and what to do
    (``by_hand``: the command that publishes the challenger)."""
    # Also proves the champion's sha256. It is a version of this pipeline's own registry: trusted.
    _, config = load_exported(champion.directory / WEIGHTS_FILE, trust_model=True)
    differences = [text for text in (
        _difference("class list", list(config["classes"]), list(dataset.classes)),
        _difference("input shape (C, H, W)", list(config["shape"]), list(dataset.shape))) if text]
    if not differences:
        return ""
    return (f"refused: the champion {champion.origin} cannot be evaluated on the new test split: "
            f"{'; '.join(differences)}. Nothing was promoted. If the change is intended, review the "
            f"challenger and publish it by hand: {by_hand}")


def filesystem(location: str) -> fsspec.AbstractFileSystem:
    """The filesystem flytekit configured for ``location`` (object-store credentials included)."""
    return FlyteContextManager.current_context().file_access.get_filesystem_for_path(location)


def check_promoted_uri(promoted_uri: str, local_run: bool) -> None:
    """An object-store prefix must name a store; a local path is durable only in a local run, and there must
    be a directory this process can write (created if missing), so that a mistyped registry fails now, not
    after training."""
    if is_uri(promoted_uri):
        check_protocol(promoted_uri, f"input promoted_uri={promoted_uri!r}", writable=True)
    elif not promoted_uri:
        raise LaunchInputError("input promoted_uri is empty: give the registry's directory or object-store "
                               "prefix, e.g. s3://bucket/models/digits")
    elif not local_run:
        raise LaunchInputError(f"input promoted_uri={promoted_uri!r} is a local path, which a pod loses when "
                               "it ends: give an object-store prefix, e.g. s3://bucket/models/digits")
    else:
        try:
            ensure_writable_dir(local_path(promoted_uri), "registry directory", "promoted_uri")
        except OutputError as exc:
            raise LaunchInputError(f"input promoted_uri={promoted_uri!r}: {exc}") from exc


def _is_local_run() -> bool:
    return FlyteContextManager.current_context().execution_state.is_local_execution()


def check_champion(champion: str | None, local_run: bool) -> None:
    """A champion URI must have a known scheme; a local one, in a local run, must hold an exported model."""
    if not champion:
        return
    if is_uri(champion):
        check_protocol(champion, f"input champion={champion!r}")
        return
    path = local_path(champion).expanduser()
    weights = path if path.name == WEIGHTS_FILE else path / WEIGHTS_FILE
    if not local_run:
        return
    if not weights.is_file():
        raise LaunchInputError(f"input champion={champion!r} holds no {WEIGHTS_FILE}: give an export "
                               "directory or a registry version directory, or leave champion empty to use "
                               "the registry's latest")
    try:
        check_exported(weights)
    except ExportError as exc:
        raise LaunchInputError(f"input champion={champion!r}: {exc}") from exc


@task
def check_promotion(threshold: float, tolerance: float, champion: str | None, promoted_uri: str) -> None:
    """The promotion inputs, checked before anything trains: bad ones fail in seconds, not after training."""
    check_fraction("threshold", threshold)
    check_fraction("tolerance", tolerance)
    check_champion(champion, _is_local_run())
    check_promoted_uri(promoted_uri, _is_local_run())


@task
def warm_start_overrides(config_overrides: str, warm_start: bool, champion: str | None,
                         promoted_uri: str) -> str:
    """``config_overrides`` with model.init_from set to the model in service (the ``champion`` input, else
    the registry's latest version) when ``warm_start``; unchanged without it, or when the registry has no
    version yet (the first run trains from scratch and says so). Every tensor loads, the head with the rest:
    the classes must be the champion's (a changed class list is refused with the tensor named)."""
    if not warm_start:
        return config_overrides
    try:
        overrides = json.loads(config_overrides) if config_overrides.strip() else {}
    except json.JSONDecodeError as exc:
        raise LaunchInputError(f"input config_overrides is not valid JSON ({exc})") from exc
    if not isinstance(overrides, dict):
        raise LaunchInputError("input config_overrides must be a JSON object")
    nested = overrides.get("model") if isinstance(overrides.get("model"), dict) else {}
    if overrides.get("model.init_from") or nested.get("init_from"):
        raise LaunchInputError("input warm_start=True starts from the model in service, and input "
                               "config_overrides sets model.init_from too: give one of them")
    if champion:
        weights = champion.rstrip("/")
        weights = weights if weights.endswith(f"/{WEIGHTS_FILE}") else f"{weights}/{WEIGHTS_FILE}"
    else:
        registry = Registry(promoted_uri, filesystem(promoted_uri))
        version = registry.latest()
        if version is None:
            print(f"warm_start: the registry {registry.uri} has no version yet: training from scratch",
                  flush=True)
            return config_overrides
        weights = f"{registry.root}/{version}/{WEIGHTS_FILE}"
    print(f"warm_start: model.init_from={weights}", flush=True)
    return json.dumps({**overrides, "model.init_from": weights})


def judge(report: EvalReport, champion: Champion | None, dataset: StagedDataset, threshold: float,
          tolerance: float, by_hand: str) -> tuple[bool, str, EvalReport | None]:
    """(promoted, reason, the champion's report on the challenger's test split, when it could be scored).
    ``by_hand`` is the command that publishes the challenger, for the refusal of an incomparable champion."""
    accuracy = report.result.accuracy
    if champion is None:
        return (*decide(accuracy, threshold, None, tolerance), None)
    problem = comparison_problem(champion, dataset, by_hand)
    if problem:
        return False, problem, None
    # The champion is a version this pipeline promoted into its own registry, so its factory is trusted.
    result = evaluate(champion.directory / WEIGHTS_FILE, dataset_location(dataset.directory), TEST_SPLIT,
                      trust_model=True)
    # The champion's lineage as published: its test figures there are those of its own, older split.
    scored = EvalReport(result=result, lineage=champion.lineage or Lineage())
    promoted, reason = decide(accuracy, threshold, result.accuracy, tolerance)
    if promoted and sha256_file(champion.directory / WEIGHTS_FILE) == report.lineage.model_sha256:
        # Unchanged data and config retrain bit for bit the same weights: a second version would add nothing.
        return False, (f"{reason}; but the challenger's weights are the champion's (sha256 "
                       f"{report.lineage.model_sha256[:12]}): nothing new to publish"), scored
    return promoted, reason, scored


# Input and output only: the default Dependencies field runs `pip freeze` on every execution (seconds).
@task(enable_deck=True, deck_fields=(DeckField.INPUT, DeckField.OUTPUT), retries=2,
      requests=Resources(cpu="2", mem="4Gi"))
def promotion_gate(model: ModelArtifact, report: EvalReport, dataset: StagedDataset, champion: str | None,
                   promoted_uri: str, threshold: float, tolerance: float) -> Promotion:
    """Evaluate the champion (the ``champion`` input, else the registry's latest, else none) on the
    challenger's test split, decide, publish the challenger on promotion and draw the Promotion Deck."""
    check_promoted_uri(promoted_uri, _is_local_run())
    if report.lineage.source_fingerprint != dataset.source_fingerprint:
        raise ValueError(f"the challenger was evaluated on data with fingerprint "
                         f"{report.lineage.source_fingerprint!r}, not on this dataset's "
                         f"{dataset.source_fingerprint!r}: evaluate both models on the same staged dataset")
    registry = Registry(promoted_uri, filesystem(promoted_uri))
    found = resolve_champion(champion, registry, MODEL_CACHE, filesystem(champion) if champion else None)
    by_hand = (f"python -m traincore.registry publish {promoted_uri} "
               f"{model.directory.remote_source or model.directory.path}")
    promoted, reason, scored = judge(report, found, dataset, threshold, tolerance, by_hand)
    version = (registry.publish(local_directory(model.directory), report.lineage, trust_model=True)
               if promoted else "")
    flytekit.Deck("Promotion", promotion_deck_html(
        report.result, scored.result if scored else None, reason, asdict(report.lineage),
        asdict(scored.lineage) if scored else None, promoted=promoted))
    verdict = f"PROMOTED as {registry.uri}/{version}" if promoted else "NOT PROMOTED"
    print(f"promotion_gate: {verdict}: {reason}", flush=True)
    return Promotion(promoted=promoted, reason=reason, threshold=threshold, tolerance=tolerance, model=model,
                     challenger=report, champion=scored, champion_origin=found.origin if found else "",
                     promoted_uri=promoted_uri, version=version)
