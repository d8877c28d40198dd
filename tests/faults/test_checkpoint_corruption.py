"""Damaged and foreign checkpoints: detected, named, and answered as the checkpointer documents.

Every case damages a copy of a root holding complete checkpoints of steps 2 and 4 (sync and dcp):

* a file of step 4 truncated, bit-flipped, replaced by junk or emptied (state.pt, extra.pt, a .distcp,
  .metadata, commit.json: junk bytes, truncated JSON, wrong types): resuming the latest warns naming the
  file and FALLS BACK to step 2 (bitwise what was saved); asking for step 4 by number is a CheckpointError
  naming the file;
* a file that passes verification but cannot be read (random bytes or the wrong object, with a forged
  valid marker): an error naming the file, not torch's or pickle's message;
* a directory another program wrote (random files without a marker, or a commit.json of another format):
  refused with a message saying so.
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import shutil
import time
from pathlib import Path

import pytest
import torch
from faultlib import TinyRun

from traincore.checkpoint import (
    MARKER,
    Checkpointer,
    CheckpointError,
    CorruptCheckpointError,
    complete_steps,
    step_dir,
    verify_checkpoint,
)
from traincore.checkpoint.commit import write_marker
from traincore.checkpoint.format import read_checkpoint
from traincore.config.schema import CheckpointConfig

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# Messages that name no file or leak a reader's internals: never what a user sees.
UNCLEAR = ("UnicodeDecodeError", "codec can't decode", "mmap can only be used", "Expecting value",
           "PytorchStreamReader", "invalid load key", "Ran out of input")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict:
    """Per mode: a root with complete steps 2 and 4, and the state digests saved at each."""
    roots = {}
    for mode in ("sync", "dcp"):
        root = tmp_path_factory.mktemp("pristine") / mode
        run = TinyRun(width=32)
        checkpointer = Checkpointer(root, CheckpointConfig(mode=mode, keep_last=5), run.registry)
        digests = {}
        for step in (2, 4):
            while run.step < step:
                run.train_step()
            digests[step] = run.digests()
            checkpointer.save(step)
        checkpointer.close()
        roots[mode] = (root, digests)
    return roots


def damaged_root(pristine: dict, mode: str, tmp_path: Path) -> tuple[Path, dict]:
    source, digests = pristine[mode]
    return Path(shutil.copytree(source, tmp_path / mode)), digests


def load(root: Path, mode: str, step: int | None = None, verify: bool = True) -> tuple[int | None, TinyRun]:
    run = TinyRun(width=32, seed=9)
    checkpointer = Checkpointer(root, CheckpointConfig(mode=mode, verify_on_load=verify), run.registry)
    try:
        return checkpointer.load(step), run
    finally:
        checkpointer.close()


def assert_names(error: BaseException, path: Path) -> None:
    message = str(error)
    assert str(path) in message, message
    assert not any(phrase in message for phrase in UNCLEAR), message
    assert ": " in message and ("resume from another step" in message or "pass a step directory" in message
                                or "fresh checkpoint root" in message), message  # the fix is named


def flip_bit(data: bytes) -> bytes:
    damaged = bytearray(data)
    damaged[len(damaged) // 2] ^= 0x10
    return bytes(damaged)


DAMAGE = {
    "truncated": lambda data: data[: len(data) // 2],
    "bit-flipped": flip_bit,
    "junk": lambda data: random.Random(len(data)).randbytes(len(data)),
    "empty": lambda data: b"",
}


def marker_damage(kind: str, text: str) -> bytes:
    """A damaged commit.json: junk bytes, truncated JSON or a field of the wrong type."""
    if kind == "junk-bytes":
        return b"\xff\xfe\x00\x9c" + random.Random(0).randbytes(200)
    if kind == "truncated-json":
        return text[: len(text) // 2].encode()
    if kind == "empty":
        return b""
    marker = json.loads(text)
    if kind == "files-a-list":
        marker["files"] = list(marker["files"])
    elif kind == "bytes-a-string":
        next(iter(marker["files"].values()))["bytes"] = "lots"
    elif kind == "step-a-string":
        marker["step"] = "four"
    elif kind == "crc-not-hex":
        next(iter(marker["files"].values()))["crc32"] = "not-a-crc"
    elif kind == "data-file-unlisted":
        marker["files"] = {}
    elif kind == "no-format-version":
        del marker["format_version"]
    return json.dumps(marker).encode()


FILE_CASES = [("sync", "state.pt", damage) for damage in DAMAGE] + [
    ("dcp", "extra.pt", "truncated"), ("dcp", "extra.pt", "bit-flipped"),
    ("dcp", "__0_0.distcp", "truncated"), ("dcp", "__0_0.distcp", "bit-flipped"),
    ("dcp", ".metadata", "truncated"), ("dcp", ".metadata", "junk")]
MARKER_CASES = [("sync", MARKER, "junk-bytes"), ("dcp", MARKER, "junk-bytes"),
                ("sync", MARKER, "truncated-json"), ("dcp", MARKER, "empty"), ("dcp", MARKER, "files-a-list"),
                ("sync", MARKER, "bytes-a-string"), ("sync", MARKER, "step-a-string"),
                ("dcp", MARKER, "crc-not-hex"), ("sync", MARKER, "data-file-unlisted"),
                ("dcp", MARKER, "no-format-version")]


@pytest.mark.parametrize("mode, name, damage", FILE_CASES + MARKER_CASES,
                         ids=[f"{m}-{n}-{d}" for m, n, d in FILE_CASES + MARKER_CASES])
def test_damaged_latest_falls_back_and_the_named_step_fails(pristine, tmp_path, caplog, mode, name, damage):
    root, digests = damaged_root(pristine, mode, tmp_path)
    path = step_dir(root, 4) / name
    data = path.read_bytes()
    path.write_bytes(marker_damage(damage, data.decode()) if name == MARKER else DAMAGE[damage](data))
    assert path.read_bytes() != data
    start = time.perf_counter()

    with pytest.raises(CorruptCheckpointError) as named:
        verify_checkpoint(step_dir(root, 4))
    assert_names(named.value, path)

    caplog.set_level(logging.WARNING, logger="traincore.checkpoint.checkpointer")
    resumed, run = load(root, mode)
    assert resumed == 2  # the previous complete step, bitwise as saved
    assert run.digests() == digests[2]
    warnings = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0], warnings

    with pytest.raises(CheckpointError) as asked:
        load(root, mode, step=4)
    assert_names(asked.value, path)
    assert complete_steps(root) == [2, 4]  # loading deletes nothing
    print(f"[corrupt] {mode} {name} {damage}: detected, fell back to step 2, named step fails "
          f"({time.perf_counter() - start:.2f} s): {str(asked.value)[:120]}...")


def forge(path: Path, content: bytes) -> None:
    """Replace a file of a complete checkpoint and write a marker that vouches for the new content."""
    path.write_bytes(content)
    directory = path.parent
    marker = json.loads((directory / MARKER).read_text())
    write_marker(directory, marker["step"], marker["mode"], marker["world_size"], {})
    verify_checkpoint(directory)  # the forged marker is valid


def torch_saved(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


FORGED = [
    ("sync", "state.pt", "random bytes", lambda data: random.Random(1).randbytes(len(data))),
    ("sync", "state.pt", "a list", lambda data: torch_saved([1, 2, 3])),
    ("sync", "state.pt", "a dict without shared", lambda data: torch_saved({"step": 4, "per_rank": []})),
    ("dcp", "extra.pt", "random bytes", lambda data: random.Random(2).randbytes(len(data))),
    ("dcp", ".metadata", "random bytes", lambda data: random.Random(3).randbytes(len(data))),
    ("dcp", ".metadata", "a pickled list", lambda data: pickle.dumps([1, 2, 3])),
    ("dcp", "__0_0.distcp", "a truncated copy", lambda data: data[:64]),  # into the first tensor
]


@pytest.mark.parametrize("mode, name, what, make", FORGED, ids=[f"{f[0]}-{f[1]}-{f[2]}" for f in FORGED])
def test_unreadable_file_under_a_valid_marker_is_named(pristine, tmp_path, mode, name, what, make):
    root, _ = damaged_root(pristine, mode, tmp_path)
    path = step_dir(root, 4) / name
    forge(path, make(path.read_bytes()))
    # DCP's error names no file of its own: the message names the step directory and the DCP files
    named = path if not name.endswith(".distcp") else step_dir(root, 4)
    for step in (4, None):  # asked for by number, and as the latest
        with pytest.raises(CheckpointError) as error:
            load(root, mode, step=step)
        assert_names(error.value, named)
    with pytest.raises(CheckpointError) as exported:  # the path export takes
        read_checkpoint(step_dir(root, 4))
    assert_names(exported.value, named)
    assert resumable(root, mode, 2)
    print(f"[corrupt] {mode} {name} = {what} under a forged marker: {str(error.value)[:140]}...")


def resumable(root: Path, mode: str, step: int) -> bool:
    return load(root, mode, step=step)[0] == step


@pytest.mark.parametrize("mode, name", [("sync", "state.pt"), ("dcp", "extra.pt"), ("dcp", "__0_0.distcp")])
def test_truncated_file_without_verification_is_named(pristine, tmp_path, mode, name):
    root, _ = damaged_root(pristine, mode, tmp_path)
    path = step_dir(root, 4) / name
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError) as error:
        load(root, mode, step=4, verify=False)
    assert_names(error.value, path if not name.endswith(".distcp") else step_dir(root, 4))


FOREIGN_MARKERS = {
    "another format": {"version": 1, "files": ["model.bin"], "created_by": "other-trainer"},
    "a JSON list": ["model.bin", "optimizer.bin"],
    "a JSON string": "committed",
}


@pytest.mark.parametrize("kind", list(FOREIGN_MARKERS))
def test_directory_with_a_foreign_marker_is_refused(pristine, tmp_path, kind):
    root, _ = damaged_root(pristine, "sync", tmp_path)
    foreign = step_dir(root, 9)
    foreign.mkdir()
    (foreign / "model.bin").write_bytes(random.Random(4).randbytes(1000))
    (foreign / MARKER).write_text(json.dumps(FOREIGN_MARKERS[kind]))
    for step in (None, 9):  # refused as the latest too: another program's output is no damage to fall past
        with pytest.raises(CheckpointError, match="is not a traincore commit marker") as error:
            load(root, "sync", step=step)
        assert_names(error.value, foreign / MARKER)
    with pytest.raises(CheckpointError, match="is not a traincore commit marker"):
        read_checkpoint(foreign)
    assert resumable(root, "sync", 4)


def test_directory_without_a_marker_is_refused(pristine, tmp_path):
    root, _ = damaged_root(pristine, "dcp", tmp_path)
    foreign = step_dir(root, 9)
    foreign.mkdir()
    for name in ("weights.safetensors", "notes.txt", "__0_0.distcp"):
        (foreign / name).write_bytes(random.Random(name).randbytes(500))
    with pytest.raises(CheckpointError, match=r"no complete checkpoint for step 9 .*steps: \[2, 4\]"):
        load(root, "dcp", step=9)
    with pytest.raises(CheckpointError) as error:
        read_checkpoint(foreign)
    message = str(error.value)
    assert f"{foreign} has no {MARKER}" in message and "another program" in message, message
    assert "pass a step directory written by traincore.checkpoint.checkpointer" in message
    assert load(root, "dcp")[0] == 4  # the latest complete step; the unmarked directory is never read
