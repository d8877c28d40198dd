#!/usr/bin/env bash
# Creates or updates the Kubernetes Secrets the pipeline reads on a Flyte cluster (docs/deploy.md).
#
# No value is written in this file: each comes from an environment variable or a file you name and
# reaches kubectl on its standard input, never on a command line (which other users see in `ps`).
# Running it again updates the Secrets. Each Secret is written only when its inputs are set.
#
#   EXEC_NAMESPACES       namespaces where the workflow's pods run, space-separated: Flyte runs a
#                         project's tasks in <project>-<domain> (default: flytesnacks-development)
#   CONNECTOR_NAMESPACE   namespace of deploy/connector.yaml (default: flyte)
#
#   FLYTE_AWS_ACCESS_KEY_ID, FLYTE_AWS_SECRET_ACCESS_KEY, optional FLYTE_AWS_ENDPOINT (S3-compatible
#       stores such as MinIO): flytekit's object-store settings -> Secret object-store-env in all those
#       namespaces. Task pods get its keys as environment variables through propeller's
#       default-env-from-secrets, the connector through its envFrom; the connector forwards them to
#       each Slurm job.
#   WANDB_API_KEY -> Secret wandb, key api_key, in EXEC_NAMESPACES: the Flyte secret wandb/api_key that
#       the train task mounts as a file when telemetry.wandb_mode is "online".
#   STORE_SECRET with STORE_AWS_ACCESS_KEY_ID and STORE_AWS_SECRET_ACCESS_KEY -> Secret $STORE_SECRET,
#       keys aws_access_key_id and aws_secret_access_key, in EXEC_NAMESPACES: the Flyte secret that the
#       workflow input store_secret names (a checkpoint store with credentials of its own).
#   SLURM_SSH_KEY, SLURM_KNOWN_HOSTS, SLURM_SSH_CONFIG (file paths) -> Secret slurm, keys ssh_key,
#       known_hosts and config, in CONNECTOR_NAMESPACE: the connector's SSH identity, the verified host
#       keys of the login nodes, and a Host entry (HostName, User, Port) per slurm_target.
set -euo pipefail

if [[ $# -gt 0 ]]; then
    if [[ $1 == -h || $1 == --help ]]; then
        awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
        exit 0
    fi
    echo "$0 takes no arguments, only environment variables: see $0 --help" >&2
    exit 2
fi

exec_namespaces=${EXEC_NAMESPACES:-flytesnacks-development}
connector_namespace=${CONNECTOR_NAMESPACE:-flyte}

# secret NAMESPACE NAME KEY=env:VARIABLE|KEY=file:PATH...: write one Secret, print its keys (not values).
secret() {
    local namespace=$1 name=$2 entry key source keys=()
    shift 2
    for entry in "$@"; do
        keys+=("${entry%%=*}")
    done
    {
        printf 'apiVersion: v1\nkind: Secret\ntype: Opaque\nmetadata:\n  name: %s\n  namespace: %s\ndata:\n' \
            "$name" "$namespace"
        for entry in "$@"; do
            key=${entry%%=*} source=${entry#*=}
            if [[ $source == env:* ]]; then
                source=${source#env:}
                printf '  %s: %s\n' "$key" "$(printf %s "${!source}" | base64 | tr -d '\n')"
            else
                printf '  %s: %s\n' "$key" "$(base64 < "${source#file:}" | tr -d '\n')"
            fi
        done
    } | kubectl apply --server-side --force-conflicts -f - >/dev/null
    # --server-side: a client-side apply would copy the values into an annotation of the Secret.
    echo "secret $namespace/$name: ${keys[*]}"
}

# readable VARIABLE: the variable names a file that can be read, or stop.
readable() {
    if [[ -z ${!1:-} ]]; then
        echo "$1 is not set: the Secret slurm needs SLURM_SSH_KEY, SLURM_KNOWN_HOSTS and SLURM_SSH_CONFIG" >&2
        exit 1
    fi
    if [[ ! -f ${!1} || ! -r ${!1} ]]; then
        echo "$1=${!1}: not a readable file" >&2
        exit 1
    fi
}

if [[ -n ${FLYTE_AWS_ACCESS_KEY_ID:-}${FLYTE_AWS_SECRET_ACCESS_KEY:-} ]]; then
    : "${FLYTE_AWS_ACCESS_KEY_ID:?is needed with FLYTE_AWS_SECRET_ACCESS_KEY}"
    : "${FLYTE_AWS_SECRET_ACCESS_KEY:?is needed with FLYTE_AWS_ACCESS_KEY_ID}"
    store=(FLYTE_AWS_ACCESS_KEY_ID=env:FLYTE_AWS_ACCESS_KEY_ID
           FLYTE_AWS_SECRET_ACCESS_KEY=env:FLYTE_AWS_SECRET_ACCESS_KEY)
    if [[ -n ${FLYTE_AWS_ENDPOINT:-} ]]; then
        store+=(FLYTE_AWS_ENDPOINT=env:FLYTE_AWS_ENDPOINT)
    fi
    for namespace in $exec_namespaces "$connector_namespace"; do
        secret "$namespace" object-store-env "${store[@]}"
    done
fi

if [[ -n ${WANDB_API_KEY:-} ]]; then
    for namespace in $exec_namespaces; do
        secret "$namespace" wandb api_key=env:WANDB_API_KEY
    done
fi

if [[ -n ${STORE_SECRET:-} ]]; then
    # The rule tasks/plan.py applies to the input store_secret: a Kubernetes Secret's name.
    if [[ ! $STORE_SECRET =~ ^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$ ]]; then
        echo "STORE_SECRET=$STORE_SECRET: not a Kubernetes Secret name (lower case, digits, '-', '.')" >&2
        exit 1
    fi
    : "${STORE_AWS_ACCESS_KEY_ID:?is needed with STORE_SECRET}"
    : "${STORE_AWS_SECRET_ACCESS_KEY:?is needed with STORE_SECRET}"
    for namespace in $exec_namespaces; do
        secret "$namespace" "$STORE_SECRET" aws_access_key_id=env:STORE_AWS_ACCESS_KEY_ID \
            aws_secret_access_key=env:STORE_AWS_SECRET_ACCESS_KEY
    done
fi

if [[ -n ${SLURM_SSH_KEY:-}${SLURM_KNOWN_HOSTS:-}${SLURM_SSH_CONFIG:-} ]]; then
    for variable in SLURM_SSH_KEY SLURM_KNOWN_HOSTS SLURM_SSH_CONFIG; do
        readable "$variable"
    done
    secret "$connector_namespace" slurm ssh_key=file:"$SLURM_SSH_KEY" \
        known_hosts=file:"$SLURM_KNOWN_HOSTS" config=file:"$SLURM_SSH_CONFIG"
fi
