"""User-facing errors: each names the problem in one line; the CLI prints it and exits non-zero."""


class MtpspecError(Exception):
    """Base class of every error caused by bad input (not by a bug)."""


class ModelLoadError(MtpspecError):
    """A checkpoint or tokenizer file that is missing, unreadable, of the wrong format or inconsistent."""


class ConfigError(MtpspecError):
    """A generation or drafter setting out of range (k < 1, negative temperature, ...)."""
