#!/usr/bin/env bash
# Installs what the `mpi` feature needs (Open MPI, and libclang for the mpi crate's bindings)
# when it is missing. Debian/Ubuntu; runs apt-get as root or through sudo.
set -euo pipefail
pkgs=(libopenmpi-dev openmpi-bin libclang-dev)
if dpkg -s "${pkgs[@]}" >/dev/null 2>&1; then
  exit 0
fi
sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${pkgs[@]}"
