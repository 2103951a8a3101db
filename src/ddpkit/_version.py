"""The version of ddpkit: one place, read by the package, the CLI and every checkpoint written."""

__version__ = "0.1.0"
