"""The staging CLI: a summary line and exit 0 on success, ``error:`` and exit 2 for bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

from traincore.data.cli import main
from traincore.data.manifest import Manifest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "traincore.stage", *args], capture_output=True, text=True,
                          timeout=120)


def test_stages_and_prints_a_summary(tmp_path):
    output = tmp_path / "data"
    result = run_cli("--source", "synthetic", "--samples", "60", "--classes", "3", "--image-size", "8",
                     "--samples-per-shard", "16", "--partitions", "2", "--output", str(output))
    assert result.returncode == 0, result.stderr
    expected = "staged synthetic: 3 classes, 3x8x8 uint8, train 48, val 6, test 6 samples"
    assert result.stdout.startswith(expected)
    assert f"-> {output} (" in result.stdout
    manifest = Manifest.load(output)
    assert manifest.splits["train"].count == 48 and len(manifest.splits["train"].shards) == 3
    assert manifest.source_fingerprint.startswith("synthetic:sha256:")
    assert f"samples, source {manifest.source_fingerprint} -> {output}" in result.stdout


def test_bad_source_exits_2_with_error(tmp_path):
    result = run_cli("--source", "mnist", "--output", str(tmp_path / "data"))
    assert result.returncode == 2
    assert result.stderr.startswith("error: data.source='mnist' is unknown")
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--source", "digits", "--image-size", "0"], "error: data.image_size=0"),
    (["--source", "synthetic", "--decode-workers", "-1"], "error: data.decode_workers=-1"),
    (["--source", "synthetic", "--partitions", "-1"], "error: partitions=-1: give a whole number >= 1"),
    (["--source", "imagefolder:/does/not/exist"],
     "error: imagefolder location '/does/not/exist' does not exist"),
])
def test_bad_input_returns_2(args, message, tmp_path, capsys):
    assert main([*args, "--output", str(tmp_path / "data")]) == 2
    assert capsys.readouterr().err.startswith(message)


def test_existing_different_staging_needs_overwrite(tmp_path, capsys):
    common = ["--source", "synthetic", "--samples", "40", "--image-size", "4",
              "--output", str(tmp_path / "d")]
    assert main(common) == 0
    assert main([*common, "--seed", "1"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main([*common, "--seed", "1", "--overwrite"]) == 0
    assert Manifest.load(tmp_path / "d").seed == 1


def test_overwrite_replaces_only_a_staging_never_other_files(tmp_path, capsys, monkeypatch):
    """--overwrite once replaced any directory (and a file) with the staging, and the refusal without it
    suggested --overwrite; an empty --output meant the current directory."""
    own = tmp_path / "own"
    own.mkdir()
    (own / "notes.txt").write_text("precious")
    (tmp_path / "afile").write_text("x")
    common = ["--source", "synthetic", "--samples", "40", "--image-size", "4"]
    for output, what in ((own, "a directory of other files"), (tmp_path / "afile", "a file")):
        for overwrite in ([], ["--overwrite"]):
            assert main([*common, "--output", str(output), *overwrite]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"error: {output} is {what}, not a staging (no manifest.json): staging "
                                  "there would replace it; choose a new or empty --output (--overwrite "
                                  "replaces only an earlier staging)"), err
    assert (own / "notes.txt").read_text() == "precious" and (tmp_path / "afile").read_text() == "x"
    monkeypatch.chdir(own)
    with pytest.raises(SystemExit) as exited:
        main([*common, "--output", "", "--overwrite"])
    assert exited.value.code == 2
    assert "argument --output: is empty: give a path or URI" in capsys.readouterr().err
    assert sorted(path.name for path in own.iterdir()) == ["notes.txt"]
    assert main([*common, "--output", str(tmp_path / "empty")]) == 0  # absent, or empty: staged


def test_a_grown_imagefolder_is_staged_again_in_place(image_folder_factory, tmp_path, capsys):
    root = image_folder_factory(per_class=3, classes=2)
    output = tmp_path / "d"
    common = ["--source", f"imagefolder:{root}", "--image-size", "8", "--decode-workers", "1",
              "--output", str(output)]
    assert main(common) == 0
    first = Manifest.load(output)
    (root / "class_1" / "copy.jpg").write_bytes((root / "class_1" / "img_000.jpg").read_bytes())
    assert main(common) == 0  # same settings, newer source: no --overwrite needed
    grown = Manifest.load(output)
    assert sum(s.count for s in grown.splits.values()) == sum(s.count for s in first.splits.values()) + 1
    assert grown.source_fingerprint != first.source_fingerprint
    assert f"source {grown.source_fingerprint} -> {output}" in capsys.readouterr().out


def test_a_bad_image_in_a_decode_process_is_one_error_line(image_folder_factory, tmp_path):
    """A .jpg that is no image, found by one of two decode processes: our line, with no traceback."""
    root = image_folder_factory(per_class=4, classes=2)
    broken = root / "class_0" / "img_001.jpg"
    broken.write_text("<html>a web page saved as .jpg</html>")
    result = run_cli("--source", f"imagefolder:{root}", "--image-size", "8", "--decode-workers", "2",
                     "--output", str(tmp_path / "data"))
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: cannot read image file://{broken}: it is not an image in a format Pillow "
                      "knows (another kind of file, or a damaged one). Remove or replace the file and stage "
                      "again"]
    for noise in ("Traceback", "multiprocessing", "concurrent.futures", "_RemoteTraceback"):
        assert noise not in result.stderr, result.stderr
    assert not (tmp_path / "data").exists()


INTERRUPTING_FACTORY = '''
import numpy as np


class Interrupting:
    """Raises KeyboardInterrupt at its sixth item, as Ctrl-C during staging does."""

    classes = ["a", "b"]

    def __len__(self):
        return 40

    def __getitem__(self, index):
        if index == 5:
            raise KeyboardInterrupt
        return np.zeros((4, 4), dtype=np.uint8), index % 2


def make(split="train"):
    return Interrupting()
'''


def test_an_interrupted_staging_publishes_nothing_and_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    """Ctrl-C (here a factory that raises KeyboardInterrupt) was a 30-line traceback; the staging it would
    have replaced stays as it was."""
    (tmp_path / "interrupting.py").write_text(INTERRUPTING_FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    output = tmp_path / "d"
    assert main(["--source", "synthetic", "--samples", "40", "--image-size", "4", "--output",
                 str(output)]) == 0

    def listing() -> list[str]:
        return sorted(path.name for path in tmp_path.iterdir() if path.name != "__pycache__")

    before = listing()
    capsys.readouterr()
    assert main(["--source", "python:interrupting:make", "--image-size", "4", "--output", str(output),
                 "--overwrite"]) == 130
    err = capsys.readouterr().err
    assert f"interrupted: nothing was published, {output} is as it was\n" in err and "Traceback" not in err
    assert Manifest.load(output).source == "synthetic"
    assert listing() == before  # no partial copy left beside it
