#!/usr/bin/env bash
# Lint and type-check (CI runs this too, before the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check nbexec tests benchmarks examples scripts
.venv/bin/mypy
