"""StreamRL: disaggregated stream-generation RL post-training, orchestrated from the command line."""

__version__ = "0.1.0"
