#!/usr/bin/env bash
# Creates or updates the Kubernetes Secrets the pipeline reads on a Flyte cluster (docs/deploy.md).
#
# No value is written in this file: each comes from an environment variable or a file you name and
# reaches kubectl on its standard input, never on a command line (which other users see in `ps`).
# Running it again updates the Secrets. Each Secret is written only when its inputs are set, and the ones
# left out are named on stderr. Every input is checked before anything is written: a missing partner
# variable, an unreadable file or a bad name stops it with one "error:" line and exit status 2.
# With none of the inputs below set it writes nothing and stops with an error naming them (exit 2), as
# that is most often a shell that lacks the exports; ALLOW_NONE=1 makes that a success (automation that
# passes on whatever it holds).
#
#   EXEC_NAMESPACES       namespaces where the workflow's pods run, space-separated: Flyte runs a
#                         project's tasks in <project>-<domain> (default: flytesnacks-development)
#   CONNECTOR_NAMESPACE   namespace of deploy/connector.yaml (default: flyte)
#
#   FLYTE_AWS_ACCESS_KEY_ID, FLYTE_AWS_SECRET_ACCESS_KEY, optional FLYTE_AWS_ENDPOINT (S3-compatible
#       stores such as MinIO; a URL with http:// or https://, e.g. http://minio:9000): flytekit's
#       object-store settings -> Secret object-store-env in all those namespaces. Task pods get its keys
#       as environment variables through propeller's default-env-from-secrets, the connector through its
#       envFrom; the connector forwards them to each Slurm job.
#   WANDB_API_KEY -> Secret wandb, key api_key, in EXEC_NAMESPACES: the Flyte secret wandb/api_key that
#       the train task mounts as a file when telemetry.wandb_mode is "online".
#   STORE_SECRET with STORE_AWS_ACCESS_KEY_ID and STORE_AWS_SECRET_ACCESS_KEY -> Secret $STORE_SECRET,
#       keys aws_access_key_id and aws_secret_access_key, in EXEC_NAMESPACES: the Flyte secret that the
#       workflow input store_secret names (a checkpoint store with credentials of its own). A Kubernetes
#       Secret name (lower case, digits, '-' and '.', each '.'-separated part starting and ending with a
#       letter or digit, at most 253), and not one of the names above or below, which this script writes.
#   SLURM_SSH_KEY, SLURM_KNOWN_HOSTS, SLURM_SSH_CONFIG (file paths) -> Secret slurm, keys ssh_key,
#       known_hosts and config, in CONNECTOR_NAMESPACE: the connector's SSH identity, the verified host
#       keys of the login nodes, and a Host entry (HostName, User, Port) per slurm_target.
set -euo pipefail

PROG=create-secrets.sh
fail() { echo "$PROG: error: $*" >&2; exit 2; }

if [[ $# -gt 0 ]]; then
    if [[ $1 == -h || $1 == --help ]]; then
        awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
        exit 0
    fi
    fail "$0 takes no arguments, only environment variables: see $0 --help"
fi

# Every variable that holds a Secret's value or names its file (the header above says which Secret).
INPUTS=(FLYTE_AWS_ACCESS_KEY_ID FLYTE_AWS_SECRET_ACCESS_KEY FLYTE_AWS_ENDPOINT WANDB_API_KEY
        STORE_SECRET STORE_AWS_ACCESS_KEY_ID STORE_AWS_SECRET_ACCESS_KEY
        SLURM_SSH_KEY SLURM_KNOWN_HOSTS SLURM_SSH_CONFIG)

exec_namespaces=${EXEC_NAMESPACES:-flytesnacks-development}
connector_namespace=${CONNECTOR_NAMESPACE:-flyte}

# The Secrets this script writes under names of its own (the pods and deploy/connector.yaml read them by
# these names), and the variables that fill them; STORE_SECRET may name none of them.
store_env_secret=object-store-env
wandb_secret=wandb
slurm_secret=slurm
declare -A own_secret_inputs=(
    [$store_env_secret]="FLYTE_AWS_ACCESS_KEY_ID, FLYTE_AWS_SECRET_ACCESS_KEY, FLYTE_AWS_ENDPOINT"
    [$wandb_secret]="WANDB_API_KEY"
    [$slurm_secret]="SLURM_SSH_KEY, SLURM_KNOWN_HOSTS, SLURM_SSH_CONFIG"
)

# secret NAMESPACE NAME KEY=env:VARIABLE|KEY=file:PATH...: write one Secret, print its keys (not values).
secret() {
    local namespace=$1 name=$2 entry key source keys=()
    shift 2
    for entry in "$@"; do
        keys+=("${entry%%=*}")
    done
    # --server-side: a client-side apply would copy the values into an annotation of the Secret.
    if ! {
        printf 'apiVersion: v1\nkind: Secret\ntype: Opaque\nmetadata:\n  name: %s\n  namespace: %s\ndata:\n' \
            "$name" "$namespace"
        for entry in "$@"; do
            key=${entry%%=*} source=${entry#*=}
            if [[ $source == env:* ]]; then
                source=${source#env:}
                # printf is a builtin: the value reaches base64 on a pipe, never as an argument.
                printf '  %s: %s\n' "$key" "$(printf %s "${!source}" | base64 | tr -d '\n')"
            else
                printf '  %s: %s\n' "$key" "$(base64 < "${source#file:}" | tr -d '\n')"
            fi
        done
    } | kubectl apply --server-side --force-conflicts -f - >/dev/null; then
        echo "$PROG: error: kubectl could not write the Secret $namespace/$name (its message is above): check" \
            "that kubectl's context is the cluster's (kubectl config current-context) and that the namespace" \
            "$namespace exists" >&2
        exit 1
    fi
    echo "secret $namespace/$name: ${keys[*]}"
}

# is_set VARIABLE: the variable is set and not empty.
is_set() { [[ -n ${!1:-} ]]; }

# needs VARIABLE PARTNER SECRET: VARIABLE is set, so PARTNER must be too.
needs() {
    is_set "$2" || fail "$1 is set but $2 is not: the Secret $3 needs both; export $2 too, or unset $1"
}

# readable VARIABLE: the variable names a file that can be read, or stop.
readable() {
    if [[ -z ${!1:-} ]]; then
        fail "$1 is not set: the Secret slurm needs SLURM_SSH_KEY, SLURM_KNOWN_HOSTS and SLURM_SSH_CONFIG" \
            "(file paths); export all three"
    fi
    if [[ ! -f ${!1} || ! -r ${!1} ]]; then
        fail "$1=${!1}: not a readable file; give the path of the file itself"
    fi
    if [[ ! -s ${!1} ]]; then
        fail "$1=${!1}: the file is empty; give the file that holds it"
    fi
}

# Every input is checked first, so that a mistake in one leaves all Secrets as they were.
set_inputs=()
for variable in "${INPUTS[@]}"; do
    if is_set "$variable"; then set_inputs+=("$variable"); fi
done
if ((${#set_inputs[@]} == 0)); then
    if [[ ${ALLOW_NONE:-} == 1 ]]; then
        echo "$PROG: none of ${INPUTS[*]} is set: no Secret written (ALLOW_NONE=1)" >&2
        exit 0
    fi
    fail "none of the variables this script reads is set (${INPUTS[*]}), so it would write no Secret:" \
        "export those of the Secrets you need ($0 --help says which is which), or set ALLOW_NONE=1 when" \
        "writing nothing is intended"
fi

# A namespace is a DNS label (RFC 1123); kubectl would refuse the Secret only after the ones before it.
namespace_label='^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$'
read -r -a exec_namespace_list <<<"$exec_namespaces"
((${#exec_namespace_list[@]} > 0)) || fail "EXEC_NAMESPACES is blank: give the namespaces where the" \
    "workflow's pods run, space-separated, or unset it for flytesnacks-development"
for namespace in "${exec_namespace_list[@]}"; do
    [[ $namespace =~ $namespace_label ]] || fail "EXEC_NAMESPACES: '$namespace' is not a namespace name" \
        "(lower case, digits, '-', at most 63); Flyte runs a project's tasks in <project>-<domain>"
done
[[ $connector_namespace =~ $namespace_label ]] || fail "CONNECTOR_NAMESPACE=$connector_namespace is not a" \
    "namespace name (lower case, digits, '-', at most 63); the namespace of deploy/connector.yaml is flyte"

skipped=()
write_store=0
if is_set FLYTE_AWS_ACCESS_KEY_ID || is_set FLYTE_AWS_SECRET_ACCESS_KEY; then
    needs FLYTE_AWS_ACCESS_KEY_ID FLYTE_AWS_SECRET_ACCESS_KEY object-store-env
    needs FLYTE_AWS_SECRET_ACCESS_KEY FLYTE_AWS_ACCESS_KEY_ID object-store-env
    # botocore (flytekit's S3 client) takes an endpoint only as a URL with its scheme: one without would
    # be written without a word and fail in every pod that reads the store.
    for variable in "${INPUTS[@]}"; do
        if [[ $variable == *_ENDPOINT ]] && is_set "$variable" \
            && [[ ! ${!variable} =~ ^https?://[^/[:space:]][^[:space:]]*$ ]]; then
            example=http://minio:9000
            [[ ${!variable} == *://* || ${!variable} =~ [[:space:]] ]] || example=http://${!variable}
            fail "$variable=${!variable}: not an endpoint URL; botocore takes only an http:// or https://" \
                "URL without spaces: give e.g. $variable=$example (https:// where the store speaks TLS)"
        fi
    done
    write_store=1
elif is_set FLYTE_AWS_ENDPOINT; then
    fail "FLYTE_AWS_ENDPOINT is set but FLYTE_AWS_ACCESS_KEY_ID and FLYTE_AWS_SECRET_ACCESS_KEY are not: the" \
        "Secret object-store-env holds the endpoint with the keys; export both, or unset FLYTE_AWS_ENDPOINT"
else
    skipped+=("object-store-env (FLYTE_AWS_ACCESS_KEY_ID, FLYTE_AWS_SECRET_ACCESS_KEY)")
fi

is_set WANDB_API_KEY || skipped+=("wandb (WANDB_API_KEY)")

write_checkpoint_store=0
if is_set STORE_SECRET; then
    # The rule tasks/plan.py applies to the input store_secret: a Kubernetes Secret's name, a DNS-1123
    # subdomain (what kubectl would refuse only after the Secrets before it were written).
    if ((${#STORE_SECRET} > 253)) \
        || [[ ! $STORE_SECRET =~ ^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$ ]]; then
        fail "STORE_SECRET=$STORE_SECRET: not a Kubernetes Secret name (lower case, digits, '-' and '.'," \
            "each '.'-separated part starting and ending with a letter or digit, at most 253 characters);" \
            "give the name the workflow input store_secret names, e.g. checkpoint-store"
    fi
    # That Secret would be written twice, and the second write would drop the keys its readers need.
    if [[ -n ${own_secret_inputs[$STORE_SECRET]+set} ]]; then
        fail "STORE_SECRET=$STORE_SECRET names the Secret $STORE_SECRET that this script writes itself" \
            "(from ${own_secret_inputs[$STORE_SECRET]}), and one would replace the other: give the" \
            "checkpoint store's Secret another name (e.g. checkpoint-store), the same in the workflow input" \
            "store_secret"
    fi
    needs STORE_SECRET STORE_AWS_ACCESS_KEY_ID "$STORE_SECRET"
    needs STORE_SECRET STORE_AWS_SECRET_ACCESS_KEY "$STORE_SECRET"
    write_checkpoint_store=1
else
    for variable in STORE_AWS_ACCESS_KEY_ID STORE_AWS_SECRET_ACCESS_KEY; do
        if is_set "$variable"; then
            fail "$variable is set but STORE_SECRET is not: export STORE_SECRET=<the Secret's name, the one" \
                "the workflow input store_secret names>, or unset $variable"
        fi
    done
    skipped+=("the checkpoint store's (STORE_SECRET, STORE_AWS_ACCESS_KEY_ID, STORE_AWS_SECRET_ACCESS_KEY)")
fi

write_slurm=0
if is_set SLURM_SSH_KEY || is_set SLURM_KNOWN_HOSTS || is_set SLURM_SSH_CONFIG; then
    for variable in SLURM_SSH_KEY SLURM_KNOWN_HOSTS SLURM_SSH_CONFIG; do
        readable "$variable"
    done
    write_slurm=1
else
    skipped+=("slurm (SLURM_SSH_KEY, SLURM_KNOWN_HOSTS, SLURM_SSH_CONFIG)")
fi

command -v kubectl >/dev/null || fail "kubectl not found: install it and point its context at the cluster"

if ((write_store)); then
    store=(FLYTE_AWS_ACCESS_KEY_ID=env:FLYTE_AWS_ACCESS_KEY_ID
           FLYTE_AWS_SECRET_ACCESS_KEY=env:FLYTE_AWS_SECRET_ACCESS_KEY)
    if is_set FLYTE_AWS_ENDPOINT; then
        store+=(FLYTE_AWS_ENDPOINT=env:FLYTE_AWS_ENDPOINT)
    fi
    for namespace in "${exec_namespace_list[@]}" "$connector_namespace"; do
        secret "$namespace" "$store_env_secret" "${store[@]}"
    done
fi

if is_set WANDB_API_KEY; then
    for namespace in "${exec_namespace_list[@]}"; do
        secret "$namespace" "$wandb_secret" api_key=env:WANDB_API_KEY
    done
fi

if ((write_checkpoint_store)); then
    for namespace in "${exec_namespace_list[@]}"; do
        secret "$namespace" "$STORE_SECRET" aws_access_key_id=env:STORE_AWS_ACCESS_KEY_ID \
            aws_secret_access_key=env:STORE_AWS_SECRET_ACCESS_KEY
    done
fi

if ((write_slurm)); then
    secret "$connector_namespace" "$slurm_secret" ssh_key=file:"$SLURM_SSH_KEY" \
        known_hosts=file:"$SLURM_KNOWN_HOSTS" config=file:"$SLURM_SSH_CONFIG"
fi

for entry in "${skipped[@]}"; do
    echo "$PROG: not written, its inputs are not set: $entry" >&2
done
