"""scripts/register (`make register`) before and after pyflyte: it checks its settings and that the cluster's
endpoint takes a connection before pyflyte runs, and when pyflyte register fails it ends with one line that
names the cause. ``pyflyte`` is a stand-in (PYFLYTE) that logs its arguments and prints what a real run
printed; the endpoint is a local port that is closed, or one that listens.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from ports import closed_port

REPO = Path(__file__).resolve().parents[2]
REGISTER = REPO / "scripts" / "register"
IMAGE = "ghcr.io/acme/flyte-torch-pipeline:v1"
# The end of what pyflyte register printed against a port where nothing answers gRPC (flytekit's rich
# tracebacks, shortened; rich keeps the space where it wraps a line, \x20): the exception chain's last two
# messages are the cause.
PYFLYTE_FAILURE = """\
Registering against 127.0.0.1:{port}
╭───────────────────── Traceback (most recent call last) ──────────────────────╮
│ /venv/lib/python3.11/site-packages/grpc/_interceptor.py:314 in continuation  │
╰──────────────────────────────────────────────────────────────────────────────╯
_InactiveRpcError: <_InactiveRpcError of RPC that terminated with:
        status = StatusCode.UNAVAILABLE
>

The above exception was the direct cause of the following exception:

╭───────────────────── Traceback (most recent call last) ──────────────────────╮
│ /venv/lib/python3.11/site-packages/flytekit/exceptions/utils.py:36           │
╰──────────────────────────────────────────────────────────────────────────────╯
FlyteSystemUnavailableException: Flyte cluster is currently unavailable. Please\x20
make sure the cluster is up and running.

The above exception was the direct cause of the following exception:

╭───────────────────── Traceback (most recent call last) ──────────────────────╮
│ /venv/lib/python3.11/site-packages/grpc/_interceptor.py:276 in __call__      │
╰──────────────────────────────────────────────────────────────────────────────╯
RuntimeError: Failed to get signed url for\x20
fast08bb18e6054b5dba099888a2f90cd3ab.tar.gz.
"""


def ini_config(path: Path, port: int) -> Path:
    path.write_text(f"[platform]\nurl = 127.0.0.1:{port}\ninsecure = True\n")
    return path


def stub_pyflyte(tmp_path: Path, output: str = "", status: int = 0) -> Path:
    (tmp_path / "pyflyte-output.txt").write_text(output)
    pyflyte = tmp_path / "pyflyte"
    pyflyte.write_text(f'#!/bin/sh\necho "$*" >> "{tmp_path}/pyflyte.log"\n'
                       f'cat "{tmp_path}/pyflyte-output.txt"\nexit {status}\n')
    pyflyte.chmod(0o755)
    return pyflyte


def pyflyte_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "pyflyte.log"
    return log.read_text().splitlines() if log.exists() else []


def register(pyflyte: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k.lower() not in ("grpc_proxy", "https_proxy", "http_proxy", "flyte_platform_url")}
    return subprocess.run([str(REGISTER), "--image", IMAGE, *args], capture_output=True, text=True,
                          timeout=60, env={**base, "PYFLYTE": str(pyflyte), **env})


def error_lines(run: subprocess.CompletedProcess) -> list[str]:
    return [line for line in run.stderr.splitlines() if "error:" in line]


def test_an_unreachable_endpoint_stops_it_before_pyflyte_with_one_line(tmp_path):
    port = closed_port()
    config = ini_config(tmp_path / "cluster.config", port)
    run = register(stub_pyflyte(tmp_path), "--config", str(config))
    assert run.returncode == 2
    assert error_lines(run) == [
        f"register: error: the Flyte endpoint 127.0.0.1:{port} ([platform] url of {config}) is not reachable "
        f"(connection refused): start the cluster, port-forward flyteadmin's gRPC port to {port} (kubectl -n "
        f"<its namespace> port-forward svc/<flyteadmin service> {port}:<its port>), or pass CONFIG=<the "
        f"pyflyte config of a cluster you can reach>"]
    assert pyflyte_calls(tmp_path) == []  # no traceback pages: pyflyte never ran


def test_make_register_checks_the_endpoint_of_config(tmp_path):
    port = closed_port()
    config = ini_config(tmp_path / "cluster.config", port)
    run = subprocess.run(["make", "--no-print-directory", "register", f"IMAGE={IMAGE}", f"CONFIG={config}",
                          f"BIN={Path(sys.executable).parent}"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0
    [line] = [line for line in run.stderr.splitlines() if line.startswith("register: error:")]
    assert f"the Flyte endpoint 127.0.0.1:{port} ([platform] url of {config}) is not reachable" in line


@pytest.mark.parametrize("source", ["yaml", "environment", "default"])
def test_the_endpoint_is_the_one_pyflyte_uses(tmp_path, source):
    """flytekit's order: FLYTE_PLATFORM_URL, then the config (YAML: admin.endpoint), then localhost:30080."""
    port = closed_port()
    env = {}
    if source == "yaml":
        config = tmp_path / "config.yaml"
        config.write_text(f"admin:\n  # flytectl's format\n  endpoint: dns:///127.0.0.1:{port}\n"
                          "  insecure: true\n")
        where, endpoint = f"admin.endpoint of {config}", f"dns:///127.0.0.1:{port}"
    elif source == "environment":
        config = tmp_path / "config.yaml"
        config.write_text("admin:\n  endpoint: dns:///flyte.example.com:443\n")
        env["FLYTE_PLATFORM_URL"] = endpoint = f"127.0.0.1:{port}"
        where = f"FLYTE_PLATFORM_URL, which overrides {config}"
    else:
        config = tmp_path / "empty.config"
        config.write_text("[platform]\ninsecure = True\n")
        where, endpoint = f"flytekit's default: {config} names no endpoint", "localhost:30080"
        with socket.socket() as probe:
            if probe.connect_ex(("localhost", 30080)) == 0:
                pytest.skip("something listens on localhost:30080 here (a sandbox)")
    run = register(stub_pyflyte(tmp_path), "--config", str(config), **env)
    assert run.returncode == 2
    [line] = error_lines(run)
    assert line.startswith(f"register: error: the Flyte endpoint {endpoint} ({where}) is not reachable"), line
    assert pyflyte_calls(tmp_path) == []


def test_a_failed_registration_ends_with_its_cause_in_one_line(tmp_path, listening_port):
    config = ini_config(tmp_path / "cluster.config", listening_port)
    run = register(stub_pyflyte(tmp_path, PYFLYTE_FAILURE.format(port=listening_port), status=1),
                   "--config", str(config))
    assert run.returncode == 1
    assert "RuntimeError: Failed to get signed url" in run.stdout  # pyflyte's own output is still shown
    assert run.stderr.splitlines()[-1] == (
        f"register: error: pyflyte register failed (exit 1) against 127.0.0.1:{listening_port}: "
        "RuntimeError: Failed to get signed url for fast08bb18e6054b5dba099888a2f90cd3ab.tar.gz. (cause: "
        "FlyteSystemUnavailableException: Flyte cluster is currently unavailable. Please make sure the "
        "cluster is up and running.)")


def test_a_reachable_endpoint_registers_and_prints_commands_to_paste(tmp_path, listening_port):
    config = ini_config(tmp_path / "my cluster.config", listening_port)  # a path with a space
    run = register(stub_pyflyte(tmp_path, "registered 3 entities\n"), "--config", str(config),
                   "--project", "team-a", "--version", "v1.2")
    assert run.returncode == 0, run.stderr
    [call] = pyflyte_calls(tmp_path)
    assert call == (f"--config {config} register --image {IMAGE} --project team-a --domain development "
                    "--version v1.2 --copy all workflows")
    commands = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in run.stderr.splitlines()
                if line.startswith(("==> registered. Launch a run", "==> activate"))}
    assert shlex.split(commands["==> registered. Launch a run"])[:3] == ["pyflyte", "--config", str(config)]
    assert shlex.split(commands["==> activate the weekly retraining schedule"]) == [
        "pyflyte", "--config", str(config), "launchplan", "--project", "team-a", "--domain", "development",
        "--activate", "scheduled_retraining"]


def test_the_printed_flytectl_command_can_be_pasted(tmp_path):
    package = tmp_path / "out dir" / "package.tgz"
    run = register(stub_pyflyte(tmp_path), "--package", str(package), "--version", "v1")
    assert run.returncode == 0, run.stderr
    [line] = [line for line in run.stderr.splitlines() if "register it with: " in line]
    assert shlex.split(line.split("register it with: ", 1)[1]) == [
        "flytectl", "register", "files", "--project", "flytesnacks", "--domain", "development", "--archive",
        str(package), "--version", "v1"]


def test_a_yaml_config_whose_path_has_a_space_is_read_as_yaml(tmp_path):
    """The file's kind is told by its name, not by the name as quoted for a message."""
    port = closed_port()
    config = tmp_path / "dir with space" / "c.yaml"
    config.parent.mkdir()
    config.write_text(f"admin:\n  endpoint: dns:///127.0.0.1:{port}\n  insecure: true\n")
    run = register(stub_pyflyte(tmp_path), "--config", str(config))
    assert run.returncode == 2
    [line] = error_lines(run)
    assert line.startswith(f"register: error: the Flyte endpoint dns:///127.0.0.1:{port} (admin.endpoint of "
                           f"{shlex.quote(str(config))}) is not reachable"), line
    assert pyflyte_calls(tmp_path) == []


def register_from(cwd: Path, pyflyte: str, *args: str) -> subprocess.CompletedProcess:
    """scripts/register run from CWD (not the repository root), PYFLYTE as given."""
    base = {k: v for k, v in os.environ.items()
            if k.lower() not in ("grpc_proxy", "https_proxy", "http_proxy", "flyte_platform_url", "pwd")}
    return subprocess.run([str(REGISTER), "--image", IMAGE, *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd, env={**base, "PYFLYTE": pyflyte})


def test_relative_paths_are_the_callers(tmp_path, listening_port):
    """--config, --package and PYFLYTE are relative to where it is run, not to the repository root."""
    cwd = tmp_path.resolve()
    stub_pyflyte(cwd)
    (cwd / "my.yaml").write_text(f"admin:\n  endpoint: dns:///127.0.0.1:{listening_port}\n")
    run = register_from(cwd, "./pyflyte", "--config", "my.yaml")
    assert run.returncode == 0, run.stderr
    [call] = pyflyte_calls(cwd)
    assert call.startswith(f"--config {cwd}/my.yaml register --image {IMAGE} "), call
    # The commands printed for pasting name it as given: they are pasted where it was typed.
    assert "pyflyte --config my.yaml launchplan" in run.stderr

    run = register_from(cwd, "./pyflyte", "--package", "out/pkg.tgz", "--version", "v1")
    assert run.returncode == 0, run.stderr
    assert pyflyte_calls(cwd)[-1].endswith(f" --output {cwd}/out/pkg.tgz")  # not into the repository
    assert (cwd / "out").is_dir() and not (REPO / "out").exists()
    assert "--archive out/pkg.tgz --version v1" in run.stderr

    run = register_from(cwd, "./pyflyte", "--config", "missing.yaml")
    assert run.returncode == 2
    assert error_lines(run) == ["register: error: config missing.yaml not found: pass CONFIG=<your pyflyte "
                                "config> (flyte.config targets a local sandbox)"]


@pytest.mark.parametrize("args, line", [
    (["--image", "ghcr.io/Acme/ftp:v1"], "register: error: IMAGE=ghcr.io/Acme/ftp:v1 is not a valid image "
                                         "name: upper-case letters in the repository path 'Acme/ftp'; use "
                                         "lower case: ghcr.io/acme/ftp:v1"),
    (["--image", "ghcr.io/acme/ftp:"], "register: error: IMAGE=ghcr.io/acme/ftp: is not a valid image name: "
                                      "the tag after the last ':' is empty"),
    (["--project", "Team_A"], "register: error: PROJECT=Team_A is not a Flyte project id"),
    (["--domain", "dev elopment"], "register: error: DOMAIN='dev elopment' is not a Flyte domain"),
    (["--version", "v1 rc"], "register: error: VERSION='v1 rc' has white space: give one word"),
    (["--config", "no-such.config"], "register: error: config no-such.config not found: pass CONFIG="),
    (["--frobnicate"], "register: error: unknown option --frobnicate"),
])
def test_bad_settings_are_refused_with_one_line_before_pyflyte(tmp_path, args, line):
    run = register(stub_pyflyte(tmp_path), *args)
    assert run.returncode == 2
    [error] = error_lines(run)
    assert error.startswith(line), error
    assert pyflyte_calls(tmp_path) == []


@pytest.mark.parametrize("mode", ["register", "package"])
def test_a_missing_pyflyte_is_named(tmp_path, listening_port, mode):
    config = ini_config(tmp_path / "cluster.config", listening_port)
    args = ["--config", str(config)] if mode == "register" else ["--package", str(tmp_path / "p.tgz")]
    run = register(tmp_path / "no-such-pyflyte", *args)
    assert run.returncode == 2
    assert error_lines(run) == [f"register: error: pyflyte not found (PYFLYTE={tmp_path}/no-such-pyflyte): "
                                "run make install, or set PYFLYTE to the pyflyte of the environment with "
                                "this project"]
