"""`--rm-type remote_rm`: ask a reward model served over HTTP (`--rm-url`).

One attempt = one `POST rm_url` with JSON `{"prompt", "response", "label", "metadata"}`
(metadata is the sample's metadata JSON, parsed; the label is the data row's value, a dict or a
number as such, as Miles posts `sample.label`). The answer is a JSON number, or an object
from which `to_reward` takes `--reward-key` (else "reward", else "score"). A refused
connection, a timeout, a non-2xx status or a body that is not JSON raises: the scorer retries
the attempt `--reward-retries` times with backoff and then fails the group with the reason.
A remote RM that is down is never a reward of 0.

The client (httpx, connection pooling) belongs to the event loop that first used it; the
owner closes it with `aclose()`.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from millstream.common.http_pool import make_client
from millstream.common.types import Sample


class RemoteRM:
    def __init__(self, url: str, timeout_s: float):
        self.url = url
        self.timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = make_client(httpx.Timeout(self.timeout_s))
        return self._client

    async def __call__(self, sample: Sample, prompt: str, response: str) -> Any:
        """The remote RM's raw answer (number or JSON object) for one sample."""
        payload = {
            "prompt": prompt,
            "response": response,
            "label": json.loads(sample.label_json) if sample.label_json else sample.label,
            "metadata": json.loads(sample.metadata_json) if sample.metadata_json else {},
        }
        try:
            reply = await self._http().post(self.url, json=payload)
        except httpx.HTTPError as err:
            raise ConnectionError(
                f"remote RM {self.url} unreachable: {type(err).__name__}: {err}"
            ) from err
        if reply.status_code // 100 != 2:
            raise ConnectionError(
                f"remote RM {self.url} answered HTTP {reply.status_code}: {reply.text[:200]!r}"
            )
        try:
            return reply.json()
        except ValueError as err:
            raise ValueError(
                f"remote RM {self.url} answered non-JSON: {reply.text[:200]!r}"
            ) from err

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
