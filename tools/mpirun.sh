#!/usr/bin/env bash
# mpirun with the settings this project's machines need: allowed as root, more ranks than
# cores, and no cross-memory-attach (containers forbid ptrace).
# Usage: tools/mpirun.sh NP PROGRAM [ARGS...]
set -euo pipefail
np=$1
shift
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec mpirun --oversubscribe --mca btl_vader_single_copy_mechanism none -np "$np" "$@"
