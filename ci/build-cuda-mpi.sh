#!/usr/bin/env bash
# Build a CUDA-aware Open MPI and mpi4py against it into one self-contained, relocatable prefix,
# from registry packages only, on a machine with no GPU and no CUDA toolkit:
#   - Open MPI 4.1.4 from Debian's source package (bookworm, Debian's patches applied);
#   - cuda.h and cuda_runtime.h from PyPI's nvidia-cuda-runtime-cu12 wheel: Open MPI 4.1 needs
#     only the headers to build, and loads libcuda.so.1 (the driver) with dlopen at run time;
#   - mpi4py built from its sdist with the prefix's mpicc, for each Python interpreter given.
# Every input is pinned by version and hash, so a rerun builds the same thing.
#
# Usage: bash ci/build-cuda-mpi.sh [PREFIX]        (default: .cuda-mpi in the repository root)
# Environment:
#   PYTHONS  interpreters to build mpi4py for (default: python3, plus a Python 3.12 found
#            on PATH or under pyenv, the GPU machine's interpreter)
#   JOBS     make -j (default: the number of cores)
# Then: . PREFIX/env.sh; mpirun -n 2 python -m xpnn ...     (see docs/cuda-aware-mpi.md)
# Exits non-zero unless ompi_info reports mpi_built_with_cuda_support:value:true.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PREFIX="$(realpath -m "${1:-$ROOT/.cuda-mpi}")"
JOBS="${JOBS:-$(nproc)}"

OMPI_DEB_VERSION=4.1.4-3
CUDA_RUNTIME_REQ="nvidia-cuda-runtime-cu12==12.9.79 \
--hash=sha256:25bba2dfb01d48a9b59ca474a1ac43c6ebf7011f1b0b8cc44f54eb6ac48a96c3"
MPI4PY_REQ="mpi4py==4.1.2 \
--hash=sha256:56860286dc45f20e8821e93cb06669e30462348bf866f685553fa4b712d58d02"
DEBIAN_KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

log() { echo "[build-cuda-mpi $(date -u +%H:%M:%S)] $*"; }
die() { echo "build-cuda-mpi: $*" >&2; exit 1; }

for tool in apt-get dpkg-source gcc g++ make perl realpath strip; do
  command -v "$tool" >/dev/null || die "$tool not found (apt-get install dpkg-dev build-essential)"
done
[ -r "$DEBIAN_KEYRING" ] || die "$DEBIAN_KEYRING missing (apt-get install debian-archive-keyring)"

is_py312() { "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; }
if [ -z "${PYTHONS:-}" ]; then
  PYTHONS="python3"
  if ! is_py312 python3; then
    # a pyenv shim on PATH may not run: take the first candidate that does
    pyenv_root="$(pyenv root 2>/dev/null || true)"
    for cand in python3.12 ${pyenv_root:+"$pyenv_root"/versions/3.12.*/bin/python3}; do
      if is_py312 "$cand"; then PYTHONS="$PYTHONS $cand"; break; fi
    done
  fi
fi
for py in $PYTHONS; do
  "$py" -c 'import sys' 2>/dev/null || die "PYTHONS: $py does not run"
done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/build-cuda-mpi.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)
log "prefix $PREFIX, work $WORK, make -j$JOBS, mpi4py for: $PYTHONS"

# 1. Open MPI's source from Debian, with a private apt state: the system's sources stay as they
#    are, and apt checks the Sources index against Debian's signed Release and the tarballs
#    against the index.
APT="$WORK/apt"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$WORK/src"
echo "deb-src [signed-by=$DEBIAN_KEYRING] http://deb.debian.org/debian bookworm main" \
  >"$APT/sources.list"
APT_OPTS=(-q -o "Dir::Etc::SourceList=$APT/sources.list" -o "Dir::Etc::SourceParts=$APT/none"
  -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache" -o "APT::Sandbox::User=root")
log "apt-get source openmpi=$OMPI_DEB_VERSION"
apt-get "${APT_OPTS[@]}" update >/dev/null
(cd "$WORK/src" && apt-get "${APT_OPTS[@]}" source --download-only "openmpi=$OMPI_DEB_VERSION" \
  >/dev/null)
# dpkg-source may say it cannot check the maintainer's signature (no Debian keyring package):
# the files were already checked by apt against the signed index.
(cd "$WORK/src" && dpkg-source -q -x "openmpi_${OMPI_DEB_VERSION}.dsc" ompi >/dev/null)
SRC="$WORK/src/ompi"
# Debian's patches to configure.ac, *.am and *.m4 adapt its packaging (libdir, pkg-config,
# hppa, ia64); the shipped configure and Makefile.in are used, so mark them newer than the
# patched inputs and make never asks for autotools.
find "$SRC" \( -name configure -o -name Makefile.in -o -name aclocal.m4 -o -name '*.h.in' \
  -o -name 'config.h.in' \) -exec touch {} +

# 2. The CUDA headers, from the wheel (unpacked; no install).
log "CUDA headers from $(echo "$CUDA_RUNTIME_REQ" | cut -d' ' -f1)"
echo "$CUDA_RUNTIME_REQ" >"$WORK/cuda-req.txt"
"${PYTHONS%% *}" -m pip download -q --no-deps --only-binary=:all: --require-hashes \
  -r "$WORK/cuda-req.txt" -d "$WORK/wheels"
"${PYTHONS%% *}" -m zipfile -e "$WORK"/wheels/nvidia_cuda_runtime_cu12-*.whl "$WORK/cuda"
CUDA_DIR="$WORK/cuda/nvidia/cuda_runtime"
[ -f "$CUDA_DIR/include/cuda.h" ] || die "cuda.h not in the wheel at $CUDA_DIR/include"

# 3. Open MPI. Everything it needs is built in (hwloc, libevent, PMIx) or left out (Fortran,
#    OpenSHMEM, network libraries), so the prefix runs on any x86-64 glibc Linux.
log "configure"
rm -rf "$PREFIX"
mkdir -p "$WORK/build"
cd "$WORK/build"
"$SRC/configure" --prefix="$PREFIX" \
  --with-cuda="$CUDA_DIR" --enable-mpi-ext=cuda \
  --disable-mpi-fortran --disable-oshmem --disable-mpi-java --disable-static \
  --with-hwloc=internal --with-libevent=internal --with-pmix=internal \
  --without-ucx --without-verbs --without-ofi --without-psm --without-psm2 \
  --without-knem --without-xpmem --without-lustre --without-gpfs \
  CFLAGS="-O2" CXXFLAGS="-O2" >"$WORK/configure.log" 2>&1 \
  || { tail -40 "$WORK/configure.log"; die "configure failed"; }
grep -E "^CUDA support" "$WORK/configure.log" || true
log "make -j$JOBS"
make -j"$JOBS" >"$WORK/make.log" 2>&1 || { tail -40 "$WORK/make.log"; die "make failed"; }
make install >"$WORK/install.log" 2>&1 || { tail -40 "$WORK/install.log"; die "install failed"; }
cd "$ROOT"

# 4. mpi4py against it, one copy per interpreter (the extension is tied to its Python version).
echo "$MPI4PY_REQ" >"$WORK/mpi4py-req.txt"
for py in $PYTHONS; do
  ver="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  log "mpi4py for Python $ver ($py)"
  # -I first: a virtual environment's include/ comes before the wrapper's own directory, and
  # holds the mpich wheel's mpi.h where that wheel is installed.
  CFLAGS="-O0 -g0 -I$PREFIX/include" MPICC="$PREFIX/bin/mpicc" \
    "$py" -m pip install -q --no-cache-dir \
    --no-binary mpi4py --no-deps --require-hashes -r "$WORK/mpi4py-req.txt" \
    --target "$PREFIX/python/$ver" >"$WORK/mpi4py-$ver.log" 2>&1 \
    || { tail -30 "$WORK/mpi4py-$ver.log"; die "mpi4py for $py failed"; }
done

# 5. Strip, drop what nothing runs (man pages, libtool archives), and write env.sh.
rm -rf "$PREFIX/share/man" "$PREFIX/share/doc"
find "$PREFIX" -name '*.la' -delete
find "$PREFIX" -name '__pycache__' -type d -prune -exec rm -rf {} +
find "$PREFIX" -type f \( -name '*.so*' -o -perm -u+x \) -print0 \
  | while IFS= read -r -d '' f; do
      if head -c4 "$f" | grep -q 'ELF'; then strip --strip-unneeded "$f" 2>/dev/null || true; fi
    done
cp "$ROOT/ci/cuda-mpi-env.sh" "$PREFIX/env.sh"

# 6. The check: built with CUDA support, or this build is of no use.
# shellcheck disable=SC1091
. "$PREFIX/env.sh"
ompi_info --parsable --all | grep -E "mpi_built_with_cuda_support:value" || true
if ! ompi_info --parsable --all | grep -q "mpi_built_with_cuda_support:value:true"; then
  die "ompi_info does not report mpi_built_with_cuda_support:value:true"
fi
for py in $PYTHONS; do  # env.sh picks the mpi4py of the Python named in PYTHON
  # shellcheck disable=SC2016
  PYTHON="$py" bash -c '. "$1/env.sh" && "$PYTHON" -c "from mpi4py import MPI
print(\"mpi4py\", MPI.Get_library_version().split(\",\")[0], \"for Python\", MPI.__file__)"' \
    _ "$PREFIX" || die "mpi4py does not import with $py"
done
log "done in $(($(date +%s) - START)) s; $(du -sh "$PREFIX" | cut -f1) in $PREFIX"
echo "use it with: . $PREFIX/env.sh"
