#!/usr/bin/env bash
# Build a real Kubernetes control plane for the tests from Go modules:
#   etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl (the one users
#   type) and kubelet (a real node for the pool's pods: tests/cluster/node.py)
# into ${KVPOOL_ENVTEST_CACHE:-$HOME/.cache/kvpool-envtest}/<k8s>-etcd<etcd>/bin/.
#
# Nothing is rebuilt when the binaries are already there. The last line printed
# on stdout is always the bin directory; progress and errors go to stderr.
# A cold build takes 10-20 minutes on 2 cores (it runs under `nice -n 19`).
#
# Environment:
#   KVPOOL_ENVTEST_CACHE        cache root (default: $HOME/.cache/kvpool-envtest)
#   KVPOOL_K8S_VERSION          Kubernetes version without "v" (default below)
#   KVPOOL_ETCD_VERSION         etcd version without "v" (default below)
#   KVPOOL_ENVTEST_KEEP_WORK=1  keep the temporary wrapper modules (for debugging)
# Options:
#   --force                     rebuild even when the binaries exist
set -euo pipefail
set -o errtrace

K8S_VERSION="${KVPOOL_K8S_VERSION:-1.33.13}"
ETCD_VERSION="${KVPOOL_ETCD_VERSION:-3.5.35}"
CACHE_ROOT="${KVPOOL_ENVTEST_CACHE:-$HOME/.cache/kvpool-envtest}"
BIN_DIR="$CACHE_ROOT/${K8S_VERSION}-etcd${ETCD_VERSION}/bin"
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet)
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"

FORCE=0
for arg in "$@"; do
    case "$arg" in
        --force) FORCE=1 ;;
        -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) printf '[kvpool-envtest] ERROR: unknown argument: %s\n' "$arg" >&2; exit 2 ;;
    esac
done

log() { printf '[kvpool-envtest] %s\n' "$*" >&2; }
die() { printf '[kvpool-envtest] ERROR: %s\n' "$*" >&2; exit 1; }
on_err() {
    local rc=$? line=$1 cmd=$2
    printf '[kvpool-envtest] ERROR: step failed (exit %s) at build.sh line %s: %s\n' "$rc" "$line" "$cmd" >&2
    exit "$rc"
}
trap 'on_err "$LINENO" "$BASH_COMMAND"' ERR

have_all() {
    local b
    [ -f "$BIN_DIR/VERSION" ] || return 1
    for b in "${BINARIES[@]}"; do
        [ -x "$BIN_DIR/$b" ] || return 1
    done
}

mkdir -p "$CACHE_ROOT"
# Serialise concurrent runs (parallel test sessions): a second run waits for the
# first one's build instead of starting another one.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$CACHE_ROOT/.build.lock"
    flock 9
fi

if [ "$FORCE" = 0 ] && have_all; then
    log "cached: kube-apiserver v$K8S_VERSION, etcd v$ETCD_VERSION in $BIN_DIR"
    printf '%s\n' "$BIN_DIR"
    exit 0
fi

command -v go >/dev/null 2>&1 || die "go is not installed (needed to build etcd and kube-apiserver)"
log "building kube-apiserver/kube-controller-manager v$K8S_VERSION and etcd v$ETCD_VERSION with $(go version)"
log "GOPROXY=$(go env GOPROXY)"

export CGO_ENABLED=0 GOWORK=off GOFLAGS=-buildvcs=false
WORK="$(mktemp -d "$CACHE_ROOT/.build.XXXXXX")"
cleanup() {
    if [ "${KVPOOL_ENVTEST_KEEP_WORK:-0}" = 1 ]; then
        log "keeping work dir $WORK"
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT
mkdir -p "$WORK/bin"
START=$SECONDS

# --- etcd -------------------------------------------------------------------
# go.etcd.io/etcd/server/v3 is etcd's main package, but its go.mod has replace
# directives (../api, ...) so `go install ...@v` refuses it: build it from a
# wrapper module that requires it instead.
log "[etcd] resolving go.etcd.io/etcd/server/v3@v$ETCD_VERSION"
mkdir -p "$WORK/etcd"
(
    cd "$WORK/etcd" &&
        go mod init kvpool.local/envtest/etcd >&2 &&
        go get "go.etcd.io/etcd/server/v3@v$ETCD_VERSION" >&2
) || die "[etcd] could not resolve go.etcd.io/etcd/server/v3@v$ETCD_VERSION (see above)"
log "[etcd] building"
(
    cd "$WORK/etcd" &&
        nice -n 19 go build -trimpath -mod=mod -ldflags "-s -w" -o "$WORK/bin/etcd" go.etcd.io/etcd/server/v3 >&2
) || die "[etcd] go build failed (see above)"
log "[etcd] built in $((SECONDS - START))s"

# --- kube-apiserver + kube-controller-manager ----------------------------------
# k8s.io/kubernetes replaces its staging modules (k8s.io/api, ...) with
# ./staging/src/..., so `go install` refuses it too. The wrapper module
# requires k8s.io/kubernetes and replaces every staging module by its
# published v0.<minor>.<patch> release.
log "[kube] resolving k8s.io/kubernetes@v$K8S_VERSION"
KMOD_JSON="$(cd "$WORK" && go mod download -json "k8s.io/kubernetes@v$K8S_VERSION")" \
    || die "[kube] go mod download k8s.io/kubernetes@v$K8S_VERSION failed: $KMOD_JSON"
KGOMOD="$(printf '%s\n' "$KMOD_JSON" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
[ -f "$KGOMOD" ] || die "[kube] could not locate the go.mod of k8s.io/kubernetes@v$K8S_VERSION"
STAGING="$(sed -n 's#^[[:space:]]*\(k8s\.io/[^[:space:]]*\)[[:space:]]*=>[[:space:]]*\./staging/src/.*#\1#p' "$KGOMOD" | sort -u)"
[ -n "$STAGING" ] || die "[kube] found no staging replace directives in $KGOMOD"
K8S_MINOR="$(printf '%s' "$K8S_VERSION" | cut -d. -f2)"
K8S_PATCH="$(printf '%s' "$K8S_VERSION" | cut -d. -f3)"
STAGING_VERSION="v0.$K8S_MINOR.$K8S_PATCH"
log "[kube] $(printf '%s\n' "$STAGING" | wc -l) staging modules -> $STAGING_VERSION"
mkdir -p "$WORK/kube"
{
    echo "module kvpool.local/envtest/kube"
    echo
    grep -E '^(go|godebug)[[:space:]]' "$KGOMOD"
    echo
    echo "require k8s.io/kubernetes v$K8S_VERSION"
    echo
    echo "replace ("
    printf '%s\n' "$STAGING" | while read -r m; do printf '\t%s => %s %s\n' "$m" "$m" "$STAGING_VERSION"; done
    echo ")"
} > "$WORK/kube/go.mod"
(
    cd "$WORK/kube" &&
        go get "k8s.io/kubernetes/cmd/kube-apiserver@v$K8S_VERSION" \
        "k8s.io/kubernetes/cmd/kube-controller-manager@v$K8S_VERSION" \
        "k8s.io/kubernetes/cmd/kubectl@v$K8S_VERSION" "k8s.io/kubernetes/cmd/kube-scheduler@v$K8S_VERSION" \
        "k8s.io/kubernetes/cmd/kubelet@v$K8S_VERSION" >&2
) || die "[kube] could not resolve the kube-apiserver/kube-controller-manager packages (see above)"

BUILD_DATE="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
LDFLAGS="-s -w"
# Without a real version (the default is v0.0.0-master) recent apiservers
# refuse to start, so stamp it like hack/lib/version.sh does.
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    LDFLAGS="$LDFLAGS -X $pkg.gitVersion=v$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$K8S_MINOR"
    LDFLAGS="$LDFLAGS -X $pkg.gitTreeState=clean -X $pkg.buildDate=$BUILD_DATE"
done
KSTART=$SECONDS
log "[kube] building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and kubelet (the long part)"
(
    cd "$WORK/kube" &&
        nice -n 19 go build -trimpath -mod=mod -ldflags "$LDFLAGS" -o "$WORK/bin/" \
        k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
        k8s.io/kubernetes/cmd/kubectl k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet >&2
) || die "[kube] go build failed (see above)"
log "[kube] built in $((SECONDS - KSTART))s"

"$WORK/bin/kube-apiserver" --version >&2 || die "the built kube-apiserver does not run"
"$WORK/bin/etcd" --version >&2 || die "the built etcd does not run"
"$WORK/bin/kubectl" version --client >&2 || die "the built kubectl does not run"
"$WORK/bin/kubelet" --version >&2 || die "the built kubelet does not run"

cat > "$WORK/bin/VERSION" <<EOF
kubernetes=v$K8S_VERSION
etcd=v$ETCD_VERSION
go=$(go env GOVERSION)
built=$BUILD_DATE
build_seconds=$((SECONDS - START))
EOF

# Publish atomically: a half-finished build never looks like a cached one.
mkdir -p "$(dirname "$BIN_DIR")"
rm -rf "$BIN_DIR"
mv "$WORK/bin" "$BIN_DIR"
log "done in $((SECONDS - START))s: $BIN_DIR"
printf '%s\n' "$BIN_DIR"
