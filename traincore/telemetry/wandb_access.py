"""Whether W&B online mode can work on this machine, checked before any worker starts: its API key (present,
and of the shape wandb accepts) and its server (a connection opens within a few seconds).

Without these checks, a missing key or a pod without network egress would fail only once training has
begun, on rank 0, after wandb's own 90 s of retries, with a traceback through its service.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import threading
import urllib.parse
import urllib.request
from pathlib import Path


def resolve_wandb_key(mode: str) -> str | None:
    """The W&B API key for ``mode``: from WANDB_API_KEY or the file named by WANDB_API_KEY_FILE.

    Only "online" needs one; it raises ValueError without one or with one that is malformed
    (:func:`wandb_key_problem`), so the run fails before training. The key never appears in a message.
    """
    if mode != "online":
        return None
    key = os.environ.get("WANDB_API_KEY", "").strip()
    key_file = os.environ.get("WANDB_API_KEY_FILE", "")
    if not key and key_file:
        try:
            key = Path(key_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"WANDB_API_KEY_FILE={key_file!r} cannot be read ({exc.strerror}); "
                             "mount the secret at that path or set WANDB_API_KEY") from None
    if not key:
        raise ValueError("telemetry.wandb_mode='online' needs a W&B API key: set WANDB_API_KEY or "
                         "WANDB_API_KEY_FILE (a mounted secret file), or use wandb_mode='offline' "
                         "(no network, sync later) or 'disabled'")
    problem = wandb_key_problem(key)
    if problem:
        where = "WANDB_API_KEY" if os.environ.get("WANDB_API_KEY", "").strip() else (
            f"the file WANDB_API_KEY_FILE={key_file!r} names")
        raise ValueError(f"the W&B API key in {where} is malformed: {problem}. Copy the key again from "
                         "https://wandb.ai/authorize (a local server's key starts with 'local-') into "
                         "WANDB_API_KEY or the file WANDB_API_KEY_FILE names, with nothing around it; or use "
                         "telemetry.wandb_mode='offline' or 'disabled'")
    return key


# The shape of a W&B API key, as wandb itself checks it before any request (wandb 0.31.0,
# wandb/sdk/lib/wbauth/validation.py, check_api_key): a JWT (three base64url parts joined by dots), or an
# optional "<prefix>-" (keys of on-prem and local servers, e.g. "local-...") before a secret of at least 40
# letters, digits, underscores or dashes (cloud keys are 40 hex digits).
_WANDB_JWT = re.compile(r"[\w-]+\.[\w-]+\.[\w-]+")
_WANDB_SECRET = re.compile(r"[\w-]+")
WANDB_SECRET_MIN = 40


def wandb_key_problem(key: str) -> str | None:
    """What makes ``key`` no W&B API key by wandb's own format rule (above), or None; checked without any
    network, and the text never contains the key."""
    if _WANDB_JWT.fullmatch(key):
        return None
    secret = key.split("-", 1)[-1]  # wandb splits at the first dash, too
    if not _WANDB_SECRET.fullmatch(secret):
        return "it holds characters other than letters, digits, underscores and dashes (quotes, spaces?)"
    if len(secret) < WANDB_SECRET_MIN:
        return f"its secret part has {len(secret)} characters, a W&B key's has at least {WANDB_SECRET_MIN}"
    return None


WANDB_DEFAULT_BASE_URL = "https://api.wandb.ai"
WANDB_PROBE_TIMEOUT_S = 5.0
"""How long :func:`check_wandb_reachable` waits for the W&B server (name lookup and TCP connect); wandb
itself retries for ``init_timeout`` (90 s) before it gives up."""
WANDB_OFFLINE_FIX = ("set telemetry.wandb_mode='offline' (the run logs to <output>/wandb, in the train "
                     "task's logs output; upload it later from a machine with network access: wandb sync "
                     "<output>/wandb/offline-run-*) or 'disabled'")


class WandbError(ValueError):
    """W&B online mode cannot work here (its server is out of reach, or refuses the run); the message names
    the server, the cause and the fix."""


def wandb_base_url() -> str:
    """The W&B server wandb talks to: WANDB_BASE_URL, else W&B's cloud."""
    return os.environ.get("WANDB_BASE_URL", "").strip().rstrip("/") or WANDB_DEFAULT_BASE_URL


def check_wandb_reachable(mode: str, timeout_s: float = WANDB_PROBE_TIMEOUT_S) -> None:
    """For ``mode`` "online", WandbError unless a TCP connection to the W&B server (or to the proxy the
    environment routes it through: HTTPS_PROXY, HTTP_PROXY, NO_PROXY) opens within ``timeout_s``.

    Without this, a machine with no egress (a cluster pod, say) would fail only once training has begun,
    on rank 0, after wandb's own 90 s of retries."""
    if mode != "online":
        return
    base = wandb_base_url()
    target, via = _wandb_route(_url(base, "WANDB_BASE_URL", "https"))
    host, port = target.hostname, target.port or (443 if target.scheme == "https" else 80)
    problem = _connect_problem(host, port, timeout_s)
    if problem:
        raise WandbError(f"telemetry.wandb_mode='online' but this machine cannot reach the W&B server {base}"
                         f"{via} ({host}:{port}: {problem}); no network egress here? Either let it reach "
                         f"{host}:{port}, set WANDB_BASE_URL to a W&B server it can reach, or "
                         f"{WANDB_OFFLINE_FIX}")


def _wandb_route(server: urllib.parse.SplitResult) -> tuple[urllib.parse.SplitResult, str]:
    """Where wandb's connection to ``server`` goes first, and the words that say so: the proxy the
    environment names for its scheme, else the server itself. As in wandb's Go client (its net/http), NO_PROXY
    exempts a host, and a loopback one never goes through a proxy."""
    proxy = urllib.request.getproxies().get(server.scheme)
    if not proxy or _loopback(server.hostname) or urllib.request.proxy_bypass(server.hostname):
        return server, ""
    return _url(proxy, f"{server.scheme.upper()}_PROXY", "http"), f" through the proxy {proxy}"


def _url(text: str, name: str, scheme: str) -> urllib.parse.SplitResult:
    """``text`` (from the environment variable ``name``) parsed as a URL, ``scheme`` when it names none;
    WandbError unless it has a host and a valid port."""
    url = urllib.parse.urlsplit(text if "://" in text else f"{scheme}://{text}")
    try:
        if url.hostname and url.port != 0:  # .port raises ValueError for one out of range or not a number
            return url
    except ValueError:
        pass
    raise WandbError(f"{name}={text!r} is not a server's URL: set it to one with a host (and a port from 1 "
                     "to 65535, if any), or unset it")


def _loopback(host: str) -> bool:
    """Whether ``host`` is this machine: "localhost" or a loopback address."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost
        return False


def _connect_problem(host: str, port: int, timeout_s: float) -> str | None:
    """Why a TCP connection to ``host:port`` does not open within ``timeout_s``, or None once it does.

    In a thread, because the name lookup has no timeout of its own (a resolver that gets no answer retries
    for tens of seconds); the daemon thread is left to finish it on its own."""
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(None)
        except socket.gaierror as exc:
            outcome.append(f"the name does not resolve: {exc.strerror}")
        except TimeoutError:
            outcome.append(f"no answer within {timeout_s:g} s")
        except OSError as exc:
            outcome.append((exc.strerror or str(exc) or type(exc).__name__).lower())

    thread = threading.Thread(target=connect, name="wandb-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return outcome[0] if outcome else f"no answer within {timeout_s:g} s"
