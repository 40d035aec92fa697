"""Exception types raised for bad user input.

Every error names the key or value at fault, the rule it breaks, the actual values and
the fix, so a user can act on the message alone.
"""
from __future__ import annotations


class ShardwiseError(Exception):
    """Base class of every error shardwise raises on purpose."""


class ConfigError(ShardwiseError, ValueError):
    """A configuration key or value is invalid (bad type, bad combination, missing file)."""


class CheckpointError(ShardwiseError):
    """A checkpoint cannot be written or read (missing, corrupted, incompatible)."""


class LaunchError(ShardwiseError):
    """The launcher cannot start the requested job (bad flags, hostfile, ports, devices)."""


class DistributedError(ShardwiseError, RuntimeError):
    """The process group is missing or misconfigured for what was asked."""


class ZeroError(ShardwiseError):
    """A ZeRO partitioning rule was broken (e.g. reading a partitioned parameter)."""


class StorageError(ShardwiseError, OSError):
    """A file read or write of the IO layer failed (missing or short file, read-only or full
    disk, a buffer that cannot be used for IO); the message names the file."""


class UnsupportedFeatureError(ShardwiseError, NotImplementedError):
    """A DeepSpeed feature or engine method that shardwise does not implement; the message
    names it and says what to do instead."""
