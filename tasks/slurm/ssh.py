"""SSH to a Slurm login node with asyncssh: the user's ~/.ssh/config applied, host keys always verified.

``connect`` turns every failure (unknown host, wrong port, refused, unknown or changed host key, missing key,
rejected key, timeout) into a ``SlurmConnectionError`` that names the problem and the fix. Every network
step has a timeout, and nothing here exits the process.

asyncssh reads the OpenSSH config itself (Host and Match blocks, Include, HostName, Port, User, IdentityFile,
UserKnownHostsFile, ProxyJump): this module adds only what asyncssh leaves open, that a config can never turn
host key checking off, and the resolved settings for its error messages.

asyncssh is imported by the functions that use it, not by this module: tasks.plan and tasks.launch import
this module in every pod, and most pods never reach a Slurm cluster.
"""

from __future__ import annotations

import asyncio
import errno
import getpass
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.slurm.states import SlurmError

if TYPE_CHECKING:
    import asyncssh
    from asyncssh.config import SSHClientConfig

log = logging.getLogger(__name__)


class SlurmConnectionError(SlurmError):
    """The SSH connection to the Slurm login node could not be made or was lost."""


@dataclass(frozen=True)
class SlurmTarget:
    """Where the Slurm login node is and how to reach it.

    ``host`` is a Host alias from ``~/.ssh/config`` (its HostName, Port, User and IdentityFile apply) or a
    hostname. ``port``/``user``/``key_file`` override the config. ``known_hosts`` defaults to what the ssh
    config names (UserKnownHostsFile), else ``~/.ssh/known_hosts``. With ``key_file`` set only that key is
    offered (no agent keys), so what authenticates is predictable.
    """

    host: str
    port: int | None = None
    user: str | None = None
    key_file: str | None = None
    known_hosts: str | None = None
    connect_timeout_s: float = 20.0
    command_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.host or any(ch.isspace() for ch in self.host):
            raise ValueError(f"SlurmTarget.host must be an ssh Host alias or a hostname, got {self.host!r}")
        if self.port is not None and not 0 < self.port < 65536:
            raise ValueError(f"SlurmTarget.port must be between 1 and 65535, got {self.port}")
        if self.connect_timeout_s <= 0 or self.command_timeout_s <= 0:
            raise ValueError("SlurmTarget timeouts must be positive seconds, got "
                             f"connect_timeout_s={self.connect_timeout_s}, "
                             f"command_timeout_s={self.command_timeout_s}")


@dataclass(frozen=True)
class _Endpoint:
    """Where an alias really points once the ssh config is applied (for error messages)."""

    alias: str
    host: str
    port: int
    user: str
    aliased: bool  # the ssh config makes it a Host alias: a wrong Port or HostName is fixed there

    def __str__(self) -> str:
        via = f" (Host alias {self.alias!r})" if self.alias != self.host else ""
        return f"{self.user}@{self.host}:{self.port}{via}"


def ssh_config(host: str, config_path: str | os.PathLike[str] | None = None) -> SSHClientConfig:
    """asyncssh's reading of ``~/.ssh/config`` (or ``config_path``) for ``host``: the Host and Match blocks
    that apply to it, Include followed, exactly as ``asyncssh.connect`` applies them. A missing or unreadable
    file counts as empty (as in asyncssh and OpenSSH); one asyncssh cannot parse raises
    ``SlurmConnectionError`` naming the file and line."""
    from asyncssh.config import SSHClientConfig

    path = Path(config_path) if config_path else Path("~/.ssh/config").expanduser()
    try:
        local_user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no USER: only 'Match localuser' and %u need it
        local_user = ""
    paths = [path] if os.access(path, os.R_OK) else []
    try:
        # The arguments asyncssh.connect passes: no earlier config, no reload, not canonicalised, not the
        # 'Match final' pass; () leaves User and Port to the config.
        return SSHClientConfig.load(None, paths, False, False, False, local_user, (), host, ())
    except (OSError, ValueError) as exc:
        raise SlurmConnectionError(f"cannot read the ssh config {path}: {exc}") from None


def _names_an_alias(config: SSHClientConfig) -> bool:
    """The config points the name elsewhere (HostName) or reaches it through a jump host or proxy command:
    what a Host alias does. A block that only sets User or Port for a real hostname is not an alias."""
    return any(config.get(option) for option in ("Hostname", "ProxyJump", "ProxyCommand"))


def host_alias_known(alias: str, config_path: str | os.PathLike[str] | None = None) -> bool:
    """True when ``~/.ssh/config`` (or ``config_path``) makes ``alias`` a Host alias: a Host or Match block
    that applies to it sets HostName, ProxyJump or ProxyCommand. A pre-flight check that a configured alias
    was not mistyped, read by asyncssh as the connection will read it."""
    return _names_an_alias(ssh_config(alias, config_path))


def _known_hosts_db(target: SlurmTarget, configured: Any) -> tuple[asyncssh.SSHKnownHosts, list[str]]:
    """The known_hosts entries to verify against, read from the files that apply, and those files.

    Reading them here (not leaving it to asyncssh) makes sure verification can never be switched off:
    asyncssh treats ``known_hosts=None`` (which ``UserKnownHostsFile none`` in ssh config produces) as
    'accept any key'.
    """
    import asyncssh

    if target.known_hosts:
        files = [os.path.expanduser(target.known_hosts)]
        if not os.path.isfile(files[0]):
            raise SlurmConnectionError(
                f"known_hosts file {files[0]} does not exist: create it with the server's verified host key "
                f"(ssh-keyscan -p PORT HOST > {files[0]}) or leave SlurmTarget.known_hosts unset")
    elif configured is None:
        raise SlurmConnectionError(
            f"the ssh config for {target.host!r} disables host key checking (UserKnownHostsFile none); this "
            "client always verifies host keys: remove that line or set SlurmTarget.known_hosts")
    elif configured in ((), [], b""):
        files = [os.path.expanduser("~/.ssh/known_hosts")]
    else:
        entries = [configured] if isinstance(configured, str) else list(configured)
        files = [os.path.expanduser(str(entry)) for entry in entries]
    existing = [path for path in files if os.path.isfile(path)]
    db = asyncssh.read_known_hosts(existing) if existing else asyncssh.import_known_hosts("")
    return db, files


async def _client_options(target: SlurmTarget) -> tuple[asyncssh.SSHClientConnectionOptions, _Endpoint,
                                                        list[str]]:
    """asyncssh options: ~/.ssh/config applied, our overrides, and a known_hosts that is always checked."""
    import asyncssh

    kwargs: dict[str, Any] = {"connect_timeout": target.connect_timeout_s,
                              "login_timeout": target.connect_timeout_s}
    if target.port is not None:
        kwargs["port"] = target.port
    if target.user:
        kwargs["username"] = target.user
    if target.key_file:
        key_path = os.path.expanduser(target.key_file)
        if not os.path.isfile(key_path):
            raise SlurmConnectionError(
                f"SSH key file {key_path} does not exist: point key_file at an existing private key, or "
                f"leave it unset to use ssh-agent / the IdentityFile of Host {target.host!r} in "
                "~/.ssh/config")
        kwargs.update(client_keys=[key_path], agent_path=None)
    try:
        # config=() loads ~/.ssh/config as asyncssh.connect does (the options default, None, loads nothing)
        options = await asyncssh.SSHClientConnectionOptions.construct(config=(), host=target.host, **kwargs)
    except asyncssh.KeyImportError as exc:
        raise SlurmConnectionError(
            f"cannot load the SSH private key for {target.host!r}: {exc}. An encrypted key must be loaded "
            "into ssh-agent (ssh-add) and key_file left unset") from None
    except FileNotFoundError as exc:
        raise SlurmConnectionError(
            f"{exc.filename} does not exist but the ssh config for {target.host!r} names it (IdentityFile or "
            "CertificateFile in ~/.ssh/config): fix the path there, or set SlurmTarget.key_file") from None
    except (OSError, ValueError) as exc:
        raise SlurmConnectionError(f"invalid SSH settings for {target.host!r} (ssh config or SlurmTarget): "
                                   f"{exc}") from None
    db, files = _known_hosts_db(target, options.known_hosts)
    options = await asyncssh.SSHClientConnectionOptions.construct(options, known_hosts=db)
    # asyncssh's resolved settings: its options and the config object it parsed for this host
    endpoint = _Endpoint(target.host, options.host, options.port, options.username,
                         _names_an_alias(options.config))
    return options, endpoint, files


def _host_key_message(endpoint: _Endpoint, files: list[str]) -> str:
    """Unknown versus changed host key: both refused, with the fix for each."""
    import asyncssh

    pattern = endpoint.host if endpoint.port == 22 else f"[{endpoint.host}]:{endpoint.port}"
    target_file = files[0] if files else "~/.ssh/known_hosts"
    existing = [path for path in files if os.path.isfile(path)]
    try:
        db = asyncssh.read_known_hosts(existing) if existing else asyncssh.import_known_hosts("")
        known = bool(db.match(endpoint.host, "", endpoint.port)[0])
    except (OSError, ValueError):
        known = False
    if known:
        return (f"the host key of {endpoint} has CHANGED: it differs from the one in {', '.join(existing)}. "
                "This may be an attack; if the server was reinstalled, verify its new key, then remove the "
                f"old entry (ssh-keygen -R '{pattern}' -f {target_file}) and add the new one "
                f"(ssh-keyscan -p {endpoint.port} {endpoint.host} >> {target_file})")
    return (f"the host key of {endpoint} is not known (not in {', '.join(files) or target_file}); host keys "
            "are always verified. After checking its fingerprint, add it: "
            f"ssh-keyscan -p {endpoint.port} {endpoint.host} >> {target_file}")


def _is_refused(exc: OSError) -> bool:
    """asyncio reports several refused addresses (::1 and 127.0.0.1) as one OSError without errno."""
    return isinstance(exc, ConnectionRefusedError) or exc.errno == errno.ECONNREFUSED or (
        exc.errno is None and f"[Errno {errno.ECONNREFUSED}]" in str(exc))


def _connection_error(exc: BaseException, endpoint: _Endpoint, files: list[str], timeout_s: float) -> str:
    """A message that names the problem with this connection attempt and how to fix it."""
    import asyncssh

    fix_port = (f"Port for Host {endpoint.alias!r} in ~/.ssh/config or SlurmTarget.port"
                if endpoint.aliased else "SlurmTarget.port (or a Host alias, ~/.ssh/config)")
    if isinstance(exc, asyncssh.HostKeyNotVerifiable):
        return _host_key_message(endpoint, files)
    if isinstance(exc, asyncssh.PermissionDenied):
        return (f"authentication failed for {endpoint}: the server accepted none of the offered keys. Check "
                f"User and IdentityFile for Host {endpoint.alias!r} in ~/.ssh/config (or SlurmTarget.user / "
                "key_file) and that the public key is in the remote ~/.ssh/authorized_keys")
    if isinstance(exc, asyncio.TimeoutError):
        return (f"no SSH connection to {endpoint} within {timeout_s:g} s: the host or port is wrong, the "
                f"host is down, or a firewall drops the packets. Check HostName and {fix_port}")
    if isinstance(exc, socket.gaierror):
        return (f"cannot resolve host {endpoint.host!r} ({exc.strerror}): use a Host alias defined in "
                "~/.ssh/config or a resolvable hostname")
    if isinstance(exc, OSError) and _is_refused(exc):
        return (f"connection refused by {endpoint.host}:{endpoint.port}: nothing listens on that port. Check "
                f"{fix_port}, and that sshd runs there")
    if isinstance(exc, OSError):
        return f"cannot reach {endpoint}: {exc}. Check HostName and {fix_port}"
    if isinstance(exc, asyncssh.DisconnectError):
        return (f"the SSH handshake with {endpoint} failed ({exc.reason}): is {endpoint.port} an SSH port? "
                f"Check {fix_port}")
    return f"SSH connection to {endpoint} failed: {type(exc).__name__}: {exc}"


async def connect(target: SlurmTarget) -> asyncssh.SSHClientConnection:
    """Open an SSH connection to the Slurm login node, host key verified, within ``connect_timeout_s``.

    Raises ``SlurmConnectionError`` with a specific message for every failure; never exits the process.
    """
    import asyncssh

    options, endpoint, files = await _client_options(target)
    log.info("connecting to Slurm login node %s", endpoint)
    try:
        # asyncssh bounds TCP connect + handshake + auth by connect_timeout; the outer bound is a backstop.
        return await asyncio.wait_for(asyncssh.connect(target.host, options=options),
                                      timeout=target.connect_timeout_s + 5)
    except (OSError, asyncssh.Error, asyncio.TimeoutError) as exc:
        message = _connection_error(exc, endpoint, files, target.connect_timeout_s)
        raise SlurmConnectionError(message) from None

