#!/usr/bin/env bash
# Packs this machine's Open MPI runtime (what tools/install-mpi.sh installed) into one
# relocatable archive, for a machine that has no MPI and cannot install one (the lent GPU
# machines reach no package registry):
#
#   tools/pack-mpi.sh DEST.tar.xz
#
# The archive holds usr/ as Debian lays it out: mpirun and the Open MPI and PMIx libraries, their
# plugins and help texts, and the libraries they need beyond glibc and GCC's runtime (hwloc,
# libevent, ...). Plugins for fabrics a single machine does not use (UCX, libfabric, verbs,
# PSM) are left out with what they need. Unpack it anywhere and point tools/mpirun.sh at it
# with PW_MPI_HOME=DIR (it sets the prefixes and the library path).
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: tools/pack-mpi.sh DEST.tar.xz" >&2; exit 2; }
dest=$(realpath -m "$1")
command -v orterun >/dev/null || { echo "pack-mpi: no Open MPI here; run tools/install-mpi.sh" >&2; exit 1; }
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root=$stage/root
libdir=/usr/lib/x86_64-linux-gnu

# The packages' own files: programs, libraries, plugins, help texts.
for pkg in openmpi-bin libopenmpi3 openmpi-common libpmix2; do dpkg -L "$pkg"; done | sort -u |
  grep -vE '^/usr/share/(doc|man|lintian)/|/include/|\.a$|/pkgconfig/' | while read -r f; do
    if [ -f "$f" ] || [ -L "$f" ]; then
      mkdir -p "$root$(dirname "$f")"
      cp -a "$f" "$root$f"
    fi
  done
ln -sf orterun "$root/usr/bin/mpirun"

# Every shared object and program in it, with the libraries each needs (ldd lists them all,
# however indirectly needed). One that needs a fabric library is dropped; the others' outside
# needs are copied in, except glibc's and GCC's runtime, which every machine has.
fabric='libfabric|libuc[mpst]|libibverbs|librdmacm|libpsm|libnl-|libgfortran|libjvm|libcuda|libefa|libmlx'
system='linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libgcc_s|libstdc\+\+'
find "$root" -type f | while read -r f; do
  [ "$(head -c 4 "$f" | tail -c 3)" = ELF ] || continue # an ELF file's magic, without `file`
  deps=$(ldd "$f" 2>/dev/null | awk '/=>/ {print $1 " " $3}')
  if grep -qE "$fabric" <<<"$deps" || grep -q 'not found' <<<"$deps"; then
    rm -f "$f"
    continue
  fi
  { grep -vE "^($system)" <<<"$deps" || true; } | while read -r name path; do
    [ -e "$root$libdir/$name" ] || [ -e "$root$path" ] || cp -L "$path" "$root$libdir/$name"
  done
done
find "$root" -xtype l -delete # links to what was dropped
tar -C "$root" -cJf "$dest" usr
echo "pack-mpi: $(du -h "$dest" | cut -f1) in $dest"
