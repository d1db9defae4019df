"""ddpexp: config-driven experiments that compare distributed training strategies in PyTorch."""

__version__ = "0.1.0"
