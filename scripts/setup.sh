#!/usr/bin/env bash
# Prepare this machine for nbexec: a Docker engine, the Python environment in .venv, and the runtime image.
# Idempotent and quick when everything is already there. Needs root for the engine and the air-gapped base.
#
#   scripts/setup.sh            # engine + .venv + image
#
# Environment: NBEXEC_IMAGE (tag to build), NBEXEC_CA_BUNDLE (CA file for pip inside the build; defaults to
# the system bundle when it exists), NBEXEC_AIRGAPPED=1 (always build on a debootstrapped Debian base).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*" >&2; }

ensure_docker() {
    if docker info >/dev/null 2>&1; then return; fi
    if ! command -v dockerd >/dev/null 2>&1; then
        log "installing the Docker engine (Debian's docker.io) and debootstrap"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
    fi
    if ! docker info >/dev/null 2>&1; then
        log "starting dockerd in the background (log: /var/log/nbexec-dockerd.log)"
        nohup setsid dockerd >/var/log/nbexec-dockerd.log 2>&1 &
        for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    fi
    docker info >/dev/null 2>&1 || { echo "Docker did not start; see /var/log/nbexec-dockerd.log" >&2; exit 3; }
}

ensure_venv() {
    if [ ! -x .venv/bin/python ]; then
        log "creating .venv"
        python3 -m venv .venv
    fi
    log "installing nbexec and its test tools into .venv"
    .venv/bin/pip install -q -e '.[test,dev]' 2>&1 | grep -v "is ignored" || true
    .venv/bin/python -c "import nbexec, pytest" # fail here, not in the tests, when the install broke
}

have_default_base() {
    docker image inspect python:3.12-slim >/dev/null 2>&1 || timeout 60 docker pull -q python:3.12-slim >/dev/null 2>&1
}

ensure_image() {
    local args=()
    local ca="${NBEXEC_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
    [ -f "$ca" ] && args+=(--ca-bundle "$ca")
    if [ "${NBEXEC_AIRGAPPED:-}" = 1 ] || ! have_default_base; then
        command -v debootstrap >/dev/null || { apt-get update -qq; apt-get install -y -qq debootstrap >/dev/null; }
        args+=(--debootstrap)
        log "no registry: building the runtime image on a debootstrapped Debian base"
    else
        log "building the runtime image"
    fi
    .venv/bin/nbexec image build "${args[@]}" 2>&1 | grep -vE '^ ---> |^Step |Removing intermediate' | tail -5
    .venv/bin/nbexec doctor
}

ensure_azurite() {
    # Azurite (Microsoft's Azure Storage emulator, from npm) for the Azure upload tests; kept in .tools/.
    if [ -x .tools/node_modules/.bin/azurite-blob ] && [ -x .tools/node_modules/.bin/tsc ]; then return; fi
    command -v npm >/dev/null || { echo "npm is needed to install Azurite (apt-get install nodejs npm)" >&2; exit 3; }
    log "installing Azurite and TypeScript (for the TypeScript example's test) into .tools/"
    npm install --silent --no-audit --no-fund --prefix .tools azurite@3.37.0 typescript@5 @types/node@20 >/dev/null
}

ensure_docker
ensure_venv
ensure_image
ensure_azurite
