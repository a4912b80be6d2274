#!/usr/bin/env bash
# mpirun with the settings this project's machines need: allowed as root, more ranks than
# cores, and no cross-memory-attach (containers forbid ptrace).
# Usage: tools/mpirun.sh NP PROGRAM [ARGS...]
# PW_MPI_HOME=DIR runs the Open MPI that tools/pack-mpi.sh packed and DIR holds unpacked (on a
# machine with no MPI of its own) instead of the one on the PATH.
set -euo pipefail
np=$1
shift
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpirun=(mpirun)
if [ -n "${PW_MPI_HOME:-}" ]; then
  usr=$(realpath "$PW_MPI_HOME")/usr
  [ -x "$usr/bin/orterun" ] || { echo "mpirun.sh: PW_MPI_HOME=$PW_MPI_HOME holds no usr/bin/orterun (unpack tools/pack-mpi.sh's archive there)" >&2; exit 1; }
  lib=$usr/lib/x86_64-linux-gnu
  # Open MPI finds its plugins under OPAL_PREFIX; PMIx (Debian's, built apart) is told its own.
  export OPAL_PREFIX=$usr PMIX_MCA_mca_base_component_path=$lib/pmix2/lib/pmix PATH=$usr/bin:$PATH
  export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  mpirun=("$usr/bin/orterun" -x LD_LIBRARY_PATH -x OPAL_PREFIX -x PMIX_MCA_mca_base_component_path)
fi
exec "${mpirun[@]}" --oversubscribe --mca btl_vader_single_copy_mechanism none -np "$np" "$@"
