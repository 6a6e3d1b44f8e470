"""User-facing errors.

Everything the engine raises for bad input derives from BrassError; the CLI prints its message
and exits with status 2 instead of showing a traceback.
"""


class BrassError(Exception):
    """An error whose message is meant for the user."""


class GGUFError(BrassError):
    """The file is not a GGUF we can read (bad magic, truncated, inconsistent)."""


class UnsupportedError(BrassError):
    """A valid file that uses something Brass does not implement (architecture, tensor type)."""


class ModelNotFound(BrassError):
    """Neither a path nor a catalog name."""


class DownloadError(BrassError):
    """A catalog model could not be fetched or failed its checksum."""
