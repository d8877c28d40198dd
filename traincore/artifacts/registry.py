"""The model registry: immutable versions under one prefix (a directory or an object-store URI) and a
``latest`` pointer, written last, that names the model in service.

    <promoted_uri>/<version>/model.safetensors   the weights (traincore.export)
    <promoted_uri>/<version>/model.json          their config, with their sha256
    <promoted_uri>/<version>/lineage.json        traincore.artifacts.lineage, written last: it completes the
    version
    <promoted_uri>/latest                        text: the current version's name

A version is written once and never changed. Locally it is assembled under a hidden temporary name and
renamed into place; on an object store its files are uploaded with lineage.json last, and a version counts
only once lineage.json exists. ``latest`` is replaced atomically (a rename locally, a single PUT on an
object store) and only after its version is complete, so a crash at any point leaves it naming a whole
version. Rolling back is pointing ``latest`` at an earlier version:

    python -m traincore.registry list URI
    python -m traincore.registry show URI VERSION
    python -m traincore.registry rollback URI VERSION
    python -m traincore.registry publish URI MODEL_DIR    # an exported model, by hand
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import fsspec
from fsspec.implementations.local import LocalFileSystem

from traincore.artifacts.export import (
    WEIGHTS_FILE,
    ExportError,
    add_trust_flags,
    config_path_for,
    load_exported,
    trust_from_args,
)
from traincore.artifacts.lineage import LINEAGE_FILE, Lineage, LineageError
from traincore.checkpoint import STORE_ACCESS_FIX, error_reason, is_uri
from traincore.files import fsync_path, local_path_argument, path_argument, publish, publish_directory
from traincore.model import ModelImportError
from traincore.telemetry import logging_setup

LATEST = "latest"
MODEL_FILES = (WEIGHTS_FILE, config_path_for(WEIGHTS_FILE).name)  # lineage.json follows them, last
VERSION_NAME = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{8}$")  # <UTC date>-<UTC time>-<weights sha256 prefix>
_PARTIAL = ".partial-"  # a local version being assembled; never listed, never named by latest


class RegistryError(ValueError):
    """The registry, or a version or model asked of it, is missing or unusable; the message says the fix."""


def version_name(model_sha256: str) -> str:
    """``20261123-170102-ab12cd34``: names sort by publication time; the suffix tells the weights apart."""
    # time.time(), not gmtime()'s own clock: that one is glibc's coarse clock, which still read the last
    # second for a few milliseconds after time.time() had passed into the next.
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime(time.time()))}-{model_sha256[:8]}"


class Registry:
    """The registry at ``uri``; ``fs`` is the filesystem to reach it (default: fsspec's for the URI)."""

    def __init__(self, uri: str, fs: fsspec.AbstractFileSystem | None = None):
        if not uri:
            raise RegistryError("the registry location is empty: give a directory or an object-store prefix "
                                "such as s3://bucket/models/digits")
        self.uri = uri.rstrip("/")
        self.fs = fs if fs is not None else fsspec.core.url_to_fs(self.uri)[0]
        self.local = isinstance(self.fs, LocalFileSystem)
        # ~ is expanded here so that a workflow default can name the user's directory on any machine.
        self.root = str(Path(self.uri.removeprefix("file://")).expanduser()) if self.local else self.uri

    def _path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def versions(self) -> list[str]:
        """Complete versions, oldest first."""
        if self.local:
            root = Path(self.root)
            names = [p.name for p in root.iterdir() if (p / LINEAGE_FILE).is_file()] if root.is_dir() else []
        else:
            self.fs.invalidate_cache()  # listings cached by this filesystem miss other processes' publishes
            names = [PurePosixPath(path).parent.name for path in self.fs.glob(self._path("*", LINEAGE_FILE))]
        return sorted(name for name in names if VERSION_NAME.match(name))

    def latest(self) -> str | None:
        """The version ``latest`` names; None before the first publication; RegistryError if it names no
        complete version."""
        version = self.pointer()
        if version is not None:
            self.check_version(version, f"{self._path(LATEST)} names {version!r}, which")
        return version

    def pointer(self) -> str | None:
        """What ``latest`` holds, unchecked (a rollback repairs one that names no complete version)."""
        path = self._path(LATEST)
        if not self.fs.exists(path):
            return None
        return self.fs.cat_file(path).decode("utf-8", errors="replace").strip()

    def check_version(self, version: str, what: str = "") -> None:
        """RegistryError unless ``version`` is a complete version here; ``what`` starts the message."""
        if version in self.versions():
            return
        what = what or f"version {version!r}"
        listing = ", ".join(self.versions()[-5:]) or "none yet"
        raise RegistryError(f"{what} is not a complete version of the registry {self.uri} (versions: "
                            f"{listing}): see python -m traincore.registry list {self.uri}")

    def lineage(self, version: str) -> Lineage:
        """The lineage published with ``version``."""
        self.check_version(version)
        path = self._path(version, LINEAGE_FILE)
        try:
            return Lineage.from_json(self.fs.cat_file(path), path)
        except LineageError as exc:
            raise RegistryError(str(exc)) from exc

    def publish(self, model_dir: str | Path, lineage: Lineage, trust_model: bool | str = False) -> str:
        """Publish the exported model in ``model_dir`` with ``lineage`` as a new version, then point
        ``latest`` at it; returns the version. The model is verified first (its sha256, the lineage's, and
        that it rebuilds: ``trust_model`` allows that for an imported model, see
        traincore.model.build.check_trusted)."""
        model_dir = Path(model_dir)
        check_model_dir(model_dir, lineage, trust_model)
        version = self._new_version(lineage.model_sha256)
        if self.fs.exists(self._path(version)):
            raise RegistryError(f"version {version} already exists in {self.uri}: versions are immutable; "
                                "publish again in a second")
        if self.local:
            self._publish_local(model_dir, lineage, version)
        else:
            for name in MODEL_FILES:
                self.fs.put_file(str(model_dir / name), self._path(version, name))
            self.fs.pipe_file(self._path(version, LINEAGE_FILE), lineage.to_json().encode())
        self.set_latest(version)
        return version

    def _new_version(self, model_sha256: str) -> str:
        """:func:`version_name` for a version published now, taken in the next second where the newest
        version already has this second's: within one second, names would sort by their weights' sha256,
        not by publication (a registry of two versions published 0.3 s apart listed the second one first)."""
        version = version_name(model_sha256)
        newest = self.versions()[-1:]
        if newest and newest[0][:15] >= version[:15]:  # 15: "<UTC date>-<UTC time>"
            time.sleep(1.0 - time.time() % 1.0)
            version = version_name(model_sha256)
        return version

    def _publish_local(self, model_dir: Path, lineage: Lineage, version: str) -> None:
        root = Path(self.root)
        root.mkdir(parents=True, exist_ok=True)
        partial = root / f"{_PARTIAL}{version}-{uuid.uuid4().hex[:8]}"
        partial.mkdir()
        try:
            for name in MODEL_FILES:
                copy_file(model_dir / name, partial / name)
            tmp = partial / f".{LINEAGE_FILE}.tmp"
            lineage.write(tmp)
            publish(tmp, partial / LINEAGE_FILE)
            commit_version(partial, root / version)
        finally:
            shutil.rmtree(partial, ignore_errors=True)

    def set_latest(self, version: str) -> None:
        """Point ``latest`` at the complete ``version``, atomically."""
        self.check_version(version)
        if not self.local:
            self.fs.pipe_file(self._path(LATEST), f"{version}\n".encode())  # one PUT: old or new, never torn
            return
        tmp = Path(self.root) / f".{LATEST}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            tmp.write_text(f"{version}\n", encoding="utf-8")
            publish(tmp, Path(self.root) / LATEST)
        finally:
            tmp.unlink(missing_ok=True)

    def fetch(self, version: str, cache: str | Path) -> Path:
        """A local directory holding ``version``: itself in a local registry, else a download in ``cache``."""
        self.check_version(version)
        return fetch_model(self._path(version), self.fs, cache)


def copy_file(source: Path, target: Path) -> None:
    """Copy and fsync one file: the rename that follows must publish bytes that are on disk."""
    shutil.copyfile(source, target)
    fsync_path(target)


def commit_version(partial: Path, target: Path) -> None:
    """Rename the assembled version into place; a version of the same name is never replaced."""
    try:
        publish_directory(partial, target)  # fails on an existing, non-empty target directory
    except OSError as exc:
        raise RegistryError(f"cannot publish {target}: {exc.strerror or exc} (versions are immutable; "
                            "publish again in a second)") from exc


def check_model_dir(model_dir: Path, lineage: Lineage, trust_model: bool | str = False) -> None:
    """RegistryError unless ``model_dir`` holds an export that loads and that ``lineage`` describes."""
    try:
        _, config = load_exported(model_dir / WEIGHTS_FILE, trust_model)
    except (ExportError, ModelImportError) as exc:
        raise RegistryError(f"{model_dir} is not a publishable model: {exc}") from exc
    if lineage.model_sha256 != config["sha256"]:
        raise RegistryError(f"the lineage given for {model_dir} describes weights with sha256 "
                            f"{lineage.model_sha256[:16] or '(none)'}..., but {WEIGHTS_FILE} has "
                            f"{config['sha256'][:16]}...: publish the lineage.json exported with the model")


def fetch_model(location: str, fs: fsspec.AbstractFileSystem, cache: str | Path) -> Path:
    """A local directory with the model files (and lineage.json when there is one) at ``location``."""
    if isinstance(fs, LocalFileSystem):
        return Path(location.removeprefix("file://")).expanduser()
    target = Path(cache) / hashlib.sha256(location.encode()).hexdigest()[:20]
    if (target / WEIGHTS_FILE).is_file():
        return target  # a registry version never changes; another champion URI gets another directory
    partial = target.with_name(f"{target.name}.{uuid.uuid4().hex[:8]}.partial")
    partial.mkdir(parents=True)
    try:
        for name in (*MODEL_FILES, LINEAGE_FILE):
            if name == LINEAGE_FILE and not fs.exists(f"{location}/{name}"):
                continue
            fs.get_file(f"{location}/{name}", str(partial / name))
        os.rename(partial, target)
    except FileNotFoundError as exc:
        raise RegistryError(f"{location} holds no exported model ({exc}): give a directory with "
                            f"{' and '.join(MODEL_FILES)}") from exc
    except OSError:
        if not (target / WEIGHTS_FILE).is_file():  # not a download racing ours to the same target
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


@dataclass
class Champion:
    """The model in service, as a local directory, with where it came from and its published lineage."""

    directory: Path
    origin: str  # the champion input as given, or "<registry>/<version> (latest)"
    lineage: Lineage | None  # None for an export written before lineage existed


def resolve_champion(champion: str | None, registry: Registry, cache: str | Path,
                     fs: fsspec.AbstractFileSystem | None = None) -> Champion | None:
    """The ``champion`` input (an export directory, its model.safetensors, or a URI of either; ``fs``
    reaches it), else the registry's latest version, else None: the first promotion has no champion."""
    if champion:
        location = champion.rstrip("/").removesuffix(f"/{WEIGHTS_FILE}")
        directory = fetch_model(location, fs or fsspec.core.url_to_fs(location)[0], cache)
        origin = champion
    else:
        version = registry.latest()
        if version is None:
            return None
        directory, origin = registry.fetch(version, cache), f"{registry.uri}/{version} (latest)"
    if not (directory / WEIGHTS_FILE).is_file():
        raise RegistryError(f"champion {origin} holds no {WEIGHTS_FILE}: give an export directory (the model "
                            "output of a pipeline run) or a registry version directory")
    lineage_path = directory / LINEAGE_FILE
    try:
        lineage = Lineage.load(lineage_path) if lineage_path.is_file() else None
    except LineageError as exc:
        raise RegistryError(f"champion {origin}: {exc}") from exc
    return Champion(directory, origin, lineage)


def _summary(registry: Registry, version: str) -> str:
    lineage = registry.lineage(version)
    accuracy = "-" if lineage.test_accuracy is None else f"{lineage.test_accuracy:.4f}"
    fingerprint = lineage.source_fingerprint.rsplit(":", 1)[-1][:12] or "-"  # the digest, not its scheme
    return (f"{version}  test accuracy {accuracy} ({lineage.test_count} samples)  step "
            f"{lineage.checkpoint_step}  source {lineage.source} [{fingerprint}]  config "
            f"{lineage.config_hash[:12] or '-'}  {lineage.code_version or '-'}")


def _listing(registry: Registry) -> str:
    """The versions, oldest first, ``*`` marking latest; a ``latest`` that names no complete version is
    shown with the rollback that repairs it."""
    if registry.local and not Path(registry.root).exists():
        return (f"{registry.uri} does not exist: no promotion has published there yet (or the path is "
                "mistyped)")
    versions, latest = registry.versions(), registry.pointer()
    if not versions:
        return f"{registry.uri} holds no published version yet: a promotion publishes the first one"
    lines = [f"{'*' if version == latest else ' '} {_summary(registry, version)}" for version in versions]
    header = f"{registry.uri}: {len(versions)} version(s), latest {latest} (*)"
    if latest not in versions:
        header = (f"{registry.uri}: {len(versions)} version(s); latest names {latest!r}, which is not one of "
                  f"them: point it at one with python -m traincore.registry rollback {registry.uri} VERSION")
    return "\n".join([header, *lines])


def run_command(args: argparse.Namespace) -> str:
    """What the CLI prints for ``args``; RegistryError for what it cannot do."""
    registry = Registry(args.uri)
    if registry.local and Path(registry.root).exists() and not Path(registry.root).is_dir():
        raise RegistryError(f"the registry {registry.uri} is not a directory: give the directory a promotion "
                            "publishes into (its promoted_uri)")
    if args.command == "list":
        return _listing(registry)
    if args.command == "show":
        return registry.lineage(args.version).to_json()
    if args.command == "rollback":
        previous = registry.pointer()
        registry.set_latest(args.version)
        return f"{registry.uri}: latest -> {args.version} (was {previous})"
    model_dir = Path(args.model_dir)
    try:
        lineage = Lineage.load(model_dir / LINEAGE_FILE)
    except LineageError as exc:
        raise RegistryError(f"{model_dir} cannot be published: {exc}") from exc
    return f"{registry.uri}: published {registry.publish(model_dir, lineage, trust_from_args(args))} (latest)"


def _run_on_store(args: argparse.Namespace) -> str:
    """:func:`run_command`, with an object store's own errors as a RegistryError that names the registry
    and the fix: botocore, gcsfs and adlfs raise classes of their own, not OSError, for missing credentials
    and unreachable endpoints (`list s3://...` without credentials ended in an 80-line traceback)."""
    try:
        return run_command(args)
    except RegistryError:
        raise
    except Exception as exc:
        if not is_uri(args.uri):
            raise
        raise RegistryError(f"the registry {args.uri} cannot be read or written ({error_reason(exc)}): "
                            f"{STORE_ACCESS_FIX}") from exc


def main(argv: list[str] | None = None) -> int:
    """CLI: list, show, rollback, publish; exit code 2 with the reason on stderr when it cannot."""
    parser = argparse.ArgumentParser(prog="python -m traincore.registry", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="versions, oldest first; * marks latest").add_argument(
        "uri", type=path_argument)
    for name, text in (("show", "print a version's lineage.json"),
                       ("rollback", "point latest at an earlier (or any complete) version")):
        command = commands.add_parser(name, help=text)
        command.add_argument("uri", type=path_argument)
        command.add_argument("version")
    publish = commands.add_parser("publish", help="publish an exported model directory and make it latest")
    publish.add_argument("uri", type=path_argument)
    publish.add_argument("model_dir", type=local_path_argument,
                         help="holds model.safetensors, model.json and lineage.json")
    add_trust_flags(publish)
    args = parser.parse_args(argv)
    try:
        with logging_setup("WARNING", rank=None, library_tracebacks=False):
            print(_run_on_store(args))
    except (RegistryError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0

