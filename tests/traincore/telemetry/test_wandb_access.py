"""W&B online mode without a way to its server: refused in preflight, fast and in one line; a W&B run that
does not start at run time is one clear line too. Every server here is on localhost: no test reaches out."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from ports import closed_port
from wandb_server import WandbStub

from traincore.config.presets import debug
from traincore.run.preflight import preflight
from traincore.telemetry.wandb_access import WANDB_PROBE_TIMEOUT_S, WandbError, check_wandb_reachable

SECRET = "local-0123456789abcdef0123456789abcdef01234567"  # a well-formed key of a local W&B server
TINY = {"model": {"name": "small_cnn", "width": 8}, "loader": {"batch_size": 8},
        "telemetry": {"log_every": 1, "tensorboard": False, "wandb_mode": "online"}}
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


@pytest.fixture(autouse=True)
def _isolated_wandb(monkeypatch, tmp_path):
    """A well-formed key, no proxy from the machine's environment, W&B's homes inside tmp_path."""
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.delenv("WANDB_API_KEY_FILE", raising=False)
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_online_mode_without_a_way_to_the_server_fails_preflight_fast_and_names_the_fix(
        synthetic_dir, tmp_path, monkeypatch):
    port = closed_port()
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    config = debug().with_overrides({"telemetry.wandb_mode": "online", "telemetry.tensorboard": False})
    started = time.monotonic()
    with pytest.raises(WandbError) as caught:
        preflight(config, synthetic_dir, tmp_path / "run")
    assert time.monotonic() - started < WANDB_PROBE_TIMEOUT_S
    message = str(caught.value)
    assert "\n" not in message and SECRET not in message
    for part in (f"cannot reach the W&B server http://127.0.0.1:{port}",
                 f"127.0.0.1:{port}: connection refused", "telemetry.wandb_mode='offline'",
                 "wandb sync <output>/wandb/offline-run-*", "WANDB_BASE_URL"):
        assert part in message, (part, message)
    assert not (tmp_path / "run" / "wandb").exists()


def test_the_train_cli_reports_it_in_one_line_before_training(data_dir, tmp_path):
    env = {**os.environ, "WANDB_BASE_URL": f"http://127.0.0.1:{closed_port()}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "traincore.train", "--data", str(data_dir), "--output",
           str(tmp_path / "run"), "--preset", "debug", "--max-steps", "2", "--config", json.dumps(TINY)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert errors[0].startswith("error: telemetry.wandb_mode='online' but this machine cannot reach")
    assert "Traceback" not in done.stderr and "wandb sync" in errors[0], done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_listening_server_passes_and_other_modes_never_probe(monkeypatch, listening_port):
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{listening_port}/")
    check_wandb_reachable("online")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")
    check_wandb_reachable("offline")
    check_wandb_reachable("disabled")


def test_the_proxy_is_probed_when_the_environment_routes_through_one(monkeypatch, listening_port):
    """W&B's cloud through a proxy: the proxy is what must answer (no test reaches api.wandb.ai)."""
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    proxy = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("HTTPS_PROXY", proxy)
    with pytest.raises(WandbError, match=f"server https://api.wandb.ai through the proxy {proxy} "
                                         r"\(127.0.0.1:\d+: connection refused\)"):
        check_wandb_reachable("online")
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{listening_port}")
    check_wandb_reachable("online")
    # A server NO_PROXY exempts, or one on this machine, is reached directly, as wandb reaches it.
    monkeypatch.setenv("HTTP_PROXY", proxy)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://localhost:{listening_port}")
    check_wandb_reachable("online")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://wandb.internal.example:{listening_port}")
    monkeypatch.setenv("NO_PROXY", "wandb.internal.example")
    with pytest.raises(WandbError) as caught:  # the name resolves nowhere here, or the lookup has no answer
        check_wandb_reachable("online", timeout_s=1.0)
    assert f"(wandb.internal.example:{listening_port}: " in str(caught.value)
    assert "through the proxy" not in str(caught.value)


@pytest.mark.parametrize("url", ["http://:8080", "http://127.0.0.1:99999", "https://host:port"])
def test_a_base_url_that_names_no_server_is_refused(monkeypatch, url):
    monkeypatch.setenv("WANDB_BASE_URL", url)
    with pytest.raises(WandbError, match=f"WANDB_BASE_URL='{url}' is not a server's URL"):
        check_wandb_reachable("online")


def test_a_run_the_server_refuses_is_one_line_with_wandbs_reason(tmp_path, monkeypatch):
    """Reachable, but the server refuses the key: wandb.init's CommError becomes one line with its cause."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), WandbStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setenv("WANDB_BASE_URL", base)
    script = ("import sys; from traincore.config.schema import TelemetryConfig; "
              "from traincore.telemetry.sinks import WandbSink; "
              "WandbSink(sys.argv[1], TelemetryConfig(wandb_mode='online'), {}).resumed_at(0)")
    try:
        # In a child: wandb.init leaves its service process running in the process that called it.
        done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], capture_output=True,
                              text=True, timeout=120)
    finally:
        server.shutdown()
    errors = [line for line in done.stderr.splitlines()
              if line.startswith("traincore.telemetry.wandb_access.WandbError")]
    assert done.returncode == 1 and len(errors) == 1, done.stderr
    error = errors[0]
    assert f"W&B could not start the online run (server {base}, project 'flyte-torch-pipeline'): " \
           "unauthorized. Check the API key" in error and "wandb sync" in error
    assert "wandb.errors" not in done.stderr and "CommError" not in done.stderr, done.stderr
    assert SECRET not in done.stderr

