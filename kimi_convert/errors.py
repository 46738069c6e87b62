"""Errors that end a command with one clear line and a non-zero exit."""
import signal


class KimiError(Exception):
    """Base class: the message is the whole story, printed as one line."""
    exit_code = 1


class ConfigError(KimiError):
    """config.json is missing, malformed, or contradicts itself."""


class CheckpointError(KimiError):
    """A shard, the index or a tensor is missing, truncated or inconsistent."""


class OutputError(KimiError):
    """The output cannot be written (exists, not a folder, an I/O error, ...)."""


class DiskSpaceError(OutputError):
    """The output does not fit on the disk. Its own exit code, so that a script can tell "get a
    bigger disk" from "the checkpoint is broken" (1)."""
    exit_code = 3


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived. A KeyboardInterrupt, so that it unwinds like Ctrl-C:
    through every `finally` (the writer's cleanup), past every `except Exception`."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum        # what a shell reports for a process ended by the signal
