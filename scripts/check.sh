#!/usr/bin/env bash
# Lint, type-check, check the import graph and build the documentation site strictly (CI runs this too, before
# the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check nbexec tests benchmarks examples scripts
.venv/bin/mypy
.venv/bin/python scripts/layers.py
# The site from docs/ (mkdocs.yml): a broken link or anchor, a missing page or snippet fails. Built outside the tree.
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site"
