# shellcheck shell=bash
# Source this file (". PREFIX/env.sh") to use the CUDA-aware Open MPI that
# ci/build-cuda-mpi.sh built into PREFIX, and the mpi4py built against it, wherever PREFIX was
# moved or carried to. Set PYTHON first if the interpreter is not python3.
_cuda_mpi_prefix="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" && pwd)"
# Open MPI finds its components, help texts and settings under OPAL_PREFIX, not the configured
# path, so the prefix runs from any place.
export OPAL_PREFIX="$_cuda_mpi_prefix"
export PATH="$_cuda_mpi_prefix/bin${PATH:+:$PATH}"
export LD_LIBRARY_PATH="$_cuda_mpi_prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
_cuda_mpi_py="$("${PYTHON:-python3}" -c 'import sys; print("%d.%d" % sys.version_info[:2])' \
  2>/dev/null || true)"
if [ -n "$_cuda_mpi_py" ] && [ -d "$_cuda_mpi_prefix/python/$_cuda_mpi_py" ]; then
  export PYTHONPATH="$_cuda_mpi_prefix/python/$_cuda_mpi_py${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "env.sh: no mpi4py for Python ${_cuda_mpi_py:-?} in $_cuda_mpi_prefix/python" \
    "(rebuild with PYTHONS=... bash ci/build-cuda-mpi.sh)" >&2
fi
# mpirun refuses root unless told; containers and CI run as root.
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# One rank a GPU can mean more ranks than the cores hwloc counts in a container's quota.
export OMPI_MCA_rmaps_base_oversubscribe=1
# Without the CUDA driver every process would print the same warning; `python -m xpnn info`
# says once whether the device or the driver is missing.
export OMPI_MCA_opal_warn_on_missing_libcuda=0
unset _cuda_mpi_prefix _cuda_mpi_py
