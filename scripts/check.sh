#!/usr/bin/env bash
# Lint, type-check and check the import graph (CI runs this too, before the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check nbexec tests benchmarks examples scripts
.venv/bin/mypy
.venv/bin/python scripts/layers.py
