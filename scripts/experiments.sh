#!/usr/bin/env bash
# The experiment suite: scripts/experiments.sh NAME [options]; NAME is table5,
# expert-size, planner, bandwidth-for-target, fig17, all or list. See
# scripts/experiments.py --help and docs/experiments.md.
set -euo pipefail
exec python3 "$(dirname "$0")/experiments.py" "$@"
