"""The stop watch thread asks whether MPI runs while the main thread may still be importing
``mpi4py.MPI``: a half-imported module must read as "not there", never raise."""

from __future__ import annotations

import sys
import types
from importlib.machinery import ModuleSpec

from xpnn.runtime import failure
from xpnn.runtime.interrupts import imported_mpi, mpi_rank_size


def half_imported() -> types.ModuleType:
    module = types.ModuleType("mpi4py.MPI")
    module.__spec__ = ModuleSpec("mpi4py.MPI", None)
    module.__spec__._initializing = True
    return module


def test_a_module_still_being_imported_is_not_there(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", half_imported())
    assert imported_mpi() is None
    assert failure._mpi_started() is False
    assert mpi_rank_size() == (0, 1)


def test_a_module_without_its_functions_yet_is_not_there(monkeypatch):
    module = half_imported()
    module.__spec__._initializing = False
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", module)
    assert imported_mpi() is None


def test_the_imported_module_is_returned():
    from mpi4py import MPI

    assert imported_mpi() is MPI
