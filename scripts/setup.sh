#!/usr/bin/env bash
# Prepare this machine for nbexec. Idempotent and quick when everything is already there. Needs root (or sudo)
# for what it installs with apt and to start the engine.
#
#   scripts/setup.sh          # run code: Docker engine, python3-venv, .venv with nbexec, the runtime image
#   scripts/setup.sh --test   # the above, plus what the tests need: nbexec's test and lint extras in .venv,
#                             # Node.js and npm, Azurite + TypeScript in .tools/ (scripts/test-tools/), and
#                             # Chromium with its driver for the playground's browser test
#
# apt packages, each only when missing: docker.io (and debootstrap where no registry answers), python3-venv,
# ca-certificates, python3-pip (as root, when the unprivileged user that runs the host's pip can run no Python
# with pip); with --test also nodejs, npm, chromium and chromium-driver (Debian's; Ubuntu ships Chromium
# as a snap instead). Node and Chromium are never needed to run code, only for the tests.
#
# Environment: NBEXEC_IMAGE (tag to build), NBEXEC_CA_BUNDLE (CA file for pip inside the build; defaults to
# the system bundle when it exists), NBEXEC_AIRGAPPED=1 (always build on a debootstrapped Debian base).
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_TESTS=0
for arg in "$@"; do
    case "$arg" in
        --test) WITH_TESTS=1 ;;
        -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "setup.sh: unknown argument $arg (use --test or nothing)" >&2; exit 2 ;;
    esac
done

log() { printf '\n== %s\n' "$*" >&2; }

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
    .venv/bin/pip install -q -e "$spec" 2>&1 | grep -v "is ignored" || true
    .venv/bin/python -c "$check" # fail here, not later, when the install broke
}

have_default_base() {
    docker image inspect python:3.12-slim >/dev/null 2>&1 || timeout 60 docker pull -q python:3.12-slim >/dev/null 2>&1
}

ensure_image() {
    local args=()
    local ca="${NBEXEC_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
    [ -f "$ca" ] && args+=(--ca-bundle "$ca")
    if [ "${NBEXEC_AIRGAPPED:-}" = 1 ] || ! have_default_base; then
        command -v debootstrap >/dev/null || apt_install debootstrap
        args+=(--debootstrap)
        log "no registry: building the runtime image on a debootstrapped Debian base"
    else
        log "building the runtime image"
    fi
    .venv/bin/nbexec image build "${args[@]}" 2>&1 | grep -vE '^ ---> |^Step |Removing intermediate' | tail -5
    .venv/bin/nbexec doctor
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
    # resolve can pick a release whose own dependencies are not published yet). Debian's Node 18 runs them.
    if [ -x .tools/node_modules/.bin/azurite-blob ] && [ -x .tools/node_modules/.bin/tsc ]; then return; fi
    command -v npm >/dev/null || apt_install nodejs npm
    log "installing Azurite and TypeScript into .tools/"
    mkdir -p .tools
    cp scripts/test-tools/package.json scripts/test-tools/package-lock.json .tools/
    npm ci --silent --no-audit --no-fund --prefix .tools >/dev/null
}

ensure_browser() {
    # The playground test drives a real headless Chromium through Selenium with Debian's matching driver.
    apt_install chromium chromium-driver
}

ensure_base_packages
ensure_docker
ensure_venv
ensure_resolver_python
ensure_image
if [ "$WITH_TESTS" = 1 ]; then ensure_test_tools; ensure_browser; fi
