"""Security: a W&B key reaches no output, no checkpoint load runs code, staged files stay where we put them.

Keys are random canaries made per run; every output of a run (its stdout/stderr, metrics.jsonl, TensorBoard
events, the W&B run directory, checkpoints, the exported model, Flyte's error document and sandbox, W&B's
and the user's home directories, the `pyflyte package` archive) is searched for each canary, raw and
base64-encoded at every byte alignment (standard and URL-safe alphabets).
"""

from __future__ import annotations

import ast
import base64
import http.server
import io
import json
import os
import pickletools
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from faultlib import (
    TINY,
    child_env,
    flyte_attempt_command,
    flyte_attempt_env,
    flyte_error,
    kill_tree,
    train_args,
    write_flyte_inputs,
)
from torch import nn
from wandb_server import WandbStub

from tasks.launch import train_task_for
from tasks.train import WANDB_SECRET
from tasks.types import StagedDataset, Topology
from traincore.artifacts.export import export
from traincore.checkpoint import Checkpointer, CheckpointError, complete_steps, step_dir
from traincore.checkpoint.commit import write_marker
from traincore.checkpoint.layout import STATE_FILE
from traincore.config.presets import preset
from traincore.config.schema import CheckpointConfig, DataConfig
from traincore.data.manifest import Manifest, StagingError
from traincore.data.staging import stage
from traincore.run.state import StateRegistry

REPO = Path(__file__).resolve().parents[2]
# Train, then export the latest checkpoint, in one process (one start-up instead of two).
TRAIN_AND_EXPORT = """
import sys
from traincore.artifacts.export import main as export
from traincore.run.cli import main as train
split = sys.argv.index("--")
sys.exit(train(sys.argv[1:split]) or export(sys.argv[split + 1:]))
"""


def canary(label: str) -> str:
    return f"{label}-{secrets.token_hex(20)}"


def encodings(secret: str) -> dict[str, bytes]:
    """The canary raw, and the part of its base64 text that does not depend on its neighbours, for each of
    the three byte alignments it can have inside a longer encoded string."""
    raw = secret.encode()
    found = {"raw": raw}
    for shift in range(3):
        encoded = base64.b64encode(bytes(shift) + raw)
        stable = encoded[-(-8 * shift // 6):8 * (shift + len(raw)) // 6]
        found[f"base64@{shift}"] = stable
        found[f"base64url@{shift}"] = stable.translate(bytes.maketrans(b"+/", b"-_"))
    return found


def leaks(secret: str, *places: Path | str) -> tuple[list[str], int]:
    """(where ``secret`` shows, how many files and texts were searched) over files, directory trees and
    texts (stdout, stderr)."""
    patterns = encodings(secret)
    found, searched = [], 0
    for place in places:
        if isinstance(place, str):
            items = [("output text", place.encode(errors="surrogateescape"))]
        else:
            paths = sorted(place.rglob("*")) if place.is_dir() else [place]
            items = [(str(p), p.read_bytes()) for p in paths if p.is_file() and not p.is_symlink()]
        for where, data in items:
            searched += 1
            found += [f"{where} ({kind})" for kind, pattern in patterns.items() if pattern in data]
    return found, searched


def wandb_homes(tmp: Path) -> dict[str, str]:
    """HOME and W&B's own directories inside ``tmp``, so whatever W&B keeps there is searched too."""
    home = tmp / "home"
    return {"HOME": str(home), "WANDB_CONFIG_DIR": str(home / "wandb-config"),
            "WANDB_CACHE_DIR": str(home / "wandb-cache"), "WANDB_DATA_DIR": str(home / "wandb-data")}


def without_keys(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in ("WANDB_API_KEY", "WANDB_API_KEY_FILE")}


def start_offline_run(data: Path, tmp: Path, given_by: str) -> tuple[str, subprocess.Popen]:
    """Train (offline W&B, TensorBoard, checkpoints, DEBUG logs) and export, with a canary key given by
    ``given_by``: "env" (WANDB_API_KEY) or "file" (WANDB_API_KEY_FILE, as a mounted secret)."""
    key = canary(f"wandb-{given_by}")
    tmp.mkdir()
    env = without_keys(child_env(**wandb_homes(tmp)))
    if given_by == "env":
        env["WANDB_API_KEY"] = key
    else:
        key_file = tmp / "mounted" / "api_key"  # outside every searched directory
        key_file.parent.mkdir(parents=True)
        key_file.write_text(key + "\n")
        env["WANDB_API_KEY_FILE"] = str(key_file)
    config = {**TINY, "telemetry": {"log_every": 1, "tensorboard": True,
                                    "wandb_mode": "offline", "level": "DEBUG"}}
    train = ["--data", str(data), "--output", str(tmp / "run"), "--preset", "debug", "--config",
             json.dumps(config), "--max-steps", "4", "--checkpoint-every", "2"]
    export_args = ["--checkpoint", str(tmp / "run" / "checkpoints"), "--output",
                   str(tmp / "export" / "model.st")]
    with open(tmp / "stdout", "w") as out, open(tmp / "stderr", "w") as err:
        process = subprocess.Popen([sys.executable, "-c", TRAIN_AND_EXPORT, *train, "--", *export_args],
                                   env=env, stdout=out, stderr=err)
    return key, process


def test_offline_runs_and_export_keep_the_key_out_of_every_output(fault_data, tmp_path):
    runs = {how: start_offline_run(fault_data, tmp_path / how, how) for how in ("env", "file")}
    for given_by, (key, process) in runs.items():  # both at once: each is mostly one busy core
        tmp = tmp_path / given_by
        try:
            assert process.wait(300) == 0, (tmp / "stderr").read_text()[-3000:]
        finally:
            kill_tree(process.pid)
        run, exported = tmp / "run", tmp / "export"
        # Every kind of output exists, so the search below covers it.
        assert (run / "metrics.jsonl").stat().st_size > 0 and list((run / "tensorboard").glob("events.*"))
        assert list((run / "wandb").glob("offline-run-*/*.wandb"))
        assert list((run / "checkpoints").glob(f"step-*/{STATE_FILE}"))
        assert (exported / "model.st").is_file() and list(exported.glob("*.json"))
        found, searched = leaks(key, tmp / "stdout", tmp / "stderr", run, exported, tmp / "home")
        assert not found and searched > 10, (given_by, found)


def test_online_key_from_the_mounted_secret_goes_to_the_wandb_server_only(fault_data, tmp_path):
    key = canary("wandb-online")
    mounted = tmp_path / "etc-secrets"  # where Flyte mounts file secrets: <dir>/<group>/<key>
    (mounted / WANDB_SECRET.group).mkdir(parents=True)
    (mounted / WANDB_SECRET.group / WANDB_SECRET.key).write_text(key + "\n")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), WandbStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    WandbStub.seen = []
    config = preset("debug").with_overrides(TINY).with_overrides(
        {"telemetry.wandb_mode": "online", "telemetry.level": "DEBUG", "train.max_steps": 2})
    task = train_task_for(Topology(nproc_per_node=1), config)
    assert [s.group for s in task.security_context.secrets] == [WANDB_SECRET.group]
    inputs = write_flyte_inputs(task, tmp_path / "inputs.pb", tmp_path / "upload", config=config,
                                dataset=StagedDataset.from_manifest(fault_data, Manifest.load(fault_data)),
                                checkpoint_root=str(tmp_path / "checkpoints"))
    attempt = tmp_path / "attempt"
    env = without_keys(flyte_attempt_env(0, attempt / "tmp", FLYTE_SECRETS_DEFAULT_DIR=str(mounted),
                                         WANDB_BASE_URL=f"http://127.0.0.1:{server.server_port}",
                                         **wandb_homes(tmp_path)))
    try:
        result = subprocess.run(flyte_attempt_command(task, inputs, attempt), env=env, capture_output=True,
                                text=True, timeout=300)
    finally:
        server.shutdown()
    # W&B got the key (from the file the secret mount holds) as its API credential, and refused it ...
    credential = "Basic " + base64.b64encode(f"api:{key}".encode()).decode()
    assert any(headers.get("Authorization") == credential for _, headers, _ in WandbStub.seen), WandbStub.seen
    elsewhere = [path for path, headers, body in WandbStub.seen
                 if leaks(key, path, body.decode(errors="replace"),
                          *(v for k, v in headers.items() if k != "Authorization"))[0]]
    assert not elsewhere, elsewhere  # e.g. W&B's own error reports to the server
    kind, message = flyte_error(attempt) or ("no error document", result.stderr[-3000:])
    assert kind == "NON_RECOVERABLE" and "unauthorized" in message, message
    # ... and it shows in no output: logs, error document, Flyte's sandbox and run directory, homes.
    # (W&B failed before the first step, so the run wrote no metrics.jsonl: metrics open at the first record)
    assert list((attempt / "tmp").rglob("debug*.log"))
    found, searched = leaks(key, result.stdout, result.stderr, attempt, tmp_path / "home",
                            tmp_path / "upload", tmp_path / "checkpoints")
    assert not found and searched > 10, found


@pytest.fixture(scope="module", autouse=True)
def packaging(tmp_path_factory):
    """`pyflyte package` with canary keys in its environment (WANDB_API_KEY, and WANDB_API_KEY_FILE naming
    a file), started with the module so that it runs alongside the other tests."""
    tmp = tmp_path_factory.mktemp("package")
    env_key, file_key = canary("wandb-env"), canary("wandb-file")
    key_file = tmp / "mounted" / "api_key"
    key_file.parent.mkdir()
    key_file.write_text(file_key)
    env = child_env(WANDB_API_KEY=env_key, WANDB_API_KEY_FILE=str(key_file), **wandb_homes(tmp))
    with open(tmp / "stdout", "w") as out, open(tmp / "stderr", "w") as err:
        command = [str(Path(sys.executable).parent / "pyflyte"), "--pkgs", "workflows", "package", "--image",
                   "localhost/flyte-torch-pipeline:canary", "-o", str(tmp / "flyte-package.tgz")]
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=err)
    yield SimpleNamespace(process=process, tmp=tmp, keys=(env_key, file_key))
    kill_tree(process.pid)


def test_pyflyte_package_serialises_no_key_from_the_environment(packaging):
    tmp = packaging.tmp
    assert packaging.process.wait(300) == 0, (tmp / "stderr").read_text()[-3000:]
    unpacked = tmp / "unpacked"
    with tarfile.open(tmp / "flyte-package.tgz") as tar:
        tar.extractall(unpacked, filter="data")
    specs = [p.name for p in unpacked.rglob("*.pb")]
    assert any("tasks.train.train-local-1x2" in name for name in specs), specs
    for key in packaging.keys:
        found, searched = leaks(key, tmp / "stdout", tmp / "stderr", unpacked, tmp / "home")
        assert not found and searched >= len(specs), found


def _sources() -> list[Path]:
    """The repository's Python files, outside hidden directories (.venv, .git), __pycache__, build and
    *.egg-info: pruned while walking, as the virtualenv alone holds tens of thousands of files."""
    sources = []
    for directory, subdirectories, files in os.walk(REPO):
        subdirectories[:] = [name for name in subdirectories if not (
            name.startswith(".") or name in ("__pycache__", "build") or name.endswith(".egg-info"))]
        sources += [Path(directory, name) for name in files if name.endswith(".py") and name[0] != "."]
    return sources


def test_every_torch_load_passes_weights_only_and_nothing_else_unpickles():
    calls, bad = 0, []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        name = path.relative_to(REPO)
        library = name.parts[0] in ("traincore", "tasks", "workflows")
        loaded = {node for node in ast.walk(tree) if isinstance(node, ast.Call)}
        for node in ast.walk(tree):
            if _is_torch_load(node):
                call = next((c for c in loaded if c.func is node), None)
                safe = call is not None and any(
                    k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in call.keywords)
                calls += call is not None
                if not safe:
                    bad.append(f"{name}:{node.lineno}: torch.load without weights_only=True")
            elif library and isinstance(node, ast.Call) and _unpickles(node):
                bad.append(f"{name}:{node.lineno}: {ast.unparse(node.func)} unpickles")
    assert not bad and calls >= 1, bad


def _is_torch_load(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "load" and isinstance(node.value, ast.Name)
            and node.value.id == "torch") or (isinstance(node, ast.ImportFrom) and node.module == "torch"
                                              and any(alias.name == "load" for alias in node.names))


def _unpickles(call: ast.Call) -> bool:
    name = ast.unparse(call.func)
    if name in ("pickle.load", "pickle.loads", "pickle.Unpickler", "dill.load", "dill.loads", "joblib.load",
                "cloudpickle.load", "cloudpickle.loads"):
        return True
    return name in ("np.load", "numpy.load") and any(
        k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
        for k in call.keywords)


class RunsCode:
    """Unpickles to ``os.system("touch <marker>")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def test_a_checkpoint_that_would_run_code_is_refused_unrun(fault_data, tmp_path):
    root, marker = tmp_path / "checkpoints", tmp_path / "code-ran"
    directory = step_dir(root, 5)
    directory.mkdir(parents=True)
    torch.save({"step": 5, "shared": {"model": RunsCode(marker)}, "per_rank": []}, directory / STATE_FILE)
    write_marker(directory, 5, "sync", 1, {})  # forged: valid sizes and CRC32s for the crafted file
    with zipfile.ZipFile(directory / STATE_FILE) as saved:
        pickled = saved.read(next(n for n in saved.namelist() if n.endswith("data.pkl")))
    assert any(op.name == "GLOBAL" and arg.endswith(" system") for op, arg, _ in pickletools.genops(pickled))
    # A real resume (preflight, then the checkpointer) in a process of its own, meanwhile the direct calls.
    args = train_args(fault_data, tmp_path / "run", "--checkpoint-dir", str(root), "--max-steps", "8")
    command = [sys.executable, "-m", "traincore.train", *args]
    resume = subprocess.Popen(command, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)

    registry = StateRegistry()
    registry.register("model", nn.Linear(2, 2))
    checkpointer = Checkpointer(root, CheckpointConfig(), registry, rank=0, world_size=1)
    with pytest.raises(CheckpointError, match=re.escape(str(directory / STATE_FILE))) as resumed:
        checkpointer.load()  # what Trainer.resume calls
    checkpointer.close()
    with pytest.raises(CheckpointError, match=re.escape(str(directory / STATE_FILE))) as exported:
        export(directory, tmp_path / "export" / "model.safetensors")
    for refusal in (resumed.value, exported.value):
        assert "system" in f"{refusal} {refusal.__cause__}"  # what it refused to call is on record
    assert not (tmp_path / "export" / "model.safetensors").exists()
    try:
        output, _ = resume.communicate(timeout=300)
    finally:
        kill_tree(resume.pid)
    assert resume.returncode != 0 and f"checkpoint file {directory / STATE_FILE}" in output, output[-3000:]
    assert complete_steps(root) == [5] and not marker.exists()


def _png(colour: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full((10, 10, 3), colour, dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


# Class names that are path syntax: a parent reference, separators of both kinds, encoded dots.
HOSTILE_CLASSES = ("..", "a\\..\\..\\b", "%2e%2e", "..%2f..%2fx", "-rf")


@pytest.mark.parametrize("kind", ["zip", "memory", "local"])
def test_imagefolder_class_names_cannot_place_files_outside_the_staging(tmp_path, monkeypatch, kind):
    import fsspec

    monkeypatch.chdir(tmp_path)  # a relative write would land in the searched tree too
    entries = {f"{name}/img_{i}.png": _png((40 * k, 200 - 40 * k, 90))
               for k, name in enumerate(HOSTILE_CLASSES) for i in range(4)}
    entries.update({f"root_{i}.png": _png((0, 0, 0)) for i in range(2)})  # next to the classes: no class
    if kind == "zip":
        archive = tmp_path / "source" / "images.zip"
        archive.parent.mkdir()
        with zipfile.ZipFile(archive, "w") as z:
            for name, data in entries.items():
                z.writestr(f"root/{name}", data)
        location = f"zip://root::{archive}"
    elif kind == "memory":
        memory = fsspec.filesystem("memory")
        prefix = f"/security-{secrets.token_hex(4)}"
        for name, data in entries.items():
            memory.pipe(f"{prefix}/root/{name}", data)
        location = f"memory://{prefix}/root"
    else:  # POSIX names cannot hold "/" or be "..": the rest of them, as directories
        for name, data in entries.items():
            if not name.startswith("../"):
                (tmp_path / "source" / "root" / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / "source" / "root" / name).write_bytes(data)
        location = str(tmp_path / "source" / "root")
    output = tmp_path / "deep" / "er" / "staged"
    before = _files(tmp_path)
    try:
        manifest = stage(DataConfig(source=f"imagefolder:{location}", image_size=8, decode_workers=1,
                                    val_fraction=0.2, test_fraction=0.2, samples_per_shard=4), output)
    except StagingError as exc:  # refusing the layout is as good as staging it, provided nothing escaped
        manifest = exc
    finally:
        if kind == "memory":
            memory.rm(prefix, recursive=True)
    written = _files(tmp_path) - before
    assert all(output in p.parents for p in written), sorted(map(str, written))
    if isinstance(manifest, Manifest):  # staged: the shards are named by the stager, the names are data
        # Names starting with a dot ("..", "..%2f..%2fx") are dot-directories, which staging skips.
        assert manifest.classes == sorted(n for n in HOSTILE_CLASSES if not n.startswith("."))
        names = {p.relative_to(output).as_posix() for p in written} - {"manifest.json"}
        assert names and all(name.split("-")[0] in ("train", "val", "test") for name in names), names
        assert (output / "manifest.json").is_file()
    else:  # refused: nothing left behind at all
        assert not written and not output.exists(), (manifest, written)


def test_a_forged_dcp_metadata_is_refused_without_running_code(tmp_path):
    """DCP's ``.metadata`` is a pickle; ours is read with an allow-list, so a forged one runs nothing."""
    import pickle

    from traincore.checkpoint import CheckpointError
    from traincore.checkpoint.format import read_checkpoint

    source = (Path(__file__).parents[1] / "traincore" / "checkpoint" / "fixtures" / "checkpoint-v2" / "dcp"
              / "step-000004")
    forged = shutil.copytree(source, tmp_path / "step-000004")
    marker = tmp_path / "ran-code"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (forged / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        read_checkpoint(forged)
    assert not marker.exists()
