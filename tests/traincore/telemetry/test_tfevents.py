"""Our event files are what TensorBoard reads: checksums against tensorboard's own, files read back by its
loaders, several scalars in one event, and a file whose writer was killed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboards_crc
from tensorboard.util import tensor_util

from traincore.telemetry.sinks import TensorBoardSink
from traincore.telemetry.tfevents import EventFile, masked_crc32c


def test_crc32c_is_castagnolis_and_masked_as_tensorboard_masks_it():
    rotated = (masked_crc32c(b"123456789") - 0xA282EAD8) & 0xFFFFFFFF
    assert ((rotated << 15) | (rotated >> 17)) & 0xFFFFFFFF == 0xE3069283  # the CRC-32C check value
    for data in (b"", b"\x00" * 8, bytes(range(256)) * 3, b"train/loss"):
        assert masked_crc32c(data) == tensorboards_crc(data)


def test_a_file_is_read_back_by_tensorboards_loader(tmp_path):
    events = EventFile(tmp_path / "tb")
    sink = TensorBoardSink(tmp_path)
    sink.resumed_at(0)
    for step in (1, 2, 3):
        sink.log(step, {"loss": 1.0 / step, "lr": 0.5, "samples_per_s": 1e4 * step})
    sink.close()
    events.close()
    loaded = list(EventFileLoader(str(events.path)).Load())
    assert [event.file_version for event in loaded] == ["brain.Event:2"]
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    assert sorted(accumulator.Tags()["tensors"]) == ["train/loss", "train/lr", "train/samples_per_s"]
    points = {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
                    for e in accumulator.Tensors(tag)] for tag in ("train/loss", "train/samples_per_s")}
    assert points["train/loss"] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert points["train/samples_per_s"] == [(1, 1e4), (2, 2e4), (3, 3e4)]


KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    from traincore.telemetry.sinks import TensorBoardSink
    sink = TensorBoardSink(sys.argv[1])
    sink.resumed_at(0)
    for step in range(1, 6):
        sink.log(step, {"loss": float(step)})
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no interpreter exit
""")


def test_a_killed_writers_file_holds_every_point_it_logged(tmp_path):
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path)])
    assert killed.returncode == -9
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    assert [event.step for event in accumulator.Tensors("train/loss")] == [1, 2, 3, 4, 5]


def test_writing_events_leaves_tensorboards_writer_and_filesystem_layer_unimported(tmp_path):
    # They cost about a quarter of a second of start-up (boto3 comes with the filesystem layer).
    code = textwrap.dedent(f"""
        import json, sys
        from traincore.telemetry.sinks import TensorBoardSink
        sink = TensorBoardSink({str(tmp_path)!r})
        sink.log(1, {{"loss": 1.0}})
        sink.close()
        print(json.dumps([m for m in ("tensorboard.summary", "tensorboard.compat.tensorflow_stub", "boto3")
                          if m in sys.modules]))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
