"""The one error type config raises. The CLI turns it into `prog: error: ...` and exit 2."""


class ConfigError(ValueError):
    """A flag value or combination is invalid; the message names the flags involved."""
