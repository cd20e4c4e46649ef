"""xpnn: neural networks written once against an ``xp`` array namespace."""

__version__ = "0.1.0"
