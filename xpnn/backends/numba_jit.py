"""How every Numba kernel is compiled, in one place so no kernel file drifts from the others.

``error_model="numpy"``: under Numba's default (Python's) error model every float division
checks its divisor and may raise ``ZeroDivisionError``; that branch keeps LLVM from
vectorising the loop. The serial Adam loop on 100,000 float32 values took 318 us with it and
28 us without (1 thread, this machine); parallel builds already used NumPy's model, which is
why only the small arrays, on the serial build, paid. With NumPy's model x / 0 gives inf or
nan, as it does on the NumPy backend.
"""

from __future__ import annotations

JIT = {"nogil": True, "cache": True, "error_model": "numpy"}
ACT_CODE = {"identity": 0, "relu": 1, "sigmoid": 2, "tanh": 3}  # activations inside kernels
