"""What follows training: the exported model, its evaluation, its lineage and the registry of promoted
versions.

    export    a checkpoint -> one safetensors file + JSON config, verified before it is published
    guidance  what to tell a user who points a command at a checkpoint where an export is expected
    evaluate  an exported model on one split: accuracy, loss, per-class metrics, confusion matrix
    lineage   where an artifact came from: source fingerprint, config hash, code version, run, step
    registry  immutable version directories and a ``latest`` pointer written last; champion vs challenger

Other packages import from here, never from the modules.
"""

from traincore.artifacts.evaluate import EvalResult, evaluate, format_result
from traincore.artifacts.export import (
    WEIGHTS_FILE,
    ExportError,
    ExportResult,
    check_exported,
    export,
    load_exported,
)
from traincore.artifacts.lineage import LINEAGE_FILE, Lineage, metric_summary, with_test
from traincore.artifacts.registry import Champion, Registry, resolve_champion

__all__ = [
    "Champion", "check_exported", "EvalResult", "evaluate", "export", "ExportError", "ExportResult",
    "format_result", "Lineage",
    "LINEAGE_FILE", "load_exported", "metric_summary", "Registry", "resolve_champion", "WEIGHTS_FILE",
    "with_test",
]
