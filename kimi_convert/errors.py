"""Errors that end a command with one clear line and a non-zero exit."""


class KimiError(Exception):
    """Base class: the message is the whole story, printed as one line."""


class ConfigError(KimiError):
    """config.json is missing, malformed, or contradicts itself."""


class CheckpointError(KimiError):
    """A shard, the index or a tensor is missing, truncated or inconsistent."""


class OutputError(KimiError):
    """The output cannot be written (exists, disk full, ...)."""
