#!/usr/bin/env bash
# Build a pinned helm from its Go module and print the path of the binary.
#
#   ${KVPOOL_TOOLS_CACHE:-$HOME/.cache/kvpool-tools}/helm-<version>/bin/helm
#
# Nothing is rebuilt when that binary is already there. The last line printed on
# stdout is always the binary's path; progress and errors go to stderr. A cold
# build takes a few minutes on 2 cores (it runs under `nice -n 19`). The version
# stamps mirror helm's own Makefile, so `helm version` and the default
# `.Capabilities.KubeVersion` of `helm template` are those of the release.
#
# Environment:
#   KVPOOL_TOOLS_CACHE    cache root (default: $HOME/.cache/kvpool-tools)
#   KVPOOL_HELM_VERSION   helm version without "v" (default below; must be 3.x)
# Options:
#   --force               rebuild even when the binary exists
set -euo pipefail

HELM_VERSION="${KVPOOL_HELM_VERSION:-3.21.4}"
# Kubernetes minor of the client-go that helm v$HELM_VERSION's go.mod requires; helm's
# Makefile stamps it as the default KubeVersion (helm template, helm lint).
HELM_K8S_MINOR="${KVPOOL_HELM_K8S_MINOR:-36}"
CACHE_ROOT="${KVPOOL_TOOLS_CACHE:-$HOME/.cache/kvpool-tools}"
DEST="$CACHE_ROOT/helm-$HELM_VERSION"
BIN="$DEST/bin/helm"

log() { printf '[kvpool-helm] %s\n' "$*" >&2; }
die() { printf '[kvpool-helm] ERROR: %s\n' "$*" >&2; exit 1; }

FORCE=0
for arg in "$@"; do
    case "$arg" in
        --force) FORCE=1 ;;
        -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument: $arg" ;;
    esac
done
case "$HELM_VERSION" in
    3.*) ;;
    *) die "KVPOOL_HELM_VERSION=$HELM_VERSION: only helm 3.x is supported by this script" ;;
esac

mkdir -p "$CACHE_ROOT"
# Serialise concurrent runs (parallel test sessions).
if command -v flock >/dev/null 2>&1; then
    exec 9>"$CACHE_ROOT/.helm.lock"
    flock 9
fi

if [ "$FORCE" = 0 ] && [ -x "$BIN" ] && "$BIN" version --short >/dev/null 2>&1; then
    log "cached: $("$BIN" version --short)"
    printf '%s\n' "$BIN"
    exit 0
fi

command -v go >/dev/null 2>&1 || die "go is not installed (needed to build helm v$HELM_VERSION)"
log "building helm v$HELM_VERSION with $(go version) (GOPROXY=$(go env GOPROXY))"
START=$SECONDS
WORK="$(mktemp -d "$CACHE_ROOT/.helm-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

LDFLAGS="-s -w -X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION"
LDFLAGS="$LDFLAGS -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    LDFLAGS="$LDFLAGS -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$HELM_K8S_MINOR"
done
(
    export CGO_ENABLED=0 GOWORK=off GOFLAGS="-mod=mod -buildvcs=false" GOBIN="$WORK/bin"
    cd "$WORK" && nice -n 19 go install -trimpath -ldflags "$LDFLAGS" "helm.sh/helm/v3/cmd/helm@v$HELM_VERSION" >&2
) || die "go install helm.sh/helm/v3/cmd/helm@v$HELM_VERSION failed (see above)"
"$WORK/bin/helm" version --short >&2 || die "the built helm does not run"

# Publish atomically: a half-finished build never looks like a cached one.
rm -rf "$DEST"
mkdir -p "$DEST"
mv "$WORK/bin" "$DEST/bin"
log "done in $((SECONDS - START))s: $BIN"
printf '%s\n' "$BIN"
