"""One copy of the parameters per node; each rank sums and updates its own slice of them.

With ``mpi-shm``, the node's ranks keep the parameters, the optimizer state and one gradient
row per rank in shared memory. After backward, rank r of the node adds the other rows into its
own row over its slice ``[lo, hi)`` only, (across nodes, allreduces that slice with the ranks
of the same local rank), and runs the optimizer on that slice. Nothing is copied into messages,
each optimizer element is updated once per node instead of once per rank, and the next forward
pass reads the parameters where the owners wrote them. Two fences per step order it all: the
gradients are complete before anyone sums, the update is complete before anyone reads.

The summed slice is ``g_r + sum of the others``; with the loss scaled by 1 / global batch this
is the gradient of the global batch, so 1 rank and N ranks compute the same update.
"""

from __future__ import annotations

from typing import Any

ALIGN = 16  # slice bounds on 64-byte lines (float32), so ranks never write one cache line


def shard_bounds(n: int, parts: int, index: int, align: int = ALIGN) -> tuple[int, int]:
    """[lo, hi) of part ``index`` when ``range(n)`` is cut into ``parts`` near-equal,
    ``align``-aligned slices (the last may be shorter; some may be empty for tiny n)."""
    per = -(-n // parts)
    per = -(-per // align) * align
    return min(n, index * per), min(n, (index + 1) * per)


class SharedUpdate:
    """The ``mpi-shm`` update scheme; built collectively by every rank of the job."""

    def __init__(self, model: Any, comm: Any, make_optimizer: Any) -> None:
        self.model, self.comm = model, comm
        n, dtype = model.size, model.params.dtype
        params = comm.shared_zeros((n,), dtype)
        rows = comm.shared_zeros((comm.local_size, n), dtype)
        me = comm.local_rank
        model.adopt(params, rows[me], copy=me == 0)
        lo, hi = shard_bounds(n, comm.local_size, me)
        self.slice = slice(lo, hi)
        self.own = rows[me, lo:hi]
        self.others = [rows[r, lo:hi] for r in range(comm.local_size) if r != me]
        self.optimizer = make_optimizer(params, rows[me], self.slice, comm.shared_zeros)
        self.grads_ready = None  # nothing to start during backward: the rows are already shared
        self.restores_checkpoint = me == 0  # one writer per shared buffer
        comm.fence()

    def broadcast_initial(self) -> None:
        """Node-local rank 0 wrote its parameters (``adopt``); across nodes, world rank 0's
        parameters and optimizer state go to the other nodes' local rank 0."""
        comm = self.comm
        if comm.nodes > 1 and comm.local_rank == 0:
            comm.cross.Bcast(self.model.params, root=0)
            for buf in self.optimizer.state.values():
                comm.cross.Bcast(buf, root=0)
        comm.fence()

    def finish(self) -> None:
        """After backward: sum this rank's slice of every row, update that slice, fence."""
        comm = self.comm
        comm.fence()  # every row is complete
        own = self.own
        for other in self.others:
            own += other
        if comm.nodes > 1:
            comm.cross_allreduce_(own)
        self.optimizer.step()
        comm.fence()  # every slice is updated before anyone's next forward pass
