"""tasks.slurm.client without a cluster: state parsing for every Slurm job state in every output format, and
the SSH side against an in-process asyncssh server that answers like a Slurm login node.

Fixtures in tests/tasks/slurm/fixtures/ (README.md there lists them too):
- captured verbatim from Slurm 22.05.8 (Debian's slurm-wlm, the loopback cluster of scripts/slurm-loopback):
  the files named ``*-22.05.8.txt``;
- written from Slurm's documentation and data_parser source (no such cluster here): the ``*.json`` files
  (23.02: ``job_state`` a string, ``exit_code`` an object with a plain ``return_code``; 24.05: ``job_state``
  a list, numbers as ``{"set", "infinite", "number"}``) and ``sacct-*.txt``. TIMEOUT is not captured
  (a 1-minute limit is too slow for a test): its text line is the captured COMPLETED line with the state,
  reason and exit code changed.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import asyncssh
import pytest

from tasks.slurm.client import NodeSize, SlurmClient
from tasks.slurm.ssh import SlurmConnectionError, SlurmTarget, connect, host_alias_known
from tasks.slurm.states import (
    JobInfo,
    JobNotFoundError,
    Outcome,
    SlurmError,
    classify_states,
    normalise_state,
    parse_exit_code,
    parse_sacct,
    parse_scontrol_json,
    parse_scontrol_text,
    parse_slurm_version,
)

DATA = Path(__file__).parent / "fixtures"

Q, R, S, F, T, A = (Outcome.QUEUED, Outcome.RUNNING, Outcome.SUCCEEDED, Outcome.FAILED, Outcome.RETRYABLE,
                    Outcome.ABORTED)

# Every job state word of Slurm 22.05 to 24.x (base states and state flags) and the outcome it must map to,
# written out here independently of the module's own tables.
EXPECTED = {
    "PENDING": Q, "CONFIGURING": Q, "POWER_UP_NODE": Q, "REQUEUED": Q, "REQUEUE_FED": Q, "REQUEUE_HOLD": Q,
    "RESV_DEL_HOLD": Q, "EXPEDITING": Q,
    "SUSPENDED": R, "STOPPED": R, "SIGNALING": R, "STAGE_OUT": R, "UPDATE_DB": R, "RUNNING": R,
    "COMPLETING": R, "RESIZING": R,
    "COMPLETED": S,
    "CANCELLED": A, "REVOKED": A,
    "FAILED": F, "OUT_OF_MEMORY": F, "SPECIAL_EXIT": F,
    "TIMEOUT": T, "DEADLINE": T, "NODE_FAIL": T, "PREEMPTED": T, "BOOT_FAIL": T, "LAUNCH_FAILED": T,
    "RECONFIG_FAIL": T,
}
BASE_STATES = {"PENDING", "RUNNING", "SUSPENDED", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL",
               "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}


def read(name: str) -> str:
    return (DATA / name).read_text()


def text_line(state: str, exit_code: str = "0:0") -> str:
    """The captured 22.05.8 COMPLETED line with another JobState (and ExitCode)."""
    line = read("scontrol-completed-22.05.8.txt").strip()
    line = line.replace("JobState=COMPLETED", f"JobState={state}")
    return line.replace("ExitCode=0:0", f"ExitCode={exit_code}")


def json_doc(job_state: object, **extra: object) -> str:
    job = {"job_id": 101, "job_state": job_state, "state_reason": "None", "node_count": 1,
           "standard_output": "/w/o.txt", "standard_error": "/w/e.txt", "exit_code": 0, **extra}
    return json.dumps({"jobs": [job], "errors": [], "warnings": []})


# ------------------------------------------------------------------------------------------- state tables


@pytest.mark.parametrize("state", sorted(EXPECTED))
def test_every_state_from_scontrol_text(state):
    info = parse_scontrol_text(text_line(state))
    assert (info.state, info.outcome, info.flags) == (state, EXPECTED[state], ())


@pytest.mark.parametrize("state", sorted(EXPECTED))
def test_every_state_from_scontrol_json_string(state):
    """Slurm 23.02 prints job_state as one string (job_state_string: a flag wins over the base state)."""
    info = parse_scontrol_json(json_doc(state), "101")
    assert (info.state, info.outcome) == (state, EXPECTED[state])


@pytest.mark.parametrize("state", sorted(BASE_STATES))
def test_every_base_state_from_scontrol_json_list(state):
    info = parse_scontrol_json(json_doc([state]), "101")
    assert (info.state, info.outcome, info.flags) == (state, EXPECTED[state], ())


# Slurm >= 23.11 lists the base state and its flags; the combinations below are the ones Slurm produces.
# The flag that Slurm's text output would show decides, so both forms of one job agree; LAUNCH_FAILED and
# RECONFIG_FAIL only count once the base state is final (while PENDING, Slurm requeues the job itself).
FLAG_LISTS = [
    (["COMPLETED", "COMPLETING"], "COMPLETED", R),
    (["FAILED", "COMPLETING"], "FAILED", R),
    (["RUNNING", "CONFIGURING"], "RUNNING", Q),
    (["RUNNING", "CONFIGURING", "POWER_UP_NODE"], "RUNNING", Q),
    (["RUNNING", "POWER_UP_NODE"], "RUNNING", Q),
    (["PENDING", "REQUEUED"], "PENDING", Q),
    (["COMPLETED", "COMPLETING", "REQUEUED"], "COMPLETED", R),
    (["PENDING", "REQUEUE_FED"], "PENDING", Q),
    (["PENDING", "REQUEUE_HOLD"], "PENDING", Q),
    (["PENDING", "RESV_DEL_HOLD"], "PENDING", Q),
    (["PENDING", "EXPEDITING"], "PENDING", Q),
    (["RUNNING", "STOPPED"], "RUNNING", R),
    (["RUNNING", "SIGNALING"], "RUNNING", R),
    (["COMPLETED", "STAGE_OUT"], "COMPLETED", R),
    (["PENDING", "UPDATE_DB"], "PENDING", Q),
    (["RUNNING", "UPDATE_DB"], "RUNNING", R),
    (["COMPLETED", "UPDATE_DB"], "COMPLETED", S),
    (["RUNNING", "RESIZING"], "RUNNING", R),
    (["PENDING", "SPECIAL_EXIT"], "PENDING", F),
    (["PENDING", "REVOKED"], "PENDING", A),
    (["NODE_FAIL", "LAUNCH_FAILED"], "NODE_FAIL", T),
    (["FAILED", "LAUNCH_FAILED"], "FAILED", T),
    (["PENDING", "LAUNCH_FAILED"], "PENDING", Q),
    (["FAILED", "RECONFIG_FAIL"], "FAILED", T),
    (["PENDING", "RECONFIG_FAIL", "REQUEUED"], "PENDING", Q),
    (["CANCELLED", "LAUNCH_FAILED"], "CANCELLED", T),
]


def test_flag_lists_cover_every_flag():
    covered = {word for words, _, _ in FLAG_LISTS for word in words}
    assert set(EXPECTED) - BASE_STATES <= covered


@pytest.mark.parametrize(("words", "state", "outcome"), FLAG_LISTS,
                         ids=["+".join(words) for words, _, _ in FLAG_LISTS])
def test_state_flags_from_scontrol_json_list(words, state, outcome):
    info = parse_scontrol_json(json_doc(words), "101")
    assert (info.state, info.outcome) == (state, outcome)
    assert info.flags == tuple(word for word in words if word != state)


@pytest.mark.parametrize("state", sorted(EXPECTED))
def test_every_state_from_sacct(state):
    info = parse_sacct(f"101|{state}|0:0|1|None\n", "101")
    assert (info.job_id, info.state, info.outcome) == ("101", state, EXPECTED[state])


@pytest.mark.parametrize(("raw", "state"), [("CANCELLED by 1000", "CANCELLED"), ("CANCELLED+", "CANCELLED"),
                                            ("OUT_OF_ME+", "OUT_OF_MEMORY"), ("completed", "COMPLETED"),
                                            (" RUNNING ", "RUNNING")])
def test_state_words_are_normalised(raw, state):
    assert normalise_state(raw) == state


def test_an_unknown_state_is_never_success():
    """While listed by scontrol an unknown state counts as RUNNING (sacct decides later); in sacct (finished
    jobs only) it is FAILED; an unknown flag next to COMPLETED does not make the job a success."""
    info = parse_scontrol_text(text_line("FROBNICATED"))
    assert (info.state, info.outcome) == ("FROBNICATED", R)
    assert "unrecognised Slurm job state FROBNICATED" in info.reason
    assert parse_sacct("101|FROBNICATED|0:0|1|None", "101").outcome is F
    assert parse_scontrol_json(json_doc(["COMPLETED", "NEW_FLAG"]), "101").outcome is R
    assert parse_scontrol_json(json_doc(["FAILED", "NEW_FLAG"]), "101").outcome is F
    assert parse_scontrol_json(json_doc("?"), "101").outcome is R  # job_state_string's own 'unknown'
    assert classify_states(["weird"], unknown=F)[2] is F


def test_no_state_at_all_is_an_error():
    with pytest.raises(SlurmError, match="no job state"):
        classify_states([])


# ------------------------------------------------------------------------------ captured 22.05.8 outputs


@pytest.mark.parametrize(("name", "state", "outcome", "exit_code", "reason"), [
    ("scontrol-completed-22.05.8.txt", "COMPLETED", S, 0, None),
    ("scontrol-failed-22.05.8.txt", "FAILED", F, 3, "NonZeroExitCode"),
    ("scontrol-cancelled-22.05.8.txt", "CANCELLED", A, 0, None),
    ("scontrol-running-22.05.8.txt", "RUNNING", R, 0, None),
    ("scontrol-pending-22.05.8.txt", "PENDING", Q, 0, "Resources"),
    ("scontrol-timeout-constructed.txt", "TIMEOUT", T, 0, "TimeLimit"),
])
def test_captured_scontrol_lines(name, state, outcome, exit_code, reason):
    info = parse_scontrol_text(read(name))
    assert (info.state, info.outcome, info.exit_code, info.reason) == (state, outcome, exit_code, reason)
    assert info.job_id.isdigit()
    assert info.stdout_path and info.stdout_path.startswith("/")
    assert info.stderr_path and info.stderr_path.startswith("/")
    assert info.node_count and info.node_count >= 1


def test_restart_count_is_read_from_text_and_json():
    assert parse_scontrol_text(read("scontrol-running-22.05.8.txt")).restarts == 0
    requeued = read("scontrol-pending-22.05.8.txt").replace("Restarts=0", "Restarts=2")
    assert parse_scontrol_text(requeued).restarts == 2
    document = {"jobs": [{"job_id": 9, "job_state": ["PENDING"], "restart_cnt": 1}]}
    assert parse_scontrol_json(json.dumps(document), "9").restarts == 1


def test_captured_cancelled_running_job_has_signal():
    info = parse_scontrol_text(read("scontrol-cancelled-22.05.8.txt"))
    assert info.signal == 15  # scancel sends SIGTERM: ExitCode=0:15


def test_captured_two_node_running_job():
    info = parse_scontrol_text(read("scontrol-running-22.05.8.txt"))
    assert info.node_count == 2


def test_captured_version():
    assert parse_slurm_version(read("scontrol-version-22.05.8.txt")) == (22, 5, 8)


@pytest.mark.parametrize(("text", "version"), [("slurm 23.02.7", (23, 2, 7)),
                                               ("slurm-wlm 24.05.1\n", (24, 5, 1)),
                                               ("slurm 25.05", (25, 5, 0))])
def test_versions(text, version):
    assert parse_slurm_version(text) == version


def test_unreadable_version():
    with pytest.raises(SlurmError, match="version"):
        parse_slurm_version("command not found")


# ------------------------------------------------------------------------------- JSON and sacct fixtures


def test_json_23_02_failed_job():
    info = parse_scontrol_json(read("scontrol-json-23.02-failed.json"), "4242")
    assert (info.job_id, info.state, info.outcome, info.exit_code, info.signal) == ("4242", "FAILED", F, 3, 0)
    assert (info.reason, info.node_count) == ("NonZeroExitCode", 2)
    assert info.stderr_path == "/home/user/runs/slurm-4242.err"


def test_json_24_05_completing_job():
    info = parse_scontrol_json(read("scontrol-json-24.05-completing.json"), "4243")
    assert (info.state, info.flags, info.outcome, info.exit_code) == ("COMPLETED", ("COMPLETING",), R, 0)
    assert info.node_count == 2


def test_json_24_05_signalled_job():
    info = parse_scontrol_json(read("scontrol-json-24.05-cancelled.json"), "4244")
    assert (info.state, info.outcome, info.exit_code, info.signal) == ("CANCELLED", A, 0, 15)


def test_json_picks_the_requested_job_and_reports_missing_ones():
    doc = json.loads(read("scontrol-json-24.05-completing.json"))
    doc["jobs"].insert(0, {**doc["jobs"][0], "job_id": 1, "job_state": ["RUNNING"]})
    assert parse_scontrol_json(json.dumps(doc), "4243").outcome is R
    assert parse_scontrol_json(json.dumps(doc), "4243").job_id == "4243"
    errors = [{"error": "Invalid job id specified", "error_number": 2017}]
    missing = json.dumps({"jobs": [], "errors": errors})
    with pytest.raises(JobNotFoundError):
        parse_scontrol_json(missing, "77")
    with pytest.raises(SlurmError, match="not JSON"):
        parse_scontrol_json("scontrol: unrecognized option '--json'", "77")


@pytest.mark.parametrize(("value", "expected"), [
    (3, (3, None)),
    ({"status": "ERROR", "return_code": 3, "signal": {"signal_id": 0, "name": ""}}, (3, 0)),
    ({"status": ["SIGNALED"], "return_code": {"set": True, "infinite": False, "number": 0},
      "signal": {"id": {"set": True, "infinite": False, "number": 9}, "name": "KILL"}}, (0, 9)),
    ({"status": ["PENDING"], "return_code": {"set": False, "infinite": False, "number": 0}}, (None, None)),
    ("2:0", (2, 0)),
])
def test_json_exit_code_shapes(value, expected):
    info = parse_scontrol_json(json_doc(["FAILED"], exit_code=value), "101")
    assert (info.exit_code, info.signal) == expected


@pytest.mark.parametrize(("text", "expected"), [("3:0", (3, 0)), ("0:15", (0, 15)), ("255:0", (255, 0)),
                                                ("", (None, None)), ("(null)", (None, None)),
                                                ("7", (7, None))])
def test_exit_codes(text, expected):
    assert parse_exit_code(text) == expected


def test_sacct_fixtures():
    failed = parse_sacct(read("sacct-failed.txt"), "4242")
    assert (failed.state, failed.outcome, failed.exit_code, failed.node_count) == ("FAILED", F, 3, 2)
    cancelled = parse_sacct(read("sacct-cancelled.txt"), "4244")
    assert (cancelled.state, cancelled.outcome, cancelled.signal) == ("CANCELLED", A, 15)
    oom = parse_sacct(read("sacct-out-of-memory.txt"), "4245")
    assert (oom.state, oom.outcome, oom.reason) == ("OUT_OF_MEMORY", F, None)
    with pytest.raises(JobNotFoundError):
        parse_sacct("", "1")


def test_text_values_may_hold_equals_signs_and_spaces():
    line = text_line("RUNNING") + " Comment=two words"
    info = parse_scontrol_text(line)
    assert info.outcome is R
    with pytest.raises(SlurmError, match="JobId"):
        parse_scontrol_text("slurm_load_jobs error: Invalid job id specified")


def test_jobinfo_finished():
    assert JobInfo("1", "COMPLETED", S).finished and not JobInfo("1", "RUNNING", R).finished


# ----------------------------------------------------------------------------------- targets and helpers


@pytest.mark.parametrize("kwargs", [{"host": ""}, {"host": "a b"}, {"host": "h", "port": 0},
                                    {"host": "h", "port": 70000}, {"host": "h", "connect_timeout_s": 0},
                                    {"host": "h", "command_timeout_s": -1}])
def test_target_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match="SlurmTarget"):
        SlurmTarget(**kwargs)


def test_host_alias_known(tmp_path):
    """asyncssh reads the config: an alias is a name that a Host or Match block points elsewhere (HostName)
    or reaches through a jump host; Include is followed, negated patterns and 'Host *' do not count."""
    included = tmp_path / "cluster.conf"
    included.write_text("Host from-include\n  HostName 10.0.0.2\n")
    config = tmp_path / "config"
    config.write_text(f"Include {included}\n"
                      "Host *\n  User x\n"
                      "Host slurm-* !slurm-bad\n  HostName %h.cluster.example\n"
                      "Host=login1 login2\n  ProxyJump bastion\n"
                      "Host plain.example\n  Port 2222\n"
                      "Match originalhost matched\n  HostName 10.0.0.1\n")
    for alias in ("slurm-a", "login2", "matched", "from-include"):
        assert host_alias_known(alias, config), alias
    assert not host_alias_known("slurm-bad", config)
    assert not host_alias_known("plain.example", config)  # settings for a real hostname, not an alias
    assert not host_alias_known("other", config)  # only 'Host *' matches
    assert not host_alias_known("x", tmp_path / "missing")
    config.write_text("Host broken\n  Port many\n")
    with pytest.raises(SlurmConnectionError, match=f"ssh config {config}: .*line 2.*Invalid Port"):
        host_alias_known("broken", config)


# --------------------------------------------------------------------------- in-process SSH "login node"

Handler = Callable[[str], Awaitable[tuple[str, str, int]] | tuple[str, str, int]]


@dataclass
class FakeLoginNode:
    """An asyncssh server on 127.0.0.1 that answers commands from a table and serves SFTP."""

    home: Path
    responses: list[tuple[str, Handler]] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)  # what sbatch commands got on stdin
    port: int = 0

    def on(self, prefix: str, stdout: str = "", stderr: str = "", status: int = 0,
           handler: Handler | None = None) -> None:
        """Answer commands that contain ``prefix`` (latest registration wins)."""
        self.responses.insert(0, (prefix, handler or (lambda _cmd: (stdout, stderr, status))))

    async def _process(self, process: asyncssh.SSHServerProcess) -> None:
        command = process.command or ""
        self.commands.append(command)
        if "sbatch --parsable" in command:  # the client feeds it the job's environment, then EOF
            self.inputs.append(await process.stdin.read())
        for prefix, handler in self.responses:
            if prefix in command:
                answer = handler(command)
                stdout, stderr, status = await answer if asyncio.iscoroutine(answer) else answer
                break
        else:
            stdout, stderr, status = "", f"sh: {command.split()[0]}: command not found\n", 127
        process.stdout.write(stdout)
        process.stderr.write(stderr)
        process.exit(status)


@dataclass
class Keys:
    host: asyncssh.SSHKey
    client_file: Path
    known_hosts: Path


def make_keys(root: Path, home: Path) -> Keys:
    host = asyncssh.generate_private_key("ssh-ed25519")
    client = asyncssh.generate_private_key("ssh-ed25519")
    client_file = root / "client_key"
    client.write_private_key(str(client_file))
    (root / "authorized_keys").write_bytes(client.export_public_key())
    return Keys(host, client_file, home / ".ssh" / "known_hosts")


def write_ssh_home(home: Path, keys: Keys, port: int, extra: str = "") -> None:
    """~/.ssh/config with alias 'fake-slurm' and known_hosts holding the server's key."""
    ssh = home / ".ssh"
    ssh.mkdir(parents=True, exist_ok=True)
    (ssh / "config").write_text(f"Host fake-slurm\n  HostName 127.0.0.1\n  Port {port}\n  User tester\n"
                                f"  IdentityFile {keys.client_file}\n  IdentitiesOnly yes\n{extra}")
    public = keys.host.export_public_key().decode().split()[:2]
    keys.known_hosts.write_text(f"[127.0.0.1]:{port} {' '.join(public)}\n")


@pytest.fixture
def ssh_home(tmp_path, monkeypatch) -> Path:
    """An isolated $HOME: the client reads ~/.ssh from here, never the user's."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return home


def with_login_node(home: Path, body: Callable[[FakeLoginNode, Keys], Awaitable[None]],
                    setup: Callable[[FakeLoginNode], None] | None = None) -> None:
    """Start the fake login node, write ~/.ssh for it, run ``body`` in the same event loop."""
    keys = make_keys(home.parent, home)

    async def main() -> None:
        node = FakeLoginNode(home)
        if setup:
            setup(node)
        server = await asyncssh.listen("127.0.0.1", 0, server_host_keys=[keys.host],
                                       authorized_client_keys=str(home.parent / "authorized_keys"),
                                       process_factory=node._process, sftp_factory=True)
        node.port = server.sockets[0].getsockname()[1]
        write_ssh_home(home, keys, node.port)
        try:
            await asyncio.wait_for(body(node, keys), timeout=60)
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def slurm_22_05(node: FakeLoginNode) -> None:
    node.on("scontrol --version", read("scontrol-version-22.05.8.txt"))


def test_connect_through_alias_and_run(ssh_home):
    async def body(node, keys):
        node.on("echo hi", "hi\n")
        node.on("command -v echo", "echo\n")
        node.on("sinfo -h -o '%P|%D'", read("sinfo-loopback-22.05.8.txt"))
        node.on("sinfo -h -N -o '%P|%N|%c|%m'", read("sinfo-nodes-loopback-22.05.8.txt"))
        async with SlurmClient(SlurmTarget("fake-slurm")) as slurm:
            assert await slurm.run("echo hi") == "hi\n"
            assert await slurm.partition_nodes() == await slurm.partition_nodes("debug") == 2
            assert await slurm.node_sizes() == [NodeSize("slb-node1", 8, 32768),
                                                NodeSize("slb-node2", 8, 32768)]
            with pytest.raises(SlurmError, match="exited with 127"):
                await slurm.run("nonexistent-tool")
            assert await slurm.missing_commands(["echo", "sbatch"]) == ["sbatch"]

    with_login_node(ssh_home, body)


def test_unknown_host_key_is_refused_with_the_fix(ssh_home):
    async def body(node, keys):
        empty = ssh_home / "empty_known_hosts"
        empty.write_text("")
        with pytest.raises(SlurmConnectionError) as caught:
            await connect(SlurmTarget("fake-slurm", known_hosts=str(empty)))
        message = str(caught.value)
        assert "is not known" in message and f"ssh-keyscan -p {node.port} 127.0.0.1 >> {empty}" in message

    with_login_node(ssh_home, body)


def test_changed_host_key_is_refused_and_named(ssh_home):
    async def body(node, keys):
        other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().split()[:2]
        keys.known_hosts.write_text(f"[127.0.0.1]:{node.port} {' '.join(other)}\n")
        with pytest.raises(SlurmConnectionError, match="CHANGED") as caught:
            await connect(SlurmTarget("fake-slurm"))
        assert f"ssh-keygen -R '[127.0.0.1]:{node.port}'" in str(caught.value)

    with_login_node(ssh_home, body)


def test_known_hosts_checking_cannot_be_switched_off(ssh_home):
    async def body(node, keys):
        config = ssh_home / ".ssh" / "config"
        config.write_text(config.read_text() + "  UserKnownHostsFile none\n")
        with pytest.raises(SlurmConnectionError, match="disables host key checking"):
            await connect(SlurmTarget("fake-slurm"))
        with pytest.raises(SlurmConnectionError, match="does not exist"):
            await connect(SlurmTarget("fake-slurm", known_hosts=str(ssh_home / "nope")))

    with_login_node(ssh_home, body)


def test_rejected_and_missing_keys(ssh_home):
    async def body(node, keys):
        stranger = ssh_home / "stranger_key"
        asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(stranger))
        with pytest.raises(SlurmConnectionError, match="authentication failed for tester@127.0.0.1"):
            await connect(SlurmTarget("fake-slurm", key_file=str(stranger)))
        with pytest.raises(SlurmConnectionError, match="key file .*missing_key does not exist"):
            await connect(SlurmTarget("fake-slurm", key_file=str(ssh_home / "missing_key")))
        conn = await connect(SlurmTarget("127.0.0.1", port=node.port, user="tester",
                                         key_file=str(keys.client_file)))  # no alias: explicit settings
        conn.close()

    with_login_node(ssh_home, body)


def test_missing_identity_file_named_by_the_ssh_config(ssh_home):
    (ssh_home / ".ssh").mkdir()
    (ssh_home / ".ssh" / "config").write_text("Host broken\n  HostName 127.0.0.1\n  IdentityFile ~/gone_key\n"
                                              "  IdentitiesOnly yes\n")
    with pytest.raises(SlurmConnectionError, match="gone_key does not exist but the ssh config for 'broken'"):
        asyncio.run(connect(SlurmTarget("broken", connect_timeout_s=3)))


def test_refused_port_and_unknown_host_fail_fast(ssh_home):
    async def body(node, keys):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free_port = probe.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(SlurmConnectionError, match=f"connection refused by 127.0.0.1:{free_port}.* "
                                                       "Port for Host 'fake-slurm' in ~/.ssh/config"):
            await connect(SlurmTarget("fake-slurm", port=free_port, connect_timeout_s=5))
        with pytest.raises(SlurmConnectionError, match="Check SlurmTarget.port"):  # no alias: no config fix
            await connect(SlurmTarget("127.0.0.1", port=free_port, connect_timeout_s=5))
        with pytest.raises(SlurmConnectionError, match="cannot resolve host 'no-such-host.invalid'"):
            await connect(SlurmTarget("no-such-host.invalid", connect_timeout_s=5))
        assert time.monotonic() - start < 5

    with_login_node(ssh_home, body)


def test_silent_server_times_out_within_the_bound(ssh_home):
    """A port that accepts TCP but never speaks SSH (or a black hole) must not hang the caller."""
    async def body(node, keys):
        silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = silent.sockets[0].getsockname()[1]
        start = time.monotonic()
        with pytest.raises(SlurmConnectionError, match="within 1.5 s"):
            await connect(SlurmTarget("fake-slurm", port=port, connect_timeout_s=1.5))
        assert time.monotonic() - start < 1.5 + 2
        silent.close()

    with_login_node(ssh_home, body)


def test_submit_uploads_the_script_and_returns_the_id(ssh_home, tmp_path):
    remote = tmp_path / "remote" / "runs"

    async def body(node, keys):
        node.on("sbatch --parsable", "warning: something harmless\n4242;loopback\n")
        async with SlurmClient(SlurmTarget("fake-slurm")) as slurm:
            job_id = await slurm.submit("#!/bin/bash\necho hi\n", str(remote),
                                        ["--nodes", "2", "--job-name", "a b"],
                                        {"AWS_SECRET_ACCESS_KEY": "s3cr3t-value"})
            with pytest.raises(ValueError, match="'BAD NAME'"):
                await slurm.submit("#!/bin/bash\n", str(remote), [], {"BAD NAME": "x"})
        assert job_id == "4242"
        command = node.commands[-1]
        assert command.startswith(f"cd {remote} && while IFS= read -r assignment; do export ")
        assert "&& sbatch --parsable --nodes 2 --job-name 'a b' job-" in command
        # The value travels on the channel's stdin, never in a command line or a file.
        assert node.inputs == ["AWS_SECRET_ACCESS_KEY=s3cr3t-value\n"] and "s3cr3t" not in command
        [script] = remote.glob("job-*.sbatch")
        assert script.read_text() == "#!/bin/bash\necho hi\n"

    with_login_node(ssh_home, body)


def test_sbatch_errors_carry_stderr(ssh_home, tmp_path):
    async def body(node, keys):
        node.on("sbatch", stderr=read("sbatch-invalid-partition-22.05.8.txt"), status=1)
        async with SlurmClient(SlurmTarget("fake-slurm")) as slurm:
            with pytest.raises(SlurmError, match="sbatch rejected the job .*invalid partition"):
                await slurm.submit("#!/bin/bash\n", str(tmp_path), ["--partition", "nope"])

    with_login_node(ssh_home, body)


def test_job_on_22_05_reads_text_then_sacct(ssh_home):
    """22.05: no --json; a forgotten job goes to sacct, which on a cluster without accounting says so."""
    async def body(node, keys):
        async with SlurmClient(SlurmTarget("fake-slurm")) as slurm:
            info = await slurm.job("38")
            assert (info.state, info.outcome, info.exit_code) == ("FAILED", F, 3)
            with pytest.raises(SlurmError, match="MinJobAge.*accounting is unavailable"):
                await slurm.job("99")
            with pytest.raises(ValueError, match="not a Slurm job id"):
                await slurm.job("1; rm -rf ~")
        assert not any("--json" in command for command in node.commands)
        assert sum("scontrol --version" in command for command in node.commands) == 1

    def setup(node):
        slurm_22_05(node)
        node.on("scontrol show job -o 38", read("scontrol-failed-22.05.8.txt"))
        node.on("scontrol show job -o 99", stderr=read("scontrol-invalid-job-22.05.8.txt"), status=1)
        node.on("sacct -j 99", stderr=read("sacct-no-accounting-22.05.8.txt"), status=1)

    with_login_node(ssh_home, body, setup)


def test_job_falls_back_to_sacct_when_accounting_exists(ssh_home):
    async def body(node, keys):
        async with SlurmClient(SlurmTarget("fake-slurm")) as slurm:
            info = await slurm.job("4242")
            assert (info.state, info.outcome, info.exit_code) == ("FAILED", F, 3)
            with pytest.raises(JobNotFoundError, match="neither to slurmctld nor to accounting"):
                await slurm.job("4243")

    def setup(node):
        slurm_22_05(node)
        node.on("scontrol show job", stderr="slurm_load_jobs error: Invalid job id specified\n", status=1)
        node.on("sacct -j 4242 -X --parsable2 --noheader --format JobID,State,ExitCode,NNodes,Reason",
                read("sacct-failed.txt"))
        node.on("sacct -j 4243", "")

    with_login_node(ssh_home, body, setup)


def test_job_uses_json_where_available(ssh_home):
    async def body(node, keys):
        async with SlurmClient(SlurmTarget("fake-slurm")) as slurm:
            first = await slurm.job("4243")
            second = await slurm.job("4243")
        assert first == second and (first.state, first.outcome) == ("COMPLETED", R)
        assert [c for c in node.commands if "show job" in c] == ["scontrol --json show job 4243"] * 2
        assert sum("--version" in c for c in node.commands) == 1

    def setup(node):
        node.on("scontrol --version", "slurm 24.05.4\n")
        node.on("scontrol --json show job 4243", read("scontrol-json-24.05-completing.json"))

    with_login_node(ssh_home, body, setup)


def test_json_that_does_not_work_falls_back_to_text_once(ssh_home):
    async def body(node, keys):
        async with SlurmClient(SlurmTarget("fake-slurm")) as slurm:
            assert (await slurm.job("38")).outcome is F
            assert (await slurm.job("38")).outcome is F
        assert sum("--json" in c for c in node.commands) == 1

    def setup(node):
        node.on("scontrol --version", "slurm 23.02.0\n")
        node.on("scontrol --json", stderr="scontrol: error: plugin serializer/json not found\n", status=1)
        node.on("scontrol show job -o 38", text_line("FAILED", "3:0"))

    with_login_node(ssh_home, body, setup)


def test_cancel_and_partitions(ssh_home):
    async def body(node, keys):
        async with SlurmClient(SlurmTarget("fake-slurm")) as slurm:
            await slurm.cancel("5")
            await slurm.cancel("6")  # already finished: fine
            with pytest.raises(SlurmError, match="Access/permission denied"):
                await slurm.cancel("7")
            assert await slurm.partition_nodes() == 2
            assert await slurm.partition_nodes("gpu") == 3
            with pytest.raises(SlurmError, match="no partition 'nope' .*debug, gpu"):
                await slurm.partition_nodes("nope")

    def setup(node):
        node.on("scancel 5", "")
        node.on("scancel 6", stderr="scancel: error: Kill job error on job id 6: Job/step already "
                                    "completing or completed\n", status=1)
        node.on("scancel 7", stderr="scancel: error: Kill job error on job id 7: Access/permission denied\n",
                status=1)
        node.on("sinfo -h -o '%P|%D'", read("sinfo-partitions.txt"))

    with_login_node(ssh_home, body, setup)


def test_node_sizes_of_a_partition_largest_first(ssh_home):
    async def body(node, keys):
        async with SlurmClient(SlurmTarget("fake-slurm")) as slurm:
            assert await slurm.node_sizes() == [NodeSize("c1", 32, 128000), NodeSize("c2", 32, 128000)]
            assert await slurm.node_sizes("gpu") == [NodeSize("g1", 64, 512000), NodeSize("g2", 48, 256000)]
            assert await slurm.node_sizes("nope") == []

    with_login_node(ssh_home, body, lambda node: node.on("sinfo -h -N -o '%P|%N|%c|%m'",
                                                         read("sinfo-nodes.txt")))


def test_tail_reads_last_lines_and_missing_files_are_empty(ssh_home, tmp_path):
    log_file = tmp_path / "job.err"
    log_file.write_text("".join(f"line {i}\n" for i in range(10)))

    async def run_locally(command):
        process = await asyncio.create_subprocess_shell(command, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE)
        out, err = await process.communicate()
        return out.decode(), err.decode(), process.returncode

    async def body(node, keys):
        async with SlurmClient(SlurmTarget("fake-slurm")) as slurm:
            assert await slurm.tail(str(log_file), 2) == "line 8\nline 9\n"
            assert await slurm.tail(str(tmp_path / "missing.err"), 5) == ""

    with_login_node(ssh_home, body, lambda node: node.on("if [ -f", handler=run_locally))


def test_commands_are_bounded_by_the_timeout(ssh_home):
    async def body(node, keys):
        async with SlurmClient(SlurmTarget("fake-slurm", command_timeout_s=1)) as slurm:
            start = time.monotonic()
            with pytest.raises(SlurmError, match="did not finish within 1 s"):
                await slurm.run("sleep-forever")
            assert time.monotonic() - start < 3

    async def hang(_command):
        await asyncio.sleep(30)
        return "", "", 0

    with_login_node(ssh_home, body, lambda node: node.on("sleep-forever", handler=hang))


def test_client_must_be_entered():
    with pytest.raises(SlurmError, match="not connected"):
        asyncio.run(SlurmClient(SlurmTarget("x")).run("true"))


def test_connector_reports_finished_jobs_and_remembers_only_the_newest(ssh_home, tmp_path, monkeypatch):
    """A connector service runs for months: the outcomes it keeps for local runs stay bounded."""
    from flytekit.models.core.execution import TaskExecutionPhase

    from tasks.slurm import connector as slurm_connector

    monkeypatch.setattr(slurm_connector, "LAST_KEPT", 2)

    def job_line(command: str) -> tuple[str, str, int]:
        job = command.split()[-1]
        state = "FAILED" if job == "7" else "COMPLETED"
        return text_line(state, "3:0" if job == "7" else "0:0").replace("JobId=5 ", f"JobId={job} "), "", 0

    async def body(node, keys):
        connector = slurm_connector.SlurmTrainConnector()
        phases = {}
        for job in ("6", "7", "8"):
            meta = slurm_connector.SlurmJobMeta(job_id=job, target="fake-slurm", output_prefix=str(tmp_path))
            resource = await connector.get(meta)
            phases[job] = resource.phase
        assert phases == {"6": TaskExecutionPhase.SUCCEEDED, "7": TaskExecutionPhase.FAILED,
                          "8": TaskExecutionPhase.SUCCEEDED}
        assert list(connector.last) == ["7", "8"]  # job 6, the oldest, was dropped
        failed = connector.last["7"]
        assert failed.outcome is Outcome.FAILED and failed.preempted_by is None
        assert "Slurm job 7 FAILED" in failed.message and "exit code 3" in failed.message
        # rank 0's summary line from the job's stdout
        assert "train: 200 steps" in connector.last["8"].message

    def setup(node):
        slurm_22_05(node)
        node.on("scontrol show job -o", handler=job_line)
        node.on("tail -n", "epoch 1 done\ntrain: 200 steps\n")

    with_login_node(ssh_home, body, setup)
