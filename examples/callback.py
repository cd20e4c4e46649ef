"""A callback: ``xpnn.run.build_run`` assembles what ``python -m xpnn`` does, and a
``xpnn.train.Callback`` watches the run without changing it. This one keeps the learning rate
of every step (a warmup, then a cosine decay) and each epoch's test loss, and prints a table:

    python examples/callback.py
    mpiexec -n 2 python examples/callback.py     # the same run on two ranks"""

from __future__ import annotations

import argparse

from xpnn.run import RunSpec, build_run
from xpnn.runtime import init_world
from xpnn.train import Callback


class Schedule(Callback):
    """The learning rate each step used, and each epoch's record (every rank sees them)."""

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.epochs: list[dict] = []

    def on_step_end(self, trainer, step) -> None:
        self.lrs.append(trainer.optimizer.lr)  # after the update: this step's rate

    def on_epoch_end(self, trainer, record) -> None:
        self.epochs.append(record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    spec = RunSpec(
        dataset="synthetic", synthetic_size=2000, hidden=(64,), epochs=args.epochs,
        lr=0.01, warmup_epochs=1, schedule="cosine", progress=False,
    )  # fmt: skip
    watch = Schedule()
    trainer = build_run(spec, init_world(), callbacks=[watch], log=lambda line: None)
    trainer.run()
    if trainer.is_root:  # every rank computed the same; one says it
        per_epoch = len(watch.lrs) // len(watch.epochs)
        print("epoch  first lr  last lr   test_loss  test_acc")
        for i, record in enumerate(watch.epochs):
            first, last = watch.lrs[i * per_epoch], watch.lrs[(i + 1) * per_epoch - 1]
            print(
                f"{record['epoch']:5d}  {first:.6f}  {last:.6f}  {record['test_loss']:9.4f}  "
                f"{record['test_acc']:8.4f}"
            )


if __name__ == "__main__":
    main()
