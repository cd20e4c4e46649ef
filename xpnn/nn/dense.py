"""Fully connected layer with a fused bias + activation."""

from __future__ import annotations

from typing import Any

from xpnn.backends.kernels import ACTIVATIONS
from xpnn.nn import init
from xpnn.nn.layer import Array, Context, Layer, check_int
from xpnn.phases import WGRAD


class Dense(Layer):
    """``y = act(x @ W + b)``; the activation is fused so one kernel touches ``z`` once."""

    # Ranks of one node that share the batch instead of gradients set this (see
    # ``parallel.shared_batch``): backward hands it ``x`` and ``dz``, and the gradients are
    # made later, each rank computing some rows of them over every rank's samples. A share
    # that ``splits_units`` runs the training pass itself, with the slices below.
    batch_share: Any = None

    def __init__(self, units: int, activation: str = "identity") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"Dense: unknown activation {activation!r}")
        self.units = check_int("Dense", "units", units)
        self.activation = activation

    def setup(self, in_shape: tuple[int, ...], rng) -> tuple[int, ...]:  # noqa: ANN001
        if len(in_shape) != 1:
            raise ValueError(f"Dense expects flat inputs, got shape {in_shape}: add Flatten")
        fan_in = in_shape[0]
        shape = (fan_in, self.units)
        self.add_param("W", init.for_activation(rng, shape, fan_in, self.units, self.activation))
        self.add_param("b", 0.0, (self.units,))
        return (self.units,)

    def forward(self, x: Array, ctx: Context) -> Array:
        features = self.params["W"].shape[0]  # a row-split layer (RowDense) holds some rows
        if x.ndim != 2 or x.shape[1] != features:
            raise ValueError(
                f"Dense built for {features} input features, got batch shape {tuple(x.shape)}"
            )
        if x.dtype != self.params["W"].dtype:  # float64 (or uint8) into a float32 network:
            x = self.xp.asarray(x, dtype=self.params["W"].dtype)  # not a float64 pass
        if ctx.train and self.batch_share is not None and self.batch_share.splits_units:
            return self.batch_share.forward(x)
        z = self.complete(self.xp.matmul(x, self.params["W"]))
        y = self.kernels.bias_act(z, self.params["b"], self.activation)
        self.x, self.y = x, y
        return y

    def complete(self, z: Array) -> Array:
        """``x @ W`` as this layer computed it is the whole pre-activation; a layer holding only
        some rows of ``W`` (tensor parallelism) sums the ranks' parts here."""
        return z

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        share = self.batch_share
        if share is not None and share.splits_units:
            return share.backward(dy, need_dx)
        dz, db = self.kernels.bias_act_backward(dy, self.y, self.activation)
        if share is None:
            with WGRAD:
                self.kernels.matmul_into(self.x.T, dz, self.grads["W"])
            self.grads["b"][...] = db
        else:
            share.put(self.x, dz)
        return self.input_grad(dz) if need_dx else None

    def input_grad(self, dz: Array) -> Array:
        """``dx = dz @ W.T``: what the layer below receives."""
        return self.xp.matmul(dz, self.params["W"].T)

    # -- slices of the above, for ranks that split a layer's units (``shared_batch``) --------
    def forward_units(self, x: Array, cols: slice, out: Array) -> None:
        """``out[...] = act(x @ W[:, cols] + b[cols])``: the units ``cols`` of ``forward``."""
        z = self.kernels.matmul_into(x, self.params["W"][:, cols], out)
        y = self.kernels.bias_act(z, self.params["b"][cols], self.activation)
        if y is not out:
            out[...] = y

    def backward_units(self, dy: Array, y: Array, cols: slice) -> None:
        """``dy`` (of the units ``cols``) becomes ``dz`` in place, and ``b[cols]`` gets its
        gradient: the units ``cols`` of ``backward``'s first line."""
        dz, db = self.kernels.bias_act_backward(dy, y, self.activation)
        if dz is not dy:
            dy[...] = dz
        self.grads["b"][cols] = db

    def input_grad_rows(self, dz: Array, rows: slice, out: Array) -> None:
        """``out[...] = dz @ W[rows].T``: the inputs ``rows`` of ``backward``'s ``dx``."""
        self.kernels.matmul_into(dz, self.params["W"][rows].T, out)

    def grads_of_share(self, x: Array, dz: Array, rows: slice, cols: slice | None) -> None:
        """Assign the gradients of ``W[rows]`` and ``b[cols]`` (none if None) from a batch's
        inputs ``x`` and pre-activation gradients ``dz``: one share of what ``backward``
        assigns whole."""
        with WGRAD:
            self.kernels.matmul_into(x[:, rows].T, dz, self.grads["W"][rows])
        if cols is not None:
            self.grads["b"][cols] = self.xp.sum(dz[:, cols], axis=0)

    def __repr__(self) -> str:
        return f"Dense({self.units}, {self.activation})"
