"""A checkpoint root holding ``step-*`` entries that are not checkpoints of ours.

Documented behaviour (traincore/checkpoint/layout.py): a torn save of ours (a step directory without a
marker holding only files a save writes, or nothing) is ignored by resume and deleted by pruning or by the
save of its step; anything else named ``step-*`` (a file, a name step_dir() does not write, a step
directory with other files) is ignored with a warning naming it and never deleted, and a save of a step
whose directory is such an entry is refused with an error naming it. A step directory with another
program's ``commit.json`` is refused when resume reaches it and is never pruned.
"""

from __future__ import annotations

import json
import logging

import pytest
from test_checkpoint import load, make_state, save_steps, train

from traincore.checkpoint import MARKER, Checkpointer, CheckpointError, complete_steps, step_dir
from traincore.checkpoint.layout import foreign_entries
from traincore.config.schema import CheckpointConfig

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
LOGGER = "traincore.checkpoint.checkpointer"


def junk_root(root):
    """Complete steps 2 and 4, a torn save of ours (step 3), an empty step 10 and foreign entries."""
    save_steps(root, "sync", [2, 4])
    (step_dir(root, 3)).mkdir()
    (step_dir(root, 3) / ".state.pt.tmp").write_bytes(b"half a state.pt")
    step_dir(root, 10).mkdir()
    foreign = {"file": root / "step-5", "name": root / "step-abc", "width": root / "step-0000007",
               "files": step_dir(root, 12), "file-named-as-ours": step_dir(root, 14)}
    (root / "step-5").write_text("a note\n")
    (root / "step-abc").mkdir()
    (root / "step-abc" / "model.bin").write_bytes(b"\0" * 64)
    (root / "step-0000007").mkdir()
    step_dir(root, 12).mkdir()
    (step_dir(root, 12) / "notes.txt").write_text("someone's notes\n")
    step_dir(root, 14).write_text("a file where a step directory would be\n")
    return foreign


def test_junk_is_ignored_with_a_warning_and_torn_saves_are_cleaned(tmp_path, caplog):
    foreign = junk_root(tmp_path)
    assert foreign_entries(tmp_path) == sorted(str(path) for path in foreign.values())
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert load(tmp_path) == 4
    for path in foreign.values():
        assert f"ignoring {path}: it is not a checkpoint of traincore" in caplog.text, path
    for ours in (step_dir(tmp_path, 3), step_dir(tmp_path, 10)):
        assert f"ignoring {ours}" not in caplog.text

    save_steps(tmp_path, "sync", [6, 10], keep_last=1)  # prunes 2, 4 and the torn 3; saves over the empty 10
    assert complete_steps(tmp_path) == [10]
    assert not step_dir(tmp_path, 3).exists()
    assert all(path.exists() for path in foreign.values())  # never deleted
    assert (step_dir(tmp_path, 12) / "notes.txt").read_text() == "someone's notes\n"
    assert load(tmp_path) == 10


@pytest.mark.parametrize("step", [12, 14])
def test_a_save_over_an_entry_that_is_not_ours_is_refused(tmp_path, step):
    foreign = junk_root(tmp_path)
    entry = step_dir(tmp_path, step)
    before = sorted(p.name for p in entry.iterdir()) if entry.is_dir() else entry.read_text()
    state = make_state()
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(mode="dcp"), state.registry)
    train(state, step)
    with pytest.raises(CheckpointError) as error:
        checkpointer.save(step)
    checkpointer.close()
    assert str(error.value) == (
        f"cannot save step {step}: {entry} exists and is not a checkpoint of traincore (another program's "
        f"file or directory), and it is never deleted: move it out of {tmp_path}, or choose another "
        "checkpoint root")
    assert (sorted(p.name for p in entry.iterdir()) if entry.is_dir() else entry.read_text()) == before
    assert complete_steps(tmp_path) == [2, 4] and all(path.exists() for path in foreign.values())


def test_a_foreign_commit_marker_is_never_pruned_and_refused_when_reached(tmp_path):
    theirs = step_dir(tmp_path, 1)
    theirs.mkdir(parents=True)
    (theirs / "model.bin").write_bytes(b"\1" * 64)
    (theirs / MARKER).write_text(json.dumps({"version": 1, "files": ["model.bin"]}))
    save_steps(tmp_path, "sync", [2, 4, 6], keep_last=1)
    assert complete_steps(tmp_path) == [1, 6]  # pruning deleted 2 and 4, not another program's directory
    assert (theirs / "model.bin").exists()
    assert load(tmp_path) == 6  # the latest is ours: the older directory is never read
    with pytest.raises(CheckpointError, match=f"{theirs / MARKER} is not a traincore commit marker"):
        load(tmp_path, step=1)


def test_maybe_save_says_whether_it_began_a_save(tmp_path):
    state = make_state()
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(mode="sync", every=2), state.registry)
    began = []
    for step in range(1, 6):
        train(state, 1)
        began.append(checkpointer.maybe_save(step, last_step=step == 5))
    checkpointer.close()
    assert began == [False, True, False, True, True]
    assert complete_steps(tmp_path) == [2, 4, 5]
