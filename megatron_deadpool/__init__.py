"""megatron-deadpool: zero-overhead in-memory replication and hot swap for Megatron-Core.

Each rank's distributed-optimizer shard is replicated every iteration into the memory of
peers in other failure domains; when ranks die or hang, spare processes take their places
at runtime and training continues from peers' memory (arXiv 2607.01646).
"""

__version__ = "0.1.0"
