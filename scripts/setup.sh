#!/usr/bin/env bash
# Prepare this machine for nbexec. Idempotent and quick when everything is already there. Needs root (or sudo)
# for what it installs with apt and to start the engine.
#
#   scripts/setup.sh          # run code: Docker engine, python3-venv, .venv with nbexec, the runtime image
#   scripts/setup.sh --test --python   # only .venv with the test and lint extras: lint and the fast tier
#   scripts/setup.sh --test   # the above, plus what the tests need: nbexec's test and lint extras in .venv,
#                             # Node.js and npm, Azurite + TypeScript in .tools/ (scripts/test-tools/), and
#                             # Chromium with its driver for the playground's browser test, and the kernels
#                             # image (R, Deno, Bash on the runtime image: nbexec image build --kernels)
#
# apt packages, each only when missing: docker.io (and debootstrap when no registry answers and no base image is
# here), python3-venv, ca-certificates, python3-pip (as root, when the unprivileged user that runs the host's pip
# can run no Python with pip); with --test also nodejs, npm, chromium and chromium-driver (Debian's; Ubuntu ships
# Chromium as a snap instead). Node and Chromium are never needed to run code, only for the tests.
#
# Environment: NBEXEC_IMAGE (tag to build), NBEXEC_CA_BUNDLE (CA file for pip, here and inside the image build;
# the build defaults to the system bundle when it exists), NBEXEC_AIRGAPPED=1 (build on a debootstrapped Debian
# base, never a registry's). Each step stops the script when it fails, with its own error and what to do.
set -euo pipefail

WITH_TESTS=0
PYTHON_ONLY=0
STEP=""  # the step running now: named when it fails

log() { printf '\n== %s\n' "$*" >&2; }

# Run one step; if it fails, the script stops there (set -e) and on_exit names it under the step's own error.
step() { STEP="$1"; shift; "$@"; STEP=""; }

on_exit() {
    local status=$?
    if [ "$status" -ne 0 ] && [ -n "$STEP" ]; then
        echo "setup.sh: stopped: $STEP failed (exit $status); its own error is above." >&2
    fi
}

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"
    elif command -v sudo >/dev/null 2>&1; then sudo "$@"
    else echo "setup.sh: '$*' needs root; run this script as root or install sudo" >&2; exit 3
    fi
}

APT_UPDATED=0
# Install the Debian/Ubuntu packages named that are not installed yet (one apt-get update per run).
apt_install() {
    local missing=()
    for package in "$@"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$package")
    done
    [ "${#missing[@]}" -eq 0 ] && return
    command -v apt-get >/dev/null || {
        echo "setup.sh: install ${missing[*]} (this script knows only apt-get)" >&2; exit 3; }
    log "installing ${missing[*]} (apt)"
    if [ "$APT_UPDATED" = 0 ]; then as_root apt-get update -qq; APT_UPDATED=1; fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

ensure_base_packages() {
    # TLS roots for pip, the engine's pulls and npm; minimal images and debootstrapped systems lack them.
    if command -v dpkg-query >/dev/null; then apt_install ca-certificates; fi
}

ensure_docker() {
    if docker info >/dev/null 2>&1; then return; fi
    command -v dockerd >/dev/null 2>&1 || apt_install docker.io
    if ! docker info >/dev/null 2>&1; then
        log "starting dockerd in the background (log: /var/log/nbexec-dockerd.log)"
        as_root sh -c 'nohup setsid dockerd >/var/log/nbexec-dockerd.log 2>&1 &'
        for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    fi
    docker info >/dev/null 2>&1 || { echo "Docker did not start; see /var/log/nbexec-dockerd.log" >&2; exit 3; }
}

ensure_venv() {
    # Checked by pip, not python: a venv whose ensurepip step failed has a python but no pip.
    if [ ! -x .venv/bin/pip ]; then
        log "creating .venv"
        if ! python3 -m venv .venv >/dev/null 2>&1; then
            # Debian and Ubuntu ship venv's ensurepip separately, as python3-venv.
            rm -rf .venv
            apt_install python3-venv
            python3 -m venv .venv
        fi
    fi
    local spec=. check="import nbexec"
    if [ "$WITH_TESTS" = 1 ]; then spec='.[test,dev]'; check="import nbexec, pytest"; fi
    log "installing nbexec ($spec) into .venv"
    pip_install -e "$spec"
    .venv/bin/python -c "$check" # the install said it worked: check it did
}

# pip install into .venv; when it fails, pip's own error (and for TLS, what to do) and exit 3.
pip_install() {
    local output ca=()
    # The environment, not --cert: the pip that fetches build dependencies (a child process) reads it too, and
    # requests lets REQUESTS_CA_BUNDLE (set machine-wide on some systems) win over pip's own setting.
    if [ -n "${NBEXEC_CA_BUNDLE:-}" ]; then ca=("PIP_CERT=$NBEXEC_CA_BUNDLE" "REQUESTS_CA_BUNDLE=$NBEXEC_CA_BUNDLE"); fi
    output=$(mktemp)
    if env "${ca[@]}" .venv/bin/pip install -q "$@" >"$output" 2>&1; then
        grep -v "is ignored" "$output" >&2 || true
        rm -f "$output"
        return 0
    fi
    grep -v "is ignored" "$output" >&2 || true
    if grep -qiE "CERTIFICATE_VERIFY_FAILED|certificate verify failed|SSLError|SSL: " "$output"; then
        echo "setup.sh: pip could not verify the package index's TLS certificate. Behind a TLS-intercepting" \
             "proxy (or with a private index), give its CA certificate: NBEXEC_CA_BUNDLE=/path/to/ca.pem" \
             "scripts/setup.sh (pip here and in the image build use it), or pip's own PIP_CERT=/path/to/ca.pem" \
             "(--cert); PIP_INDEX_URL names a mirror." >&2
    fi
    rm -f "$output"
    return 3
}

has_image() { docker image inspect "$1" >/dev/null 2>&1; }

ensure_image() {
    # Only what the build will use: a base already here is built on; debootstrap only to make one.
    local args=() airgapped="${NBEXEC_AIRGAPPED:-}"
    local ca="${NBEXEC_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
    [ -f "$ca" ] && args+=(--ca-bundle "$ca")
    if [ "$airgapped" != 1 ] && has_image python:3.12-slim; then
        log "building the runtime image"
    elif has_image nbexec-base:bookworm; then
        args+=(--debootstrap)  # reuses that base: nothing to debootstrap
        log "building the runtime image on the Debian base made before (nbexec-base:bookworm)"
    elif [ "$airgapped" != 1 ] && timeout 60 docker pull -q python:3.12-slim >/dev/null 2>&1; then
        log "building the runtime image"
    else
        command -v debootstrap >/dev/null || apt_install debootstrap
        args+=(--debootstrap)
        log "no registry: building the runtime image on a debootstrapped Debian base"
    fi
    .venv/bin/nbexec image build "${args[@]}" 2>&1 | { grep -vE '^ ---> |^Step |Removing intermediate' || true; } \
        | tail -5
    .venv/bin/nbexec doctor
}

ensure_kernels_image() {
    # R, Deno and Bash kernels on the runtime image (tests/test_languages.py): Docker's cache makes a second run
    # take a second; the first needs apt (Debian's R) and PyPI (Deno, bash_kernel).
    local args=() ca="${NBEXEC_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
    [ -f "$ca" ] && args+=(--ca-bundle "$ca")
    .venv/bin/nbexec image build --kernels r,deno,bash "${args[@]}" 2>&1 \
        | { grep -vE '^ ---> |^Step |Removing intermediate' || true; } | tail -3
}

ensure_resolver_python() {
    # As root, nbexec runs the host's pip as nobody (nbexec/packages/hostpip.py) with a Python that user can run:
    # the venv's own when it lives somewhere others can read, else the system's python3, which then needs pip.
    [ "$(id -u)" -eq 0 ] || return 0
    local python
    for python in "$PWD/.venv/bin/python" /usr/local/bin/python3 /usr/bin/python3; do
        if [ -x "$python" ] && su nobody -s /bin/sh -c "'$python' -I -c 'import pip._internal.cli.main'" \
                >/dev/null 2>&1; then return 0; fi
    done
    apt_install python3-pip
}

ensure_test_tools() {
    # Azurite (Microsoft's Azure Storage emulator, from npm) for the Azure upload tests, and TypeScript for the
    # TypeScript example's test; kept in .tools/, at the versions scripts/test-tools/package-lock.json pins (a fresh
    # resolve can pick a release whose own dependencies are not published yet); and E2B's npm SDKs for the E2B door's
    # TypeScript test (they need Node 20.18 or later: Debian 13's).
    if [ -x .tools/node_modules/.bin/azurite-blob ] && [ -x .tools/node_modules/.bin/tsc ] &&
        [ -f .tools/node_modules/@e2b/code-interpreter/package.json ]; then return; fi
    command -v npm >/dev/null || apt_install nodejs npm
    log "installing Azurite, TypeScript and the E2B SDKs into .tools/"
    mkdir -p .tools
    cp scripts/test-tools/package.json scripts/test-tools/package-lock.json .tools/
    npm ci --loglevel=error --no-audit --no-fund --prefix .tools >/dev/null  # errors still reach stderr
}

ensure_browser() {
    # The playground test drives a real headless Chromium through Selenium with Debian's matching driver.
    apt_install chromium chromium-driver
}

main() {
    for arg in "$@"; do
        case "$arg" in
            --test) WITH_TESTS=1 ;;
            --python) PYTHON_ONLY=1 ;;
            -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
            *) echo "setup.sh: unknown argument $arg (use --test, --python or nothing)" >&2; exit 2 ;;
        esac
    done
    cd "$(dirname "$0")/.."
    trap on_exit EXIT
    step "installing the base packages (apt)" ensure_base_packages
    if [ "$PYTHON_ONLY" = 1 ]; then
        step "installing nbexec into .venv" ensure_venv
        return
    fi
    step "starting the Docker engine" ensure_docker
    step "installing nbexec into .venv" ensure_venv
    step "finding a Python the package resolver's user can run" ensure_resolver_python
    step "building the runtime image" ensure_image
    if [ "$WITH_TESTS" = 1 ]; then
        step "building the kernels image (R, Deno, Bash)" ensure_kernels_image
        step "installing Azurite and TypeScript (npm)" ensure_test_tools
        step "installing Chromium and its driver (apt)" ensure_browser
    fi
}

# Sourcing the script (tests do) defines its steps without running them.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then main "$@"; fi
