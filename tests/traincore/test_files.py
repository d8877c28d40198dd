"""Path and URI flags of the traincore CLIs (traincore.files.path_argument, local_path_argument)."""

from __future__ import annotations

import argparse

import pytest

from traincore.files import local_path_argument, path_argument


@pytest.mark.parametrize("text", ["runs/a", "/abs/path", "file:///tmp/x", "s3://bucket/run", "memory://b/x"])
def test_paths_and_uris_of_known_stores_pass_unchanged(text):
    assert path_argument(text) == text


@pytest.mark.parametrize(("text", "message"), [
    ("", "is empty: give a path or URI (is a shell variable unset?)"),  # would be the current directory
    ("  ", "is empty"),
    ("s3://", "'s3://' names no bucket: write s3://BUCKET/PATH"),  # was the local directory "s3:"
    ("s3:///run", "names no bucket"),
    ("bogus://x/y", "'bogus://x/y' has the unknown scheme bogus://: use a local path or an object-store"),
])
def test_an_empty_path_or_a_uri_no_store_can_open_is_refused(text, message):
    with pytest.raises(argparse.ArgumentTypeError) as caught:
        path_argument(text)
    assert message in str(caught.value), caught.value


def test_a_flag_that_takes_a_local_path_refuses_an_object_store_uri(capsys):
    from traincore.artifacts.evaluate import main as evaluate

    assert local_path_argument("runs/a") == "runs/a"
    assert local_path_argument("file:///tmp/x") == "/tmp/x"  # read as a path, "file:" would be a directory
    with pytest.raises(argparse.ArgumentTypeError,
                       match=r"'s3://b/m.safetensors' is an object-store URI, and this flag takes a local"):
        local_path_argument("s3://b/m.safetensors")
    with pytest.raises(argparse.ArgumentTypeError, match="names no bucket"):
        local_path_argument("s3://")
    # once: "exported model s3:/b/m.safetensors ... is missing: run python -m traincore.export ..."
    with pytest.raises(SystemExit):
        evaluate(["--model", "s3://b/m.safetensors", "--data", "staged"])
    assert "argument --model: 's3://b/m.safetensors' is an object-store URI" in capsys.readouterr().err
