"""A plugin that raises fails its group, at once and loudly; it is never retried.

A plugin (a function the run config names: --custom-rm-path, --custom-generate-function-path,
--rollout-function-path, a filter) that raises, or returns what it must not, has a bug that a
second try repeats. So the service that called it ends the group FAILED with a `PluginError`
(flag, path, the exception's type and message, its traceback, the service) and the reason
`"<service>: <flag> <path> raised <Type>: <message>"`; the trainer prints the first traceback
of each distinct error (`error_key`) and stops the run after --max-consecutive-failed-groups
such groups in a row (trainer/observe/plugin_failures.py).

What the plugin talks to failing is no bug of the plugin (`is_infrastructure`: a connection
or HTTP error, a timeout, millstream's own errors such as GenerationFailed): those keep the
retries of the service that called it (the reward's --reward-retries, the router's).

`PluginFailed` carries the PluginError from where the plugin raised to where the group is
failed (through Celery as JSON: `to_json` / `from_json`). Its traceback is formatted when it
is made, starting at the plugin's own frames (the caller's frames say nothing the flag does
not), and cut to `MAX_TRACEBACK_CHARS`.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, NoReturn

from google.protobuf.json_format import MessageToDict, ParseDict

from .errors import MillstreamError
from .types import PluginError

MAX_MESSAGE_CHARS = 2000
MAX_TRACEBACK_CHARS = 12_000
_OUR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # millstream's
# Errors of the HTTP clients a plugin may use to reach a verifier or the router.
_HTTP_LIBRARIES = frozenset({"httpx", "httpcore", "aiohttp", "requests", "urllib3"})


class PluginFailed(Exception):
    """A plugin raised or returned a wrong value: its group fails now (module docstring)."""

    def __init__(self, error: PluginError):
        self.error = error
        super().__init__(describe(error))

    @classmethod
    def of(cls, err: BaseException, flag: str, path: str, service: str) -> PluginFailed:
        return cls(plugin_error(err, flag, path, service))

    @property
    def reason(self) -> str:
        return describe(self.error)

    def to_json(self) -> dict[str, Any]:
        return {"plugin_error": MessageToDict(self.error, preserving_proto_field_name=True)}

    @classmethod
    def from_json(cls, value: Any) -> PluginFailed | None:
        """The PluginFailed `to_json` made, or None when `value` is something else."""
        if not isinstance(value, dict) or not isinstance(value.get("plugin_error"), dict):
            return None
        return cls(ParseDict(value["plugin_error"], PluginError(), ignore_unknown_fields=True))


def plugin_error(err: BaseException, flag: str, path: str, service: str) -> PluginError:
    """The PluginError of `err`, raised by (or about) the plugin `flag` `path` in `service`."""
    message = str(err)
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + " ..."
    return PluginError(
        flag=flag,
        path=path,
        type=type(err).__name__,
        message=message,
        traceback=format_traceback(err, path),
        service=service,
    )


def describe(error: PluginError) -> str:
    """The group's failure reason: "<service>: <flag> <path> raised <Type>: <message>"."""
    return f"{error.service}: {error.flag} {error.path} raised {error.type}: {error.message}"


def error_key(error: PluginError) -> tuple[str, str, str, str]:
    """What makes two plugin errors the same error (their traceback is printed once)."""
    return (error.flag, error.path, error.type, error.message)


def format_traceback(err: BaseException, path: str) -> str:
    """`err`'s traceback from the first frame of the plugin's module on, its chained errors
    included. When no frame is the plugin's (a wrong answer found by the caller, a call with
    the wrong arguments), millstream's frames are left out: the flag and path say it all."""
    te = traceback.TracebackException.from_exception(err)
    plugin_file = _module_file(path)
    start = next((i for i, f in enumerate(te.stack) if f.filename == plugin_file), None)
    if start is not None:
        te.stack = traceback.StackSummary.from_list(te.stack[start:])
    else:
        ours = [f for f in te.stack if not f.filename.startswith(_OUR_DIR)]
        te.stack = traceback.StackSummary.from_list(ours)
    text = "".join(te.format())
    if len(text) > MAX_TRACEBACK_CHARS:
        head = MAX_TRACEBACK_CHARS // 4
        cut = len(text) - MAX_TRACEBACK_CHARS
        text = f"{text[:head]}  ... ({cut} characters cut) ...\n{text[-(MAX_TRACEBACK_CHARS - head) :]}"
    return text


def is_infrastructure(err: BaseException) -> bool:
    """`err` is a failure of what the plugin talks to, not of the plugin: retried as before
    (an exception group when every error in it is)."""
    if isinstance(err, BaseExceptionGroup):
        return all(is_infrastructure(inner) for inner in err.exceptions)
    if isinstance(err, ConnectionError | TimeoutError | MillstreamError):
        return True
    return any(cls.__module__.split(".")[0] in _HTTP_LIBRARIES for cls in type(err).__mro__)


def reraise(err: Exception, flag: str, path: str, service: str) -> NoReturn:
    """Raise what a service raises when the plugin `flag` `path` raised `err` (call it in the
    `except` block): `err` itself when it is a PluginFailed already or an infrastructure
    failure, else a PluginFailed made of it."""
    if isinstance(err, PluginFailed) or is_infrastructure(err):
        raise err
    raise PluginFailed.of(err, flag, path, service) from err


def find(err: BaseException) -> PluginFailed | None:
    """The PluginFailed `err` is or holds (in an exception group), if any."""
    if isinstance(err, PluginFailed):
        return err
    if isinstance(err, BaseExceptionGroup):
        for inner in err.exceptions:
            found = find(inner)
            if found is not None:
                return found
    return None


def _module_file(path: str) -> str | None:
    module_name = path.rpartition(":")[0] if ":" in path else path.rpartition(".")[0]
    module = sys.modules.get(module_name)
    return getattr(module, "__file__", None) if module is not None else None
