"""The registry: versions, ``latest``, rollback, champions, the CLI, and SIGKILL at every point of a publish.

The kill tests run a child process (a script this module writes) that publishes a second model into a
registry whose ``latest`` names a first one and SIGKILLs itself at one named point of the publish, by
patching one function of traincore.artifacts.registry in that child only. The parent then checks that
``latest`` names a complete version that loads, that no half-written version is listed, and that the
registry still takes the next publish (or, for a version committed before the kill, the documented
rollback to it).
"""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

import fsspec
import pytest
from ranks import start_script, wait_exit, warm

import traincore.artifacts.registry
from traincore.artifacts.export import WEIGHTS_FILE, export, load_exported
from traincore.artifacts.lineage import LINEAGE_FILE, Lineage, with_test
from traincore.artifacts.registry import Registry, RegistryError, main, resolve_champion
from traincore.config.presets import preset
from traincore.run.trainer import Trainer


@pytest.fixture(scope="module", autouse=True)
def child_server() -> None:
    """The children's server imports traincore while ``models`` trains, not when the first child starts."""
    warm()


@pytest.fixture(scope="module")
def models(synthetic_dir, tmp_path_factory) -> list[Path]:
    """Three export directories of debug models trained 2, 3 and 4 steps (three different sha256s)."""
    root, directories = tmp_path_factory.mktemp("registry-models"), []
    for steps in (2, 3, 4):
        cfg = preset("debug").with_overrides({"train.max_steps": steps, "loader.batch_size": 16})
        Trainer(cfg, synthetic_dir, root / f"run{steps}").train()
        result = export(root / f"run{steps}" / "checkpoints", root / f"model{steps}" / WEIGHTS_FILE)
        with_test(result.lineage, 0.5 + steps / 10, 10).write(root / f"model{steps}" / LINEAGE_FILE)
        directories.append(root / f"model{steps}")
    return directories


def run_child(source: str, tmp_path: Path, *args) -> tuple[int, str]:
    """Run ``source`` as ``python child.py args`` in a forked child: its exit code (-9: SIGKILLed) and
    output."""
    child, log = tmp_path / "child.py", tmp_path / "child.log"
    child.write_text(source)
    code = wait_exit(start_script(child, list(args), log), timeout=120)
    return code, log.read_text(errors="replace") if log.is_file() else ""


def lineage_of(model_dir: Path) -> Lineage:
    return Lineage.load(model_dir / LINEAGE_FILE)


def assert_whole(registry: Registry, version: str, model_dir: Path) -> None:
    """``version`` holds ``model_dir``'s model (it loads, its sha256 checks) and lineage, nothing else."""
    directory = Path(registry.root) / version
    assert sorted(p.name for p in directory.iterdir()) == [LINEAGE_FILE, "model.json", WEIGHTS_FILE]
    load_exported(directory / WEIGHTS_FILE)
    assert registry.lineage(version) == lineage_of(model_dir)


def test_publish_makes_an_immutable_version_and_points_latest_at_it(models, tmp_path, monkeypatch):
    registry = Registry(str(tmp_path / "registry"))
    assert registry.versions() == [] and registry.latest() is None  # no registry yet
    first = registry.publish(models[0], lineage_of(models[0]))
    assert registry.latest() == first and registry.versions() == [first]
    assert_whole(registry, first, models[0])
    assert (tmp_path / "registry" / "latest").read_text() == f"{first}\n"
    assert first.endswith(lineage_of(models[0]).model_sha256[:8])

    # the same second, same model
    monkeypatch.setattr(traincore.artifacts.registry, "version_name", lambda sha: first)
    with pytest.raises(RegistryError, match=f"version {first} already exists .* versions are immutable"):
        registry.publish(models[0], lineage_of(models[0]))
    assert registry.versions() == [first] and not any(p.name.startswith(".partial") for p in
                                                       (tmp_path / "registry").iterdir())


def test_versions_published_within_a_second_list_in_publication_order(models, tmp_path):
    """The second version's weights sort before the first's: named by the second alone, it listed first."""
    registry = Registry(str(tmp_path))
    by_sha = sorted(models, key=lambda model: lineage_of(model).model_sha256, reverse=True)
    versions = [registry.publish(model, lineage_of(model)) for model in by_sha]
    assert registry.versions() == versions and registry.latest() == versions[-1]


def test_rollback_points_latest_at_an_earlier_version(models, tmp_path, capsys):
    registry = Registry(str(tmp_path))
    versions = [registry.publish(model, lineage_of(model)) for model in models[:2]]
    assert registry.versions() == versions and registry.latest() == versions[1]
    assert main(["rollback", str(tmp_path), versions[0]]) == 0
    assert capsys.readouterr().out.strip() == f"{tmp_path}: latest -> {versions[0]} (was {versions[1]})"
    assert Registry(str(tmp_path)).latest() == versions[0]

    assert main(["list", str(tmp_path)]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0] == f"{tmp_path}: 2 version(s), latest {versions[0]} (*)"
    first, second = listing[1:]  # oldest first
    assert first.startswith(f"* {versions[0]}  test accuracy 0.7000 (10 samples)  step 2  source synthetic")
    assert second.startswith(f"  {versions[1]}  test accuracy 0.8000")
    assert main(["show", str(tmp_path), versions[1]]) == 0
    assert Lineage.from_json(capsys.readouterr().out) == lineage_of(models[1])


def test_cli_errors_name_the_problem(models, tmp_path, capsys):
    assert main(["list", str(tmp_path)]) == 0
    assert "holds no published version yet: a promotion publishes the first one" in capsys.readouterr().out
    assert main(["list", str(tmp_path / "none")]) == 0
    assert "none does not exist: no promotion has published there yet (or the path is mistyped)" in (
        capsys.readouterr().out)
    (tmp_path / "file").write_text("")
    assert main(["list", str(tmp_path / "file")]) == 2
    assert "file is not a directory: give the directory a promotion publishes" in capsys.readouterr().err
    # A location no store holds is refused by argparse, not read as a local directory 's3:' or a traceback.
    for uri, problem in (("s3://", "names no bucket"), ("foo://b/x", "unknown scheme foo://")):
        with pytest.raises(SystemExit) as exit_:
            main(["list", uri])
        assert exit_.value.code == 2 and problem in capsys.readouterr().err
    assert main(["rollback", str(tmp_path), "20260101-000000-abcdef12"]) == 2
    err = capsys.readouterr().err
    assert "version '20260101-000000-abcdef12' is not a complete version of the registry" in err
    assert "(versions: none yet)" in err

    (tmp_path / "latest").write_text("20260101-000000-abcdef12\n")  # edited by hand, or a foreign tool
    with pytest.raises(RegistryError, match="latest names '20260101-000000-abcdef12', which is not a "
                                            "complete"):
        Registry(str(tmp_path)).latest()


def test_a_store_without_credentials_is_one_error_line(tmp_path, monkeypatch, capsys):
    """botocore's NoCredentialsError, not an OSError, ended `list s3://...` in a traceback."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "no-such-file"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # never reached: no credentials to sign with
    # fsspec keeps one filesystem per set of arguments in a process, whatever the environment was when an
    # earlier test made it: this one must read the environment above.
    fsspec.get_filesystem_class("s3").clear_instance_cache()
    uri = f"s3://registry-{uuid.uuid4().hex[:8]}/models"
    for command in (["list", uri], ["show", uri, "20260101-000000-abcdef12"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: the registry {uri} cannot be read or written (NoCredentialsError"), err
        assert "AWS_ENDPOINT_URL" in err and "Traceback" not in err and err.count("\n") == 1, err


def test_a_latest_that_names_no_version_is_listed_and_repaired_by_a_rollback(models, tmp_path, capsys):
    registry = Registry(str(tmp_path))
    version = registry.publish(models[0], lineage_of(models[0]))
    (tmp_path / "latest").write_text("20260101-000000-abcdef12\n")  # its version deleted by hand
    assert main(["list", str(tmp_path)]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0] == (f"{tmp_path}: 1 version(s); latest names '20260101-000000-abcdef12', which is not "
                          f"one of them: point it at one with python -m traincore.registry rollback "
                          f"{tmp_path} VERSION")
    assert listing[1].startswith(f"  {version}")
    assert main(["rollback", str(tmp_path), version]) == 0
    assert capsys.readouterr().out.strip() == (f"{tmp_path}: latest -> {version} (was "
                                               "20260101-000000-abcdef12)")
    assert Registry(str(tmp_path)).latest() == version


def test_cli_publishes_an_export_by_hand(models, tmp_path, capsys):
    assert main(["publish", str(tmp_path), str(models[2])]) == 0
    version = Registry(str(tmp_path)).latest()
    assert capsys.readouterr().out.strip() == f"{tmp_path}: published {version} (latest)"
    assert_whole(Registry(str(tmp_path)), version, models[2])


def test_a_model_and_lineage_that_do_not_belong_together_are_not_published(models, tmp_path):
    registry = Registry(str(tmp_path / "registry"))
    with pytest.raises(RegistryError, match="describes weights with sha256 .* publish the lineage.json"):
        registry.publish(models[0], lineage_of(models[1]))
    with pytest.raises(RegistryError, match=f"{tmp_path} is not a publishable model: exported model"):
        registry.publish(tmp_path, lineage_of(models[0]))
    assert registry.versions() == [] and not (tmp_path / "registry" / "latest").exists()


def test_champion_is_the_input_else_the_registrys_latest_else_none(models, tmp_path):
    registry = Registry(str(tmp_path / "registry"))
    assert resolve_champion(None, registry, tmp_path / "cache") is None  # the first run
    version = registry.publish(models[0], lineage_of(models[0]))
    latest = resolve_champion(None, registry, tmp_path / "cache")
    assert latest.directory == tmp_path / "registry" / version and latest.lineage == lineage_of(models[0])
    assert latest.origin == f"{registry.uri}/{version} (latest)"
    for given in (str(models[1]), str(models[1] / WEIGHTS_FILE), f"file://{models[1]}/"):
        chosen = resolve_champion(given, registry, tmp_path / "cache")
        assert chosen.directory == models[1] and chosen.origin == given
    with pytest.raises(RegistryError, match="holds no model.safetensors: give an export directory"):
        resolve_champion(str(tmp_path / "empty"), registry, tmp_path / "cache")


CHILD = '''
"""Publish MODEL_DIR into REGISTRY and SIGKILL this process at POINT (written by test_registry.py)."""
import os
import signal
import sys
from pathlib import Path

import traincore.artifacts.registry as registry
from traincore.artifacts.lineage import Lineage

point, uri, model_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
publish_file, commit_version = registry.publish, registry.commit_version


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def copy_half_then_die(source, target):  # the weights half copied into the version being assembled
    data = Path(source).read_bytes()
    Path(target).write_bytes(data[: len(data) // 2])
    die()


def die_at(name):  # a file written in full to its .tmp, not renamed into place
    def killing_publish(tmp, path):
        if Path(path).name == name:
            die()
        publish_file(tmp, path)
    return killing_publish


def commit_then_die(partial, target):  # the version renamed into place, latest not written yet
    commit_version(partial, target)
    die()


if point == "copy":
    registry.copy_file = copy_half_then_die
elif point == "lineage":
    registry.publish = die_at("lineage.json")
elif point == "commit":
    registry.commit_version = lambda partial, target: die()
elif point == "committed":
    registry.commit_version = commit_then_die
elif point == "latest":
    registry.publish = die_at("latest")
registry.Registry(uri).publish(model_dir, Lineage.load(model_dir / "lineage.json"))
'''
KILL_POINTS = ("copy", "lineage", "commit", "committed", "latest")


@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkill_during_publish_never_leaves_latest_on_a_partial_version(models, tmp_path, point):
    registry = Registry(str(tmp_path / "registry"))
    first = registry.publish(models[0], lineage_of(models[0]))
    code, output = run_child(CHILD, tmp_path, point, registry.uri, models[1])
    assert code == -signal.SIGKILL, output

    assert registry.latest() == first  # latest is written last: the kill came before it moved
    assert_whole(registry, first, models[0])
    committed = point in ("committed", "latest")
    assert len(registry.versions()) == 1 + committed  # a partial version is never listed
    hidden = [p.name for p in (tmp_path / "registry").iterdir() if p.name.startswith(".")]
    assert bool(hidden) is (point in ("copy", "lineage", "commit", "latest"))  # leftovers stay hidden
    if committed:  # complete but not current: the documented rollback makes it current
        second = registry.versions()[-1]
        assert_whole(registry, second, models[1])
        assert main(["rollback", registry.uri, second]) == 0
    else:  # the next publish simply succeeds
        second = registry.publish(models[2], lineage_of(models[2]))
    assert registry.latest() == second


@pytest.fixture
def s3_registry():
    """A registry prefix on a local S3 API (moto's server, in this process) and the filesystem to reach it."""
    import boto3
    import fsspec
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = {"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1"}
        credentials = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}  # moto's dummies
        boto3.client("s3", **endpoint, **credentials).create_bucket(Bucket="models")
        fs = fsspec.filesystem("s3", key="testing", secret="testing", skip_instance_cache=True,
                               client_kwargs=endpoint)
        # moto keeps one store per process, whatever the server: every test gets its own prefix.
        yield f"s3://models/{uuid.uuid4().hex[:8]}", fs, endpoint["endpoint_url"]
    finally:
        server.stop()


def test_an_object_store_registry_counts_a_version_once_its_lineage_is_there(models, s3_registry, tmp_path):
    uri, fs, _ = s3_registry
    registry = Registry(uri, fs)
    first = registry.publish(models[0], lineage_of(models[0]))
    assert registry.latest() == first and registry.lineage(first) == lineage_of(models[0])
    # A publish that died after the model files, before lineage.json: not a version, latest untouched.
    for name in (WEIGHTS_FILE, "model.json"):
        fs.put_file(str(models[1] / name), f"{uri}/20990101-000000-deadbeef/{name}")
    assert registry.versions() == [first] and registry.latest() == first

    champion = resolve_champion(None, registry, tmp_path / "cache")
    assert champion.directory.parent == tmp_path / "cache" and champion.lineage == lineage_of(models[0])
    load_exported(champion.directory / WEIGHTS_FILE)  # downloaded whole: its sha256 checks
    second = registry.publish(models[1], lineage_of(models[1]))
    registry.set_latest(first)  # the rollback
    assert registry.versions() == sorted([first, second]) and registry.latest() == first


S3_CHILD = '''
"""Publish MODEL_DIR to an S3 REGISTRY and SIGKILL this process just before the PUT of NAME (written by
test_registry.py)."""
import os
import signal
import sys
from pathlib import Path

import fsspec

from traincore.artifacts.lineage import Lineage
from traincore.artifacts.registry import Registry

name, uri, model_dir, endpoint = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
fs = fsspec.filesystem("s3", key="testing", secret="testing", skip_instance_cache=True,
                       client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"})
pipe_file = fs.pipe_file


def killing_pipe_file(path, data, **kwargs):
    if path.endswith("/" + name):
        os.kill(os.getpid(), signal.SIGKILL)
    return pipe_file(path, data, **kwargs)


fs.pipe_file = killing_pipe_file  # this filesystem object only
Registry(uri, fs).publish(model_dir, Lineage.load(model_dir / "lineage.json"))
'''


@pytest.mark.parametrize("name", ["lineage.json", "latest"])
def test_sigkill_during_an_object_store_publish_leaves_latest_whole(models, s3_registry, tmp_path, name):
    uri, fs, endpoint = s3_registry
    registry = Registry(uri, fs)
    first = registry.publish(models[0], lineage_of(models[0]))
    code, output = run_child(S3_CHILD, tmp_path, name, uri, models[1], endpoint)
    assert code == -signal.SIGKILL, output
    assert registry.latest() == first  # the single PUT of latest never happened
    uploaded = fs.find(uri)
    assert any(path.endswith(WEIGHTS_FILE) and first not in path for path in uploaded)  # the kill was late
    if name == "lineage.json":  # model files uploaded, lineage.json not: not a version
        assert registry.versions() == [first]
        second = registry.publish(models[2], lineage_of(models[2]))
    else:  # complete but not current: the documented rollback makes it current
        (second,) = set(registry.versions()) - {first}
        assert registry.lineage(second) == lineage_of(models[1])
        registry.set_latest(second)
    assert registry.latest() == second
