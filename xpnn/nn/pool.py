"""2-D max-pooling (NCHW), floor mode: windows that do not fit are dropped (Keras 'valid')."""

from xpnn.nn.layer import Array, Context, Layer, check_int


class MaxPool2D(Layer):
    """Max over ``size`` x ``size`` windows every ``stride`` (default: ``size``) positions."""

    def __init__(self, size: int = 2, stride: int | None = None) -> None:
        super().__init__()
        if isinstance(size, (tuple, list)) or isinstance(stride, (tuple, list)):
            raise TypeError(
                f"MaxPool2D: size and stride must be ints (square windows only), "
                f"got size={size!r}, stride={stride!r}"
            )
        self.size = check_int("MaxPool2D", "size", size)
        self.stride = check_int("MaxPool2D", "stride", stride) if stride is not None else self.size

    def setup(self, in_shape: tuple[int, ...], rng) -> tuple[int, ...]:  # noqa: ANN001
        if len(in_shape) != 3:
            raise ValueError(f"MaxPool2D expects (C, H, W) inputs, got shape {in_shape}")
        c, h, w = in_shape
        oh = (h - self.size) // self.stride + 1
        ow = (w - self.size) // self.stride + 1
        if oh < 1 or ow < 1:
            raise ValueError(f"MaxPool2D window {self.size} larger than input {in_shape}")
        self.channels = c
        return (c, oh, ow)

    def extent_read(self, in_shape: tuple[int, ...]) -> tuple[int, int]:
        """The (rows, columns) of a ``(C, H, W)`` input that some window covers."""
        _, oh, ow = self.setup(in_shape, None)
        return (oh - 1) * self.stride + self.size, (ow - 1) * self.stride + self.size

    def forward(self, x: Array, ctx: Context) -> Array:
        # the height and width may be fewer than built for (``extent_read``), not the channels
        if x.ndim != 4 or x.shape[1] != self.channels or min(x.shape[2:]) < self.size:
            raise ValueError(
                f"MaxPool2D built for {self.channels} channels and {self.size}x{self.size} "
                f"windows, got batch shape {tuple(x.shape)}"
            )
        y, self.idx = self.kernels.maxpool2d_forward(x, self.size, self.stride)
        self.x_shape = tuple(x.shape)
        return y

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        if not need_dx:
            return None
        return self.kernels.maxpool2d_backward(dy, self.idx, self.x_shape, self.size, self.stride)

    def __repr__(self) -> str:
        extra = f", stride={self.stride}" if self.stride != self.size else ""
        return f"MaxPool2D({self.size}{extra})"
