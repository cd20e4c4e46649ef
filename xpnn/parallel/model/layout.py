"""Who works with whom: rank r is place ``r % K`` of replica ``r // K`` (``--model-ranks``)."""

from __future__ import annotations

from dataclasses import dataclass

from xpnn.parallel.comm.base import Communicator, SelfCommunicator


@dataclass(frozen=True)
class Place:
    model_ranks: int  # ranks that hold one replica between them (1 under data parallelism)
    replicas: int  # replicas of the network: the ranks that split each batch
    index: int  # this rank's place within its replica: its slice or its stage
    replica: int  # which replica this rank belongs to: its share of each batch


@dataclass
class Groups:
    """The communicators of one rank: its whole job, its replica and its data-parallel peers."""

    world: Communicator  # every rank: barriers, the parameter digest, a pipeline's metrics
    model: Communicator  # this rank's replica: split layers and pipeline stages talk here
    data: Communicator  # the same place in every replica: they split batches, sum gradients

    @classmethod
    def of(cls, comm: Communicator, spread: bool = False) -> Groups:
        # the 1-D layouts: ``comm`` is the data group, or (``spread``) the model group
        alone = SelfCommunicator()
        return cls(comm, comm, alone) if spread else cls(comm, alone, comm)

    @property
    def name(self) -> str:
        if isinstance(self.data, SelfCommunicator):
            return self.model.name
        if isinstance(self.model, SelfCommunicator):
            return self.data.name
        return f"{self.model.name} (model) + {self.data.name} (data)"

    @property
    def fallback_reason(self) -> str | None:
        return self._reasons("fallback_reason")

    @property
    def auto_fallback(self) -> str | None:
        return self._reasons("auto_fallback")

    def _reasons(self, kind: str) -> str | None:
        reasons = [getattr(c, kind, None) for c in (self.model, self.data)]
        return "; ".join(r for r in dict.fromkeys(reasons) if r) or None
