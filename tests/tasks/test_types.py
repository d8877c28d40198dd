"""The Flyte types of the records our tasks pass (flytekit's own, each built once, and only for them), and
how the workflow's outputs print."""

from __future__ import annotations

import collections
from dataclasses import dataclass, replace

import pytest
from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.type_engine import DataclassTransformer, TypeEngine
from flytekit.types.directory import FlyteDirectory

from tasks.types import RECORDS, EvalReport, ModelArtifact, RecordTransformer, StagedDataset
from traincore.artifacts.evaluate import EvalResult
from traincore.artifacts.export import ExportResult
from traincore.artifacts.lineage import Lineage
from traincore.config.presets import preset
from traincore.config.schema import Config
from workflows.pipeline import training_pipeline


@pytest.mark.parametrize("record", RECORDS, ids=lambda record: record.__name__)
def test_each_record_keeps_flytekits_literal_type_built_once(record):
    assert isinstance(TypeEngine.get_transformer(record), RecordTransformer)
    literal_type = TypeEngine.to_literal_type(record)
    assert literal_type == DataclassTransformer().get_literal_type(record)
    # flytekit's union transformer sets the structure of the type it gets: the next caller's is intact
    TypeEngine.to_literal_type(record | None)
    assert TypeEngine.to_literal_type(record) == literal_type


def test_a_records_schema_is_built_once(monkeypatch):
    builds = []
    build = DataclassTransformer.get_literal_type
    monkeypatch.setattr(DataclassTransformer, "get_literal_type",
                        lambda self, t=None: builds.append(t) or build(self, t))
    transformer = RecordTransformer((EvalReport,))
    assert transformer.get_literal_type(EvalReport) == transformer.get_literal_type(EvalReport)
    assert builds.count(EvalReport) == 1  # (its nested records are the registered transformer's)


@pytest.mark.parametrize("kind", [Config, EvalReport], ids=lambda kind: kind.__name__)
def test_records_convert_as_flytekits_own_transformer_converts_them(kind):
    value = (preset("digits").with_overrides({"train": {"max_steps": 7}}) if kind is Config
             else pipeline_outputs("/m").report)  # a record of records, a nested dict and lists among them
    ctx = FlyteContextManager.current_context()
    literal_type = TypeEngine.to_literal_type(kind)
    literal = TypeEngine.to_literal(ctx, value, kind, literal_type)
    assert literal == DataclassTransformer().to_literal(ctx, value, kind, literal_type)
    assert TypeEngine.to_python_value(ctx, literal, kind) == value


def test_other_dataclasses_keep_the_default_transformer():
    @dataclass
    class TeamRecord:  # a team's own dataclass, next to ours in a workflow
        name: str
        scores: list[float]

    assert not isinstance(TypeEngine.get_transformer(TeamRecord), RecordTransformer)
    assert TypeEngine.to_literal_type(TeamRecord) == DataclassTransformer().get_literal_type(TeamRecord)


SHA = "41a04528d1f71723d364b6daa05f5fe3590f35ff76ae243f41a0096c30791ee1"
STAGED = "/home/me/.cache/flyte-torch-pipeline/staged/format2-a0929ab310870e0d"


def pipeline_outputs(model_dir: str) -> tuple:
    """training_pipeline's outputs as a local run returns them (flytekit's namedtuple of its output names),
    with the full digits config in both lineages and a 10-class confusion matrix."""
    lineage = Lineage(source="digits", source_fingerprint="digits:sha256:bb84ed4525b3bdd81142e6afe91f3165",
                      staging_format=2, data_config_hash="f" * 64, config_hash="9" * 64,
                      config=preset("digits").to_dict(), code_version="flyte-torch-pipeline 0.1.0",
                      execution_id="local/local/local", checkpoint_step=360, world_size=2,
                      metrics={"final_loss": 0.0712, "val_accuracy": 0.97}, model_sha256=SHA)
    export = ExportResult(path=f"{model_dir}/model.safetensors", config_path=f"{model_dir}/model.json",
                          sha256=SHA, num_bytes=380224, step=360, num_parameters=94186, lineage=lineage)
    classes = [str(k) for k in range(10)]
    result = EvalResult(split="test", accuracy=0.9444, loss=0.1871, count=180, classes=classes,
                        precision=[0.944] * 10, recall=[0.944] * 10,
                        confusion=[[17 if row == col else 1 for col in range(10)] for row in range(10)])
    tested = replace(lineage, test_accuracy=0.9444, test_count=180)
    dataset = StagedDataset(directory=FlyteDirectory(STAGED), source="digits",
                            source_fingerprint=lineage.source_fingerprint, classes=classes, shape=[1, 32, 32],
                            counts={"train": 1437, "val": 180, "test": 180}, format_version=2)
    names = list(training_pipeline.python_interface.outputs)
    output = collections.namedtuple(training_pipeline.python_interface.output_tuple_name, names)
    return output(model=ModelArtifact(directory=FlyteDirectory(model_dir), export=export),
                  report=EvalReport(result=result, lineage=tested), dataset=dataset)


def test_pipeline_outputs_print_as_a_few_lines_without_the_config():
    """What `pyflyte run` prints at the end of a local run (click.echo: str of flytekit's namedtuple)."""
    model_dir = "/tmp/flyteq3pw028_/user_space0p4s_5j1/model"
    printed = str(pipeline_outputs(model_dir))
    assert len(printed.splitlines()) <= 15, printed
    for part in (f"path     {model_dir}/model.safetensors", f"sha256   {SHA}", "step     360",
                 f"records  model.json and lineage.json in {model_dir}",
                 "test accuracy  0.9444 on 180 samples (loss 0.1871)",
                 f"model          sha256 {SHA[:12]}, step 360", f"directory  {STAGED}",
                 "digits: 10 classes of 1x32x32; train 1437, val 180, test 180 samples"):
        assert part in printed, (part, printed)
    for absent in ("optim", "adamw", "confusion", "[17, 1", "lineage=", "'0', '1'"):
        assert absent not in printed, (absent, printed)


def test_the_printed_form_changes_neither_equality_nor_the_flyte_values(tmp_path):
    outputs = pipeline_outputs(str(tmp_path / "model"))
    ctx = FlyteContextManager.current_context()
    for value in (outputs.report, outputs.model.export):
        literal = TypeEngine.to_literal(ctx, value, type(value), TypeEngine.to_literal_type(type(value)))
        assert TypeEngine.to_python_value(ctx, literal, type(value)) == value
    report = outputs.report
    assert report == replace(report) and report != replace(report, lineage=Lineage())
    # The records inside keep their generated reprs, every field shown.
    assert "confusion=" in repr(report.result) and "config=" in repr(outputs.model.export.lineage)
