"""TensorBoard event files, written here: Event protos in TFRecord framing, each flushed as it is added.

tensorboard's own writer (``tensorboard.summary.writer``) imports its filesystem layer, and with it boto3
where boto3 is installed: about a quarter of a second of every run's start-up here, for a file of a few
records per minute. The format is small: each record is its length (little-endian uint64), the masked
CRC-32C of those 8 bytes, the serialized Event, and the masked CRC-32C of the Event
(https://www.tensorflow.org/tutorials/load_data/tfrecord#tfrecords_format_details). TensorBoard's reader
checks both checksums, so a file it loads is a file written right.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from pathlib import Path

from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2

_CRC32C_POLY = 0x82F63B78  # Castagnoli, reversed
_MASK_DELTA = 0xA282EAD8
_files = itertools.count()  # tells apart event files one process opens within one second
# Marks a value as a scalar, as SummaryWriter.add_scalar(new_style=True) does.
_SCALAR = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (_CRC32C_POLY if crc & 1 else 0)
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """CRC-32C of ``data``, masked as TFRecord stores it (a CRC of data holding CRCs is weak unmasked)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """``data`` framed as one TFRecord."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


class EventFile:
    """A new ``events.out.tfevents.*`` file in ``directory``, starting with TensorBoard's file-version event.

    With ``purge_step`` S it then holds the session start ``SummaryWriter(purge_step=S)`` writes:
    TensorBoard hides the events of step S and later that earlier files of the directory hold (a killed
    attempt's).

    Every event is written and flushed as it is added, as metrics.jsonl is: a killed run's file holds all
    it logged, and at one event per logging interval the flush costs microseconds.
    """

    def __init__(self, directory: str | Path, purge_step: int | None = None) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.{next(_files)}"
        self.path = directory / name
        self._file = open(self.path, "xb")
        self._add(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:
            self._add(event_pb2.Event(step=purge_step, file_version="brain.Event:2"))
            self._add(event_pb2.Event(step=purge_step,
                                      session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))

    def add_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """One event holding every ``tag: value`` of ``scalars`` at ``step``."""
        values = [summary_pb2.Summary.Value(tag=tag, metadata=_SCALAR, tensor=tensor_pb2.TensorProto(
            float_val=[float(value)], dtype="DT_FLOAT")) for tag, value in scalars.items()]
        summary = summary_pb2.Summary(value=values)
        self._add(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def _add(self, event: event_pb2.Event) -> None:
        self._file.write(record(event.SerializeToString()))
        self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._file.close()
