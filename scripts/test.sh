#!/usr/bin/env bash
# The test suite in tiers, each marked from what its tests need (tests/conftest.py reads their fixtures):
#
#   scripts/test.sh fast     # no Docker, no Node or Chromium: the inner loop (about 3 minutes on 2 cores)
#   scripts/test.sh docker   # the rest: the Docker and tools tiers spread over processes, then the `alone` tests
#   scripts/test.sh          # both, fast first (a fast failure stops the run before Docker is used)
#   NBEXEC_TEST_WORKERS=1 scripts/test.sh # one process (the slowest, and the plainest log)
#
# Extra arguments go to every pytest run. The fast tier runs with the engine unreachable (DOCKER_HOST points
# nowhere), so a test that needs Docker without saying so fails there instead of passing by luck.
# The suite waits on containers more than it computes: on 2 cores, 3 processes run it in less than half the time of
# one (docs/development.md has the figures). The `alone` tests need the engine to themselves.
set -uo pipefail
cd "$(dirname "$0")/.."
tier=all
case "${1:-}" in fast|docker|all) tier=$1; shift ;; esac
workers="${NBEXEC_TEST_WORKERS:-$(( $(nproc) + 1 ))}"
if [ "$workers" -gt 1 ]; then spread=(-n "$workers" --dist worksteal); else spread=(-p no:xdist); fi

# pytest's 5 (no test collected: arguments naming only tests of another part) is not a failure here.
run() { "$@"; local status=$?; [ "$status" = 5 ] && status=0; return "$status"; }

if [ "$tier" != docker ]; then
    echo "== fast tier (no Docker)" >&2
    run env DOCKER_HOST=unix:///nonexistent/nbexec-fast-tier.sock \
        .venv/bin/python -m pytest "${spread[@]}" -m 'not docker and not tools and not mutants and not load and not alone' "$@" \
        || exit $?
fi
if [ "$tier" != fast ]; then
    echo "== Docker tier" >&2
    run .venv/bin/python -m pytest "${spread[@]}" -m '(docker or tools or mutants) and not load and not alone' "$@"
    first=$?
    run .venv/bin/python -m pytest -p no:xdist -m 'alone and not load' "$@"
    second=$?
    [ "$first" != 0 ] && exit "$first"
    exit "$second"
fi
