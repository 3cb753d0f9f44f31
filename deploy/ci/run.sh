#!/usr/bin/env bash
# Validates deploy/ (see check.py for what each validator checks). `cargo xtask test` runs this;
# it can also be run by itself: bash deploy/ci/run.sh [--self-test]
#
# Installs the validators on first use, pinned, into .tools/deploy-check/ (nothing system-wide
# but, where missing, Debian's python3-venv and nodejs/npm):
#   venv/   PyPI: requirements.txt (kubernetes-validate, yamllint, check-jsonschema, promql-parser)
#   node/   npm: package.json + package-lock.json (typescript, @grafana/schema)
#   bin/    Debian: promtool from prometheus, kubectl (for `kubectl kustomize`) from
#           kubernetes-client; unpacked with dpkg-deb, not installed (no service, no system change)
# and reinstalls when one of those files changes.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CI="$ROOT/deploy/ci"
TOOLS=${DEPLOY_CHECK_TOOLS:-$ROOT/.tools/deploy-check}
WORK="$ROOT/target/deploy-check"
DEBS=(prometheus kubernetes-client)

say() { echo "deploy-check: $*" >&2; }
die() { say "error: $*"; exit 1; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"
    elif command -v sudo >/dev/null; then sudo "$@"
    else die "needs root for: $* (run as root, or install it yourself)"; fi
}

apt_install() {
    say "installing Debian packages: $*"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >/dev/null
}

stamp() {
    cat "$CI/requirements.txt" "$CI/package.json" "$CI/package-lock.json" "$0"
    echo "${DEBS[*]}"
}

install_tools() {
    rm -rf "$TOOLS"
    mkdir -p "$TOOLS"

    if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
        apt_install python3-venv
    fi
    say "PyPI: $(grep -cv '^#' "$CI/requirements.txt") pinned packages into $TOOLS/venv"
    python3 -m venv "$TOOLS/venv"
    "$TOOLS/venv/bin/pip" install -q --disable-pip-version-check -r "$CI/requirements.txt" \
        || die "pip install -r deploy/ci/requirements.txt failed (PyPI reachable?)"

    command -v npm >/dev/null || apt_install nodejs npm
    say "npm: typescript and @grafana/schema into $TOOLS/node"
    mkdir -p "$TOOLS/node"
    cp "$CI/package.json" "$CI/package-lock.json" "$TOOLS/node/"
    (cd "$TOOLS/node" && npm ci --no-audit --no-fund --loglevel=error >/dev/null) \
        || die "npm ci in $TOOLS/node failed (npm registry reachable?)"

    say "Debian: promtool and kubectl from ${DEBS[*]} into $TOOLS/bin"
    mkdir -p "$TOOLS/deb-cache"
    # apt-get download writes as the _apt user where it can; a root-owned dir makes it warn.
    chmod 777 "$TOOLS/deb-cache"
    if ! (cd "$TOOLS/deb-cache" && apt-get download -q "${DEBS[@]}" >/dev/null 2>&1); then
        say "apt-get download failed: updating the package lists"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
        (cd "$TOOLS/deb-cache" && apt-get download -q "${DEBS[@]}" >/dev/null 2>&1) \
            || die "apt-get download ${DEBS[*]} failed (Debian mirror reachable?)"
    fi
    for deb in "$TOOLS"/deb-cache/*.deb; do dpkg-deb -x "$deb" "$TOOLS/deb-cache/x"; done
    mkdir -p "$TOOLS/bin"
    mv "$TOOLS/deb-cache/x/usr/bin/promtool" "$TOOLS/deb-cache/x/usr/bin/kubectl" "$TOOLS/bin/"
    rm -rf "$TOOLS/deb-cache"

    stamp > "$TOOLS/.stamp"
}

if [ ! -f "$TOOLS/.stamp" ] || ! cmp -s <(stamp) "$TOOLS/.stamp"; then
    start=$SECONDS
    install_tools
    say "validators installed in $((SECONDS - start)) s"
fi

versions=(
    "kubernetes-validate $("$TOOLS/venv/bin/pip" show kubernetes-validate | sed -n 's/^Version: //p')"
    "$("$TOOLS/venv/bin/yamllint" --version)"
    "check-jsonschema $("$TOOLS/venv/bin/pip" show check-jsonschema | sed -n 's/^Version: //p')"
    "promql-parser $("$TOOLS/venv/bin/pip" show promql-parser | sed -n 's/^Version: //p')"
    "promtool $("$TOOLS/bin/promtool" --version 2>&1 | head -1 | cut -d' ' -f3)"
    "kubectl $("$TOOLS/bin/kubectl" version --client --short 2>/dev/null | cut -d' ' -f3)"
    "tsc $(node "$TOOLS/node/node_modules/typescript/bin/tsc" --version | cut -d' ' -f2)"
    "@grafana/schema $(node -p "require('$TOOLS/node/node_modules/@grafana/schema/package.json').version")"
)
say "$(IFS=,; echo "${versions[*]}" | sed 's/,/, /g')"
exec "$TOOLS/venv/bin/python" "$CI/check.py" --tools "$TOOLS" --work "$WORK" "$@"
