"""Training over many ranks, as three packages with their factories in ``__init__``:

- ``comm``: how ranks talk, one interface for every transport (``make_communicator``);
- ``update``: how a step's gradients become one update (``make_update``);
- ``model``: strategies that wrap or swap a model's layers (tensor and pipeline parallelism,
  node-shared activations, the 2-D layout of replicas, the whole model gathered from pieces).

The process itself (world, threads, failure) is ``xpnn.runtime``. Importing this package
imports neither mpi4py nor CuPy.
"""
