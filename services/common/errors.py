"""User-facing errors. The CLI prints their message as `millstream: error: ...` (no traceback
wall) and exits non-zero; anything else is a bug and keeps its traceback."""


class MillstreamError(Exception):
    """An error the user can act on; the message says what and what to do next. The CLI
    exits with `exit_code`."""

    exit_code = 1


class ServiceUnavailable(MillstreamError):
    """A service we depend on (Redis, router, coordinator) cannot be reached."""


class Interrupted(MillstreamError):
    """A job gave up because its worker is stopping; its stream entry stays pending, and
    another consumer takes it over (nothing is lost, nothing is failed)."""
