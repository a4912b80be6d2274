#!/usr/bin/env bash
# Checks that the Open MPI runtime tools/pack-mpi.sh packs works on a machine without MPI (the
# GPU machines): unpacks it, hides this machine's own Open MPI and PMIx (their libraries,
# plugins, programs and settings, in a private mount namespace), and runs the communicator
# conformance suite on 2 ranks through tools/mpirun.sh with PW_MPI_HOME. Where no private
# mount namespace can be made (a container without CAP_SYS_ADMIN) it fails, saying why: run
# with the system's Open MPI visible, it would pass without testing the packed one.
# Usage: tools/mpi_packed_check.sh (after `cargo build --release -p pipewright --features mpi
# --example mpi_check`)
set -euo pipefail
cd "$(dirname "$0")/.."
check=target/release/examples/mpi_check
[ -x "$check" ] || { echo "mpi_packed_check: build $check first" >&2; exit 1; }
home=$(mktemp -d)
trap 'rm -rf "$home"' EXIT
bash tools/pack-mpi.sh "$home/mpi.txz"
tar -C "$home" -xJf "$home/mpi.txz"
hidden=$(for pkg in openmpi-bin libopenmpi3 openmpi-common libpmix2 libhwloc15 libevent-core-2.1-7; do
  dpkg -L "$pkg"; done | grep -E '\.so|^/usr/bin/|^/etc/openmpi/' | sort -u)
run() { PW_MPI_HOME=$home bash tools/mpirun.sh 2 "$check"; }
if unshare -m true 2>/dev/null; then
  export -f run
  export home check hidden
  # Every file of those packages becomes empty, every plugin folder an empty one.
  unshare -m bash -c '
    set -euo pipefail
    for d in /usr/lib/x86_64-linux-gnu/openmpi /usr/lib/x86_64-linux-gnu/pmix2 /usr/share/openmpi; do
      mount -t tmpfs none "$d"
    done
    while read -r f; do
      if [ -f "$f" ] && [ ! -L "$f" ]; then mount --bind /dev/null "$f"; fi
    done <<<"$hidden"
    if ompi_info >/dev/null 2>&1; then echo "mpi_packed_check: the system Open MPI is still usable" >&2; exit 1; fi
    run'
else
  # With the system's Open MPI visible the run would pass on it: nothing this check exists
  # for would be tested.
  echo "mpi_packed_check: no private mount namespace here (unshare -m fails: a container without \
CAP_SYS_ADMIN), so the system Open MPI cannot be hidden and the packed one is not tested" >&2
  echo "0 passed, 1 failed"
  exit 1
fi
