#!/usr/bin/env bash
# The real CRD-serving API server for the tests: k8s.io/apiextensions-apiserver (Kubernetes' own code for
# CustomResourceDefinitions) around a small main of ours (tests/k8s/apiserver/main.go), and etcd, both from
# Debian's packages alone (no registry here ships kube-apiserver or envtest's binaries).
#
#   scripts/build-apiserver.sh            # build if needed; links .cache/apiserver/bin/{pd-apiserver,etcd}
#   scripts/build-apiserver.sh --relock   # re-resolve the package lock against Debian today
#
# Only Debian's unstable suite has the apiextensions-apiserver sources, and it keeps only the newest version of a
# package. The exact packages built with are locked in tests/k8s/apiserver/debian-packages.lock; when the archive
# has moved on, the build says which packages moved and builds from today's versions instead.
#
# Everything downloaded and built stays in a cache outside the clone ($PD_APISERVER_CACHE, default
# ~/.cache/pd-operator/apiserver): the first build takes 4-6 minutes on 2 cores (~320 MB of packages, a Go build
# cache of ~1.4 GB), later ones reuse it (a few seconds; none when main.go and the packages are unchanged).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source_dir="$root/tests/k8s/apiserver"
lock="$source_dir/debian-packages.lock"
dest="$root/.cache/apiserver/bin"
cache="${PD_APISERVER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-operator/apiserver}"
# What the server needs: the apiextensions-apiserver sources and what they import, the Go toolchain, etcd.
roots=(golang-k8s-apiextensions-apiserver-dev golang-go etcd-server)
mkdir -p "$cache/debs" "$cache/apt/lists/partial" "$cache/apt/archives/partial"

say() { echo "build-apiserver: $*" >&2; }

# A private apt set-up for Debian unstable on the machine's own Debian mirror; nothing is installed system-wide.
apt_setup() {
    local mirror
    mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    [[ -n "$mirror" ]] || mirror=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
    [[ -n "$mirror" ]] || { say "no Debian mirror configured on this machine"; exit 1; }
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror sid main" > "$cache/apt/sources.list"
    : > "$cache/apt/status"
    cat > "$cache/apt/apt.conf" <<EOF
Dir::State "$cache/apt";
Dir::State::Lists "$cache/apt/lists";
Dir::State::status "$cache/apt/status";
Dir::Cache "$cache/apt";
Dir::Cache::archives "$cache/apt/archives";
Dir::Etc::SourceList "$cache/apt/sources.list";
Dir::Etc::SourceParts "$cache/apt/sources.list.d";
Dir::Etc::Preferences "$cache/apt/preferences";
Dir::Etc::PreferencesParts "$cache/apt/preferences.d";
APT::Architecture "amd64";
Debug::NoLocking "true";
EOF
    mkdir -p "$cache/apt/sources.list.d" "$cache/apt/preferences.d"
    export APT_CONFIG="$cache/apt/apt.conf"
    apt-get -qq update 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2 || true
}

# The Go sources, Go toolchain and etcd packages that an empty system would install for $roots, as name=version.
resolve() {
    apt-get -s install --no-install-recommends "${roots[@]}" 2>/dev/null |
        awk '/^Inst (golang|etcd-server)/ {gsub(/[()]/, "", $3); print $2 "=" $3}' | sort
}

deb_of() {  # name=version -> the file apt-get download writes (an epoch's colon is %3a)
    local name=${1%%=*} version=${1#*=}
    compgen -G "$cache/debs/${name}_${version/:/%3a}_*.deb" | awk 'NR == 1'
}

download() {  # name=version ... into $cache/debs; fails when a version is gone from the archive
    local missing=()
    for package in "$@"; do [[ -n "$(deb_of "$package")" ]] || missing+=("$package"); done
    ((${#missing[@]} == 0)) && return 0
    [[ -n "${APT_CONFIG:-}" ]] || apt_setup
    say "downloading ${#missing[@]} packages"
    (cd "$cache/debs" && apt-get -qq download "${missing[@]}" 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2)
    for package in "${missing[@]}"; do [[ -n "$(deb_of "$package")" ]] || return 1; done
}

if [[ "${1:-}" == "--relock" ]]; then
    apt_setup
    { echo "# Debian unstable packages pd-apiserver is built from (scripts/build-apiserver.sh --relock)."; resolve; } > "$lock"
    say "locked $(grep -vc '^#' "$lock") packages in $lock"
    exit 0
fi

mapfile -t packages < <(grep -v '^#' "$lock")
if ! download "${packages[@]}"; then
    apt_setup
    mapfile -t packages < <(resolve)
    say "Debian unstable moved on since $lock was written; building from today's versions instead. Moved:"
    comm -13 <(printf '%s\n' "${packages[@]}") <(grep -v '^#' "$lock") | sed 's/^/  locked, now gone: /' >&2
    say "run scripts/build-apiserver.sh --relock and commit the lock to make this the new baseline"
    download "${packages[@]}"
fi

# One extracted root and one binary per set of packages and main.go.
key=$( (printf '%s\n' "${packages[@]}"; cat "$source_dir/main.go") | sha256sum | cut -c1-16)
tree="$cache/root-$(printf '%s\n' "${packages[@]}" | sha256sum | cut -c1-16)"
out="$cache/build-$key"
if [[ ! -x "$out/pd-apiserver" ]]; then
    if [[ ! -e "$tree/.complete" ]]; then
        say "extracting ${#packages[@]} packages"
        rm -rf "$tree" && mkdir -p "$tree"
        for package in "${packages[@]}"; do dpkg -x "$(deb_of "$package")" "$tree"; done
        touch "$tree/.complete"
    fi
    goroot=$(compgen -G "$tree/usr/lib/go-1.*" | sort -V | tail -n 1)
    gopath=$(mktemp -d)
    trap 'rm -rf "$gopath"' EXIT
    mkdir -p "$gopath/src/pd-apiserver" "$out"
    cp "$source_dir/main.go" "$gopath/src/pd-apiserver/"
    say "building with $("$goroot/bin/go" version | cut -d' ' -f3) (first time: minutes)"
    # Debian's Go packages are a GOPATH, not modules: build the way Debian does.
    (cd "$gopath/src/pd-apiserver" &&
        GOROOT="$goroot" GOPATH="$gopath:$tree/usr/share/gocode" GO111MODULE=off GOTOOLCHAIN=local CGO_ENABLED=0 \
            GOCACHE="$cache/gocache" GOFLAGS=-trimpath "$goroot/bin/go" build -ldflags=-s -o "$out/pd-apiserver.new" .)
    install -m 0755 "$tree/usr/bin/etcd" "$out/etcd"
    printf '%s\n' "${packages[@]}" > "$out/packages"
    mv "$out/pd-apiserver.new" "$out/pd-apiserver"
fi
mkdir -p "$dest"
ln -sfn "$out/pd-apiserver" "$dest/pd-apiserver"
ln -sfn "$out/etcd" "$dest/etcd"
ln -sfn "$out/packages" "$dest/packages"
# awk reads to the end: `head` would close the pipe early and pipefail would fail on etcd's SIGPIPE (CI).
"$dest/etcd" --version | awk 'NR == 1' >&2
say "$(grep -E '^golang-k8s-apiextensions-apiserver-dev=' "$out/packages" | tr '=' ' ') in $dest"
