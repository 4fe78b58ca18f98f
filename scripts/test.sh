#!/usr/bin/env bash
# The whole test suite as CI runs it: the tests spread over a few processes (pytest-xdist; each process has its own
# owner label, TMPDIR and pools, so none judges another's containers, folders or children), then the tests marked
# `alone`, which need the machine's Docker engine to themselves (one restarts it). Extra arguments go to both runs.
#
#   scripts/test.sh                       # everything but the load tests
#   NBEXEC_TEST_WORKERS=1 scripts/test.sh # one process (the slowest, and the plainest log)
#
# The suite waits on containers more than it computes: on 2 cores, 3 processes run it in less than half the time of
# one (the README's development section has the figures).
set -uo pipefail
cd "$(dirname "$0")/.."
workers="${NBEXEC_TEST_WORKERS:-$(( $(nproc) + 1 ))}"
if [ "$workers" -gt 1 ]; then spread=(-n "$workers" --dist worksteal); else spread=(-p no:xdist); fi
.venv/bin/python -m pytest "${spread[@]}" -m 'not load and not alone' "$@"
first=$?
# 5: no test was collected (arguments naming only tests of the other part)
.venv/bin/python -m pytest -p no:xdist -m 'alone and not load' "$@"
second=$?
[ "$first" = 5 ] && first=0; [ "$second" = 5 ] && second=0
if [ "$first" != 0 ]; then exit "$first"; fi
exit "$second"
