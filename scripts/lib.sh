# shellcheck shell=bash
# Functions shared by scripts/build-image and scripts/register (sourced, not run). Both decide the same
# things about an image name, so each decision lives here once: whether the name is one a registry accepts,
# and whether its first part names a registry (what decides push or not, and what the cluster pulls from);
# and both take the paths they are given as the caller's, though they run from the repository root.
# Builtins only: sourcing it or calling its functions starts no program.

# image_registry REF: print the registry (host[:port]) that REF names and succeed, or fail when it names none.
# The rule podman and docker apply: the part before the first '/' is a registry when it has a dot or a port,
# or is localhost (ghcr.io/acme/name:tag, registry:5000/name, localhost/name); otherwise the whole name is a
# repository path (acme/name is docker.io's, or a local image's).
image_registry() {
    local first=${1%%/*}
    [[ $1 == */* && ( $first == *.* || $first == *:* || $first == localhost ) ]] || return 1
    printf '%s\n' "$first"
}

# absolute_path DIR PATH: PATH as an absolute path, a relative one taken as relative to DIR (the directory
# the user ran the script from, which the scripts leave for the repository root: a path they were given means
# what it meant where it was typed). An empty PATH stays empty (the option's "none"); nothing is resolved on
# disk, so a path that does not exist is still the one named.
absolute_path() {
    if [[ -z $2 || $2 == /* ]]; then
        printf '%s\n' "$2"
    else
        printf '%s/%s\n' "${1%/}" "$2"
    fi
}

# shell_quote ARG...: the arguments as one line that a shell reads back as the same words, for the commands
# and values the scripts print for copying and pasting. Like Python's shlex.quote: a word of safe characters
# stays as it is, any other is single-quoted; one with a control character takes printf %q's $'...' form,
# which keeps the line one line.
shell_quote() {
    local arg out=() q="'"
    for arg in "$@"; do
        if [[ $arg =~ ^[A-Za-z0-9@%+=:,./_-]+$ ]]; then
            out+=("$arg")
        elif [[ $arg =~ [[:cntrl:]] ]]; then
            out+=("$(printf '%q' "$arg")")
        else
            out+=("$q${arg//$q/$q\\$q$q}$q")
        fi
    done
    printf '%s\n' "${out[*]}"
}

# image_ref_problem REF: when REF is not an image reference by the OCI distribution grammar
# (github.com/distribution/reference), print what is wrong and how to fix it, "<what>; <fix>", and succeed;
# fail, printing nothing, when REF is valid. The grammar:
#   reference  := name [":" tag] ["@" digest]
#   name       := [registry "/"] path-component ["/" path-component]*      (at most 255 characters)
#   registry   := host [":" port]     host: DNS name (letters, digits, '-' inside, dots) or [IPv6]
#   path-component := [a-z0-9]+ (separator [a-z0-9]+)*       separator := "." | "_" | "__" | "-"+
#   tag        := [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}
#   digest     := algorithm ":" hex   e.g. sha256: and 64 lower-case hex digits
# A registry rejects anything else at push time, and podman at build time, after the build has run.
image_ref_problem() {
    local ref=$1 name tag="" digest="" has_tag=0 registry="" path rest component lower
    local example="ghcr.io/acme/flyte-torch-pipeline:v1"
    if [[ -z $ref ]]; then
        echo "it is empty; give <registry>/<name>:<tag>, e.g. $example"
        return 0
    fi
    if [[ $ref =~ [[:space:]] ]]; then
        echo "it contains white space; remove it (a name is one word: $example)"
        return 0
    fi
    if [[ $ref =~ [[:cntrl:]] ]]; then
        echo "it contains a control character; type the name again, e.g. $example"
        return 0
    fi
    name=$ref
    if [[ $name == *@* ]]; then
        digest=${name#*@} name=${name%%@*}
        if [[ $digest == *@* ]]; then
            echo "it has more than one '@'; keep one, before the digest (name@sha256:<64 hex digits>)"
            return 0
        fi
        if [[ -z $digest ]]; then
            echo "the digest after '@' is empty; add it (@sha256:<64 hex digits>) or drop the '@'"
            return 0
        fi
        if [[ $digest == sha256:* && ! $digest =~ ^sha256:[a-f0-9]{64}$ ]]; then
            echo "digest '$digest' is not sha256: and 64 lower-case hex digits; copy the digest" \
                "podman push or podman image inspect prints, or drop '@...'"
            return 0
        fi
        if [[ ! $digest =~ ^[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}$ ]]; then
            echo "'$digest' is not a digest (algorithm:hex, e.g. sha256:<64 hex digits>); fix it or drop '@...'"
            return 0
        fi
    fi
    # The tag follows the last ':' that comes after the last '/' (a ':' before it is the registry's port).
    if [[ ${name##*/} == *:* ]]; then
        has_tag=1
        tag=${name##*/} tag=${tag#*:}
        name=${name%:"$tag"}
    fi
    if ((has_tag)); then
        if [[ -z $tag ]]; then
            echo "the tag after the last ':' is empty; add one (${name}:v1) or drop the ':'"
            return 0
        fi
        if [[ $tag == *:* ]]; then
            echo "tag '$tag' contains ':'; a name has at most one tag, after its last ':' (${name}:v1)"
            return 0
        fi
        if ((${#tag} > 128)); then
            echo "tag '${tag:0:20}...' has ${#tag} characters; a tag has at most 128"
            return 0
        fi
        if [[ ! $tag =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]*$ ]]; then
            echo "tag '$tag' may hold only letters, digits, '_', '.' and '-', and must not start with '.'" \
                "or '-'; e.g. ${name}:v1"
            return 0
        fi
    fi
    if [[ -z $name ]]; then
        echo "the repository name before ':$tag' is empty; e.g. $example"
        return 0
    fi
    path=$name
    if registry=$(image_registry "$name"); then
        path=${name#*/}
        local host=$registry port=""
        if [[ $host =~ ^(.*):([^]:]*)$ ]]; then
            host=${BASH_REMATCH[1]} port=${BASH_REMATCH[2]}
            if [[ ! $port =~ ^[0-9]+$ ]]; then
                echo "registry '$registry': port '$port' is not a number; e.g. registry.example.com:5000/name:tag"
                return 0
            fi
        fi
        if [[ ! $host =~ ^\[[0-9A-Fa-f:.]+\]$ \
              && ! $host =~ ^[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*$ ]]
        then
            echo "registry host '$host' is not a DNS name (letters, digits and '-' between dots, no '-' at" \
                "either end of a part); e.g. ghcr.io or registry.example.com:5000"
            return 0
        fi
    fi
    rest=$path/
    while [[ -n $rest ]]; do
        component=${rest%%/*} rest=${rest#*/}
        if [[ -z $component ]]; then
            echo "the repository path '$path' has an empty part (a '/' at its start or end, or '//');" \
                "remove the extra '/'"
            return 0
        fi
        if [[ $component =~ [A-Z] ]]; then
            lower=${path,,}
            echo "upper-case letters in the repository path '$path'; use lower case: ${registry:+$registry/}$lower${tag:+:$tag}"
            return 0
        fi
        if [[ $component =~ [^a-z0-9._-] ]]; then
            echo "the repository path '$path' has the character '${BASH_REMATCH[0]}'; a path holds only" \
                "lower-case letters, digits, '/', and the separators '.', '_', '__' and '-'"
            return 0
        fi
        if [[ ! $component =~ ^[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*$ ]]; then
            echo "'$component' in the repository path starts or ends with a separator or has two in a row" \
                "('.', '_', '__' and runs of '-' may only stand between letters or digits); e.g." \
                "flyte-torch-pipeline"
            return 0
        fi
    done
    if ((${#name} > 255)); then
        echo "the name before the tag has ${#name} characters; a registry accepts at most 255"
        return 0
    fi
    return 1
}
