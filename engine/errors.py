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


class ParameterError(BrassError):
    """A generation parameter out of range (max_tokens, temperature, ...), found by the engine's
    one check of it (engine/sampling.py). `param` is the engine's name for it; `template` is the
    message with `{name}` where the parameter is named, so that each front end names it its own
    way (`'max_tokens'` in an API error, `--max-tokens` on the command line); `code` is the
    OpenAI error code an API answer carries."""

    def __init__(self, param: str, template: str, code: str = "invalid_value"):
        self.param, self.template, self.code = param, template, code
        super().__init__(self.named(param))

    def named(self, name: str) -> str:
        return self.template.replace("{name}", name)
