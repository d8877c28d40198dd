"""Telemetry: metrics read back with their own readers, real 2-process gloo, FLOPs and peak lookup."""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import start_ranks
from torch import nn

from traincore.config.schema import TelemetryConfig
from traincore.run.dist import DistContext
from traincore.telemetry import metrics
from traincore.telemetry.metrics import memory_metrics, peak_flops, training_flops_per_sample
from traincore.telemetry.reporting import Telemetry, Workload, logging_setup

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    """Keep the root logger and the warn-once memory per test, with no ambient W&B key or peak override."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    monkeypatch.setattr(metrics, "_warned_devices", set())
    for name in ("WANDB_API_KEY", "WANDB_API_KEY_FILE", metrics.PEAK_FLOPS_ENV):
        monkeypatch.delenv(name, raising=False)
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def make_telemetry(output: Path, total_steps: int = 5, **overrides) -> Telemetry:
    cfg = TelemetryConfig(**{"log_every": 2, "progress": "off", "tensorboard": False, **overrides})
    return Telemetry(cfg, output, DistContext(0, 1, device=CPU), Workload(total_steps, 8, None),
                     {"model": {"name": "mlp"}})


def run_steps(telemetry: Telemetry, losses: list[float]) -> list[dict[str, float] | None]:
    results = []
    for step, loss in enumerate(losses, start=1):
        with telemetry.data_wait():
            pass
        results.append(telemetry.step_done(step, torch.tensor(loss), lr=1e-3))
    return results


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_logging_setup_nests_is_quiet_on_other_ranks_and_restores_the_root_logger(capsys):
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    with logging_setup("INFO", rank=1), logging_setup("INFO", rank=1):
        assert [h.get_name() for h in root.handlers].count("traincore") == 1
        assert root.level == logging.WARNING
        logging.getLogger("traincore.x").info("hidden")
        logging.getLogger("traincore.x").warning("shown")
    assert root.handlers == handlers and root.level == level
    err = capsys.readouterr().err
    assert "hidden" not in err and "WARNING [rank 1] traincore.x: shown" in err
    with pytest.raises(ValueError, match="'LOUD'"), logging_setup("LOUD"):
        pass


def _log_a_failure(name: str) -> None:
    try:
        raise ConnectionError("Cannot connect to host storage.googleapis.com:443")
    except ConnectionError:
        logging.getLogger(name).exception("_request out of retries on exception")


def test_a_command_shows_other_libraries_errors_without_their_tracebacks(capsys):
    """A library's logged exception is its message and class on one line; ours keeps its traceback; a
    command that is no rank of a run leaves the rank out."""
    with logging_setup("WARNING", rank=None, library_tracebacks=False):
        _log_a_failure("gcsfs")
        _log_a_failure("traincore.x")
    err = capsys.readouterr().err
    assert ("ERROR gcsfs: _request out of retries on exception [ConnectionError; traceback not shown]\n"
            in err), err
    assert err.count("Traceback") == 1 and "ERROR traincore.x: _request out of retries" in err, err
    assert "[rank" not in err
    with logging_setup("WARNING"):  # a run's own setup: every traceback, as before
        _log_a_failure("gcsfs")
    err = capsys.readouterr().err
    assert "Traceback" in err and "WARNING" not in err and "ERROR [rank 0] gcsfs" in err


def test_jsonl_and_tensorboard_read_back(tmp_path):
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    with make_telemetry(tmp_path, tensorboard=True) as telemetry:
        results = run_steps(telemetry, [1.0, 2.0, 3.0, 4.0, 5.0])
        telemetry.log_eval(5, {"accuracy": 0.75, "loss": torch.tensor(0.5)})
    assert [r is not None for r in results] == [False, True, False, True, True]  # every 2 and the last

    records = read_jsonl(tmp_path / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [(r["step"], r["loss"]) for r in train] == [(2, 1.5), (4, 3.5), (5, 5.0)]
    assert train[0]["lr"] == pytest.approx(1e-3) and train[0]["samples_per_s"] > 0
    assert records[-1]["kind"] == "eval" and records[-1]["accuracy"] == 0.75 and records[-1]["loss"] == 0.5

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    loss = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events.Tensors("train/loss")]
    assert loss == [(2, 1.5), (4, 3.5), (5, 5.0)]
    accuracy = events.Tensors("eval/accuracy")
    assert [e.step for e in accuracy] == [5]
    assert float(tensor_util.make_ndarray(accuracy[0].tensor_proto)) == pytest.approx(0.75)


def test_plain_log_line_per_interval(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    with make_telemetry(tmp_path, total_steps=4) as telemetry:
        run_steps(telemetry, [0.5, 0.5, 0.25, 0.25])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == 2
    assert lines[1].startswith("step 4/4 | loss 0.2500 | lr 1.0e-03 | ") and "| mfu n/a | rss " in lines[1]


def test_wandb_online_without_a_key_fails_before_anything_is_written(tmp_path):
    for rank in (0, 1):
        with pytest.raises(ValueError, match="wandb_mode='online' needs a W&B API key"):
            Telemetry(TelemetryConfig(wandb_mode="online"), tmp_path / "out",
                      DistContext(rank, 2, device=CPU), Workload(10, 8, None), {})
    assert not (tmp_path / "out").exists()


def _two_rank_worker(rank: int, tmp: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    try:
        cfg = TelemetryConfig(log_every=2, progress="off", tensorboard=True)
        telemetry = Telemetry(cfg, Path(tmp) / f"rank{rank}", DistContext(rank, 2, device=CPU),
                              Workload(4, 16, 1e6), {})
        for step in range(1, 5):
            with telemetry.data_wait():
                pass
            metrics_ = telemetry.step_done(step, torch.tensor(float(step * (rank + 1))), lr=0.1)
            assert (metrics_ is not None) == (rank == 0 and step % 2 == 0), (rank, step, metrics_)
        telemetry.log_eval(4, {"accuracy": 0.5})
        assert telemetry.summary()["final_loss"] == pytest.approx((3 + 4 + 6 + 8) / 4)
        telemetry.close()
    finally:
        dist.destroy_process_group()


def test_two_ranks_only_rank0_writes_and_loss_is_the_global_mean(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"rank{rank}").mkdir()
    start_ranks(_two_rank_worker, (str(tmp_path),), nprocs=2)
    assert list((tmp_path / "rank1").iterdir()) == []
    records = read_jsonl(tmp_path / "rank0" / "metrics.jsonl")
    # rank r logs loss step * (r + 1): steps 1-2 give (1 + 2 + 2 + 4) / 4, steps 3-4 (3 + 4 + 6 + 8) / 4
    assert [(r["step"], r["kind"], r.get("loss")) for r in records] == [
        (2, "train", 2.25), (4, "train", 5.25), (4, "eval", None)]
    assert (tmp_path / "rank0" / "tensorboard").is_dir()


def test_data_wait_share_with_a_slow_iterator(tmp_path):
    pause = 0.03

    def slow_batches():
        while True:
            time.sleep(pause)
            yield torch.ones(1)

    batches = slow_batches()
    with make_telemetry(tmp_path, total_steps=6, log_every=3) as telemetry:
        results = []
        for step in range(1, 7):
            with telemetry.data_wait():
                next(batches)
            time.sleep(pause)  # compute as long as the wait
            results.append(telemetry.step_done(step, torch.tensor(1.0), lr=0.1))
        summary = telemetry.summary()
    last = results[-1]
    assert 0.3 < last["data_wait_share"] < 0.95
    assert last["data_wait_s"] >= pause and last["step_time_s"] >= 2 * pause
    assert 0 < last["samples_per_s"] <= 8 / (2 * pause)
    assert 0.3 < summary["data_wait_share"] < 0.95 and summary["steps"] == 6


def test_mfu_uses_the_peak_override(tmp_path, monkeypatch):
    monkeypatch.setenv(metrics.PEAK_FLOPS_ENV, "2e9")
    cfg = TelemetryConfig(log_every=1, progress="off", tensorboard=False)
    with Telemetry(cfg, tmp_path, DistContext(0, 2, device=CPU), Workload(1, 8, 1e6), {}) as telemetry:
        result = run_steps(telemetry, [1.0])[0]
    assert result["mfu"] == pytest.approx(1e6 * result["samples_per_s"] / (2e9 * 2))


def test_summary_state_survives_a_resume(tmp_path):
    with make_telemetry(tmp_path / "a", total_steps=4) as first:
        run_steps(first, [1.0, 1.0, 1.0, 1.0])
        state = first.state_dict()
    with make_telemetry(tmp_path / "b", total_steps=4) as resumed:
        resumed.load_state_dict(state)
        resumed.close()
        resumed.close()  # idempotent
        assert resumed.summary()["steps"] == 4 and resumed.summary()["final_loss"] == 1.0
    with pytest.raises(ValueError, match="unknown keys"):
        resumed.load_state_dict({**state, "bogus": 1.0})


def test_flops_of_a_linear_layer_follow_the_documented_convention():
    # 2 FLOPs per multiply-accumulate, bias adds not counted, backward = 2x forward
    assert training_flops_per_sample(nn.Linear(100, 10), (1, 1, 100)) == 3 * 2 * 100 * 10


def test_flops_of_a_conv_net_leave_the_model_untouched():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.Flatten(),
                          nn.Linear(4 * 8 * 8, 5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    conv_macs, linear_macs = 4 * 3 * 9 * 8 * 8, 4 * 8 * 8 * 5
    assert training_flops_per_sample(model, (3, 8, 8)) == 3 * 2 * (conv_macs + linear_macs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_peak_flops_cpu_is_none_with_one_warning(caplog):
    caplog.set_level(logging.WARNING)
    assert peak_flops(CPU) is None
    assert peak_flops(CPU) is None
    warnings = [r.getMessage() for r in caplog.records if "'cpu'" in r.getMessage()]
    assert len(warnings) == 1 and metrics.PEAK_FLOPS_ENV in warnings[0]


@pytest.mark.parametrize("name, dtype, expected", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.5e12),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756.5e12),
    ("NVIDIA H200", torch.bfloat16, 989.5e12),
    ("NVIDIA A100-SXM4-80GB", torch.float16, 312e12),
    ("NVIDIA L4", torch.bfloat16, 121e12),
    ("NVIDIA L40S", torch.bfloat16, 362.05e12),
    ("Tesla V100-SXM2-16GB", torch.float16, 125e12),
    ("Tesla V100-SXM2-16GB", torch.bfloat16, None),  # no bf16 tensor cores
    ("NVIDIA A10G", torch.bfloat16, None),  # no datasheet figure; never the A10's
    ("NVIDIA Imaginary X1", torch.bfloat16, None),
])
def test_peak_flops_table_by_device_name(monkeypatch, caplog, name, dtype, expected):
    caplog.set_level(logging.WARNING)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda"), dtype) == expected
    warned = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(warned) == (expected is None)


def test_peak_flops_override(monkeypatch):
    monkeypatch.setenv(metrics.PEAK_FLOPS_ENV, "123.5e12")
    assert peak_flops(CPU) == 123.5e12
    monkeypatch.setenv(metrics.PEAK_FLOPS_ENV, "fast")
    with pytest.raises(ValueError, match="TRAINCORE_PEAK_FLOPS='fast'"):
        peak_flops(CPU)


def test_memory_metrics_on_cpu_report_host_rss_only():
    figures = memory_metrics(CPU)
    assert set(figures) == {"host_rss_gib"}
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    assert 0.01 < figures["host_rss_gib"] <= peak_gib * 1.01


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_interval_reports_allocator_peaks(tmp_path):
    device = torch.device("cuda")
    cfg = TelemetryConfig(log_every=1, progress="off", tensorboard=False)
    with Telemetry(cfg, tmp_path, DistContext(0, 1, device=device), Workload(2, 8, 1e9, torch.bfloat16),
                   {}) as telemetry:
        block = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
        first = telemetry.step_done(1, torch.tensor(1.0, device=device), lr=0.1)
        del block
        second = telemetry.step_done(2, torch.tensor(1.0, device=device), lr=0.1)
    assert first["cuda_max_allocated_gib"] >= 0.25 > second["cuda_max_allocated_gib"]  # reset per interval
    assert first["cuda_max_reserved_gib"] >= first["cuda_max_allocated_gib"] and first["cuda_ooms"] == 0


def test_resumed_at_drops_the_later_steps_of_an_earlier_attempt(tmp_path):
    with make_telemetry(tmp_path, total_steps=6, log_every=1) as killed:
        killed.resumed_at(0)
        run_steps(killed, [1.0, 2.0, 3.0, 4.0])  # checkpointed at step 2, then killed
    with make_telemetry(tmp_path, total_steps=6, log_every=1) as resumed:
        resumed.resumed_at(2)
        for step, loss in ((3, 30.0), (4, 40.0), (5, 50.0), (6, 60.0)):
            resumed.step_done(step, torch.tensor(loss), lr=1e-3)
    assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [
        (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0), (6, 60.0)]


def test_resumed_at_is_a_no_op_on_other_ranks(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 9, "time": 0, "kind": "train"}\n')
    cfg = TelemetryConfig(log_every=1, progress="off", tensorboard=False)
    with Telemetry(cfg, tmp_path, DistContext(1, 2, device=CPU), Workload(10, 8, None), {}) as telemetry:
        telemetry.resumed_at(3)
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 9, "time": 0, "kind": "train"}]
