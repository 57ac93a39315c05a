"""The rollout worker's one HTTP client to the router: `/generate` with retries, and the
router's served weight version.

Owns two things every generation request passes through:

* Slots: at most `max_concurrency` (`--rollout-max-concurrency`) `/generate` requests in
  flight for the whole worker, whichever group they belong to, so one group's long-tail
  sample holds one slot and never blocks other groups. Waiters are served by priority, then
  first come first served: a resumed partial sample (priority 0, 1, ... in the buffer
  filter's order) goes before a fresh one (`FRESH`). A slot is free during retry backoff.
* Retries: a router that is down (connect error, broken connection, timeout) or answers 5xx or
  429 is retried `retry.attempts` times in all (`GENERATE_RETRY`, common/retry.py); then
  `GenerationFailed` names the last error. A 4xx other than 429 (the request itself is bad,
  e.g. a prompt longer than the context) fails at once: retrying cannot help. Each attempt
  has its own `rid` (SGLang refuses a rid that is still running somewhere).

* Coalescing: `/generate` calls made in the same event-loop turn (or within
  `coalesce_window_s` of each other, when it is > 0; None: never) with the same `n` go out as
  ONE batch request (SGLang's batch form: lists of input_ids, sampling_params and rids; the
  answer is the flat list, prompt by prompt), and each caller gets its own part back. A
  rollout's groups are claimed together, so the router, the HTTP stacks and the engine's
  request handling see one request per claim instead of one per group: on a small model
  those per-request costs were most of the rollout (py-spy).
  Failures stay per caller: a retryable failure of the batch is each member's failed
  attempt; a batch rejected as bad is re-sent one request each, so only the bad one fails.
  Only prompts with the same `n` share a batch (SGLang requires one n per batch).

An infrastructure failure is never a zero reward: callers turn GenerationFailed into a group
published with `failure_reason`. The W3C trace context of the caller rides in the headers (a
batch's is its `POST` span's, a child of its first member's span), and every request names the
groups it serves in X-Millstream-Groups (each caller's group: the `millstream.group_id` of its
current span), so the router's and engine's spans of a batch link to every group's trace, not
only the first's (common/telemetry.py).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind

from millstream.common.errors import Interrupted, MillstreamError
from millstream.common.http_pool import make_client
from millstream.common.retry import Backoff, retrying
from millstream.common.telemetry import (
    GROUP_IDS,
    GROUPS_HEADER,
    current_group,
    groups_header,
    inject_headers,
    tracer,
)

log = logging.getLogger("millstream.rollout")

# A caller's group (None: untraced, or not in a group's span) and its span's context.
Served = tuple[str | None, SpanContext]
# A caller's request body, the future its answer goes to, and whom it serves (the batch's links).
Member = tuple[dict[str, Any], "asyncio.Future[Any]", Served]

FRESH = 2**62
"""Priority of a sample that has not been aborted yet; resumed samples use 0, 1, ..."""


class GenerationFailed(MillstreamError):
    """The router could not produce a generation; the message says why and after how many
    attempts. `retryable` is False for a request the router rejected as bad."""

    def __init__(self, message: str, *, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


GENERATE_RETRY = Backoff(attempts=8, first_s=0.5, max_s=15.0)
"""8 attempts wait 23-46 s in all: longer than a router restart or the moment between an
engine's new version and the router serving it (503 "no eligible worker")."""


class Slots:
    """A semaphore whose waiters are served by (priority, arrival)."""

    def __init__(self, size: int):
        if size <= 0:
            raise ValueError(f"slots must be > 0 (got {size})")
        self.size = size
        self.busy = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrival = itertools.count()

    async def acquire(self, priority: int = FRESH) -> None:
        if self.busy < self.size and not self._waiters:
            self.busy += 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (priority, next(self._arrival), future)
        heapq.heappush(self._waiters, entry)
        try:
            await future  # release() handed us its slot before waking us
        except asyncio.CancelledError:
            if future.cancelled():
                self._waiters.remove(entry)
                heapq.heapify(self._waiters)
            else:
                self.release()  # woken and cancelled in the same tick: hand the slot on
            raise

    def release(self) -> None:
        if self._waiters:
            _, _, future = heapq.heappop(self._waiters)
            future.set_result(None)  # the slot passes straight to the waiter
            return
        self.busy -= 1


COALESCE_WINDOW_S = 0.0
"""0: calls of one event-loop turn go together. The groups of a claim reach `generate` in the
turn that started them (nothing before it suspends), so waiting longer only adds latency."""
MAX_BATCH = 64


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class RouterClient:
    """`/generate` through the router (SGLang's API), bounded and retried; see module docstring.

    `on_answer` is called after every generation that was not aborted: evidence that the
    engines answer again after a pause (the partial buffer listens).
    """

    def __init__(
        self,
        url: str,
        *,
        max_concurrency: int,
        retry: Backoff = GENERATE_RETRY,
        timeout_s: float = 900.0,
        transport: httpx.AsyncBaseTransport | None = None,
        coalesce_window_s: float | None = COALESCE_WINDOW_S,
        max_batch: int = MAX_BATCH,
    ):
        self.url = url.rstrip("/")
        self.retry = retry
        self.slots = Slots(max_concurrency)
        self.coalesce_window_s = coalesce_window_s
        self.max_batch = max_batch
        self.batches_sent = 0  # batch requests of more than one prompt (tests, curiosity)
        self._pending: dict[int, list[Member]] = {}
        self._flushing: set[asyncio.Future[None]] = set()
        self.on_answer: Callable[[], None] | None = None
        # A generation may take minutes (long responses, requests held while engines are
        # paused for a sync); connecting should not.
        # One keep-alive connection per request in flight, reused (common/http_pool.py).
        self._http = make_client(httpx.Timeout(timeout_s, connect=5.0), transport)
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        """The worker is stopping: a failed attempt is not retried (Interrupted instead), so
        a drain does not outlive a router that is gone too; answers still arrive."""
        self._stopping.set()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str,
        *,
        priority: int = FRESH,
    ) -> Any:
        """One `/generate` with `return_logprob`; the engine's JSON answer (text, output_ids,
        meta_info), or a list of n of them when sampling_params has n > 1 (SGLang's parallel
        sampling). GenerationFailed after the retries are spent."""
        body = {
            "input_ids": list(input_ids),
            "sampling_params": sampling_params,
            "return_logprob": True,
        }
        try:
            async for attempt in retrying(
                self.retry,
                f"generate {rid}",
                retry_on=lambda err: isinstance(err, GenerationFailed) and err.retryable,
                stop=self._stopping,
            ):
                with attempt:
                    n = attempt.retry_state.attempt_number
                    if n > 1 and self._stopping.is_set():
                        raise Interrupted(f"generate {rid}: not retried: stopping")
                    await self.slots.acquire(priority)
                    try:
                        answer, error = await self._post_once({**body, "rid": f"{rid}-a{n}"})
                    finally:
                        self.slots.release()
                    if answer is None:
                        raise GenerationFailed(error)
        except GenerationFailed as err:
            if not err.retryable:
                raise
            if self._stopping.is_set():
                raise Interrupted(f"generate {rid}: {err}; not retried: stopping") from None
            raise GenerationFailed(
                f"router {self.url}/generate failed {self.retry.attempts} times; last error: {err}"
            ) from None
        self._notice(answer)
        return answer

    async def _post_once(self, body: dict[str, Any]) -> tuple[Any, str]:
        """(answer, "") or (None, why it may be retried); GenerationFailed when it must not.
        Coalesced with the other calls of the same moment (module docstring)."""
        if self.coalesce_window_s is None:
            return await self._post_single(body, served=[current_group()])
        n = int(body["sampling_params"].get("n") or 1)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        members = self._pending.setdefault(n, [])
        members.append((body, future, current_group()))
        if len(members) == 1 and self.coalesce_window_s > 0:
            loop.call_later(self.coalesce_window_s, self._flush, n)
        elif len(members) == 1:
            loop.call_soon(self._flush, n)
        elif len(members) >= self.max_batch:
            self._flush(n)
        return await future

    def _flush(self, n: int) -> None:
        members = self._pending.pop(n, None)
        if members:
            task = asyncio.ensure_future(self._post_batch(members, n))
            self._flushing.add(task)
            task.add_done_callback(self._flushing.discard)

    async def _post_batch(self, members: list[Member], n: int) -> None:
        """Send `members` as one batch request and hand each future its part. The request's
        span is a child of the first member's span and links to every other member's; its
        X-Millstream-Groups names them all, so the router's and engine's spans link to each
        group's trace too."""
        served = [member[2] for member in members]
        if len(members) == 1:
            results: list[Any] = [
                await self._settle(self._post_single(members[0][0], served=served))
            ]
        else:
            self.batches_sent += 1
            batch = {
                "input_ids": [body["input_ids"] for body, _, _ in members],
                "sampling_params": [body["sampling_params"] for body, _, _ in members],
                "rid": [body["rid"] for body, _, _ in members],
                "return_logprob": True,
            }
            links = [trace.Link(ctx) for _, ctx in served[1:] if ctx.is_valid]
            with tracer("millstream.rollout").start_as_current_span(
                "POST",
                kind=SpanKind.CLIENT,
                links=links,
                attributes={
                    "http.request.method": "POST",
                    "url.full": f"{self.url}/generate",
                    "millstream.batch_size": len(members),
                    GROUP_IDS: [gid for gid, _ in served if gid],
                },
            ):
                post = self._post_single(batch, count=len(members) * n, served=served)
                outcome = await self._settle(post)
            if isinstance(outcome, GenerationFailed):  # rejected as bad: find which one
                results = await asyncio.gather(
                    *(self._settle(self._post_single(b, served=[s])) for b, _, s in members)
                )
            elif outcome[0] is None:
                results = [outcome] * len(members)
            else:
                answers = outcome[0]
                results = [
                    (answers[i] if n == 1 else answers[i * n : (i + 1) * n], "")
                    for i in range(len(members))
                ]
        for (_, future, _), result in zip(members, results, strict=True):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    @staticmethod
    async def _settle(post: Awaitable[tuple[Any, str]]) -> Any:
        try:
            return await post
        except GenerationFailed as err:
            return err

    async def _post_single(
        self, body: dict[str, Any], count: int | None = None, served: list[Served] | None = None
    ) -> tuple[Any, str]:
        """One HTTP request; `count`: answers a batch body must come back with; `served`: the
        groups it serves. A request for one caller continues that caller's trace (a batch
        re-sent one request each runs in its first member's context)."""
        context = None
        if served and len(served) == 1 and served[0][1].is_valid:
            context = trace.set_span_in_context(NonRecordingSpan(served[0][1]))
        headers = inject_headers(context=context)
        if served and (groups := groups_header(served)):
            headers[GROUPS_HEADER] = groups
        try:
            response = await self._http.post(f"{self.url}/generate", json=body, headers=headers)
        except httpx.TransportError as err:
            return None, f"{type(err).__name__}: {err or 'no detail'}"
        if response.status_code >= 500 or response.status_code == 429:
            return None, f"HTTP {response.status_code}: {_short(response.text)}"
        if response.status_code != 200:
            raise GenerationFailed(
                f"router {self.url}/generate rejected the request with HTTP "
                f"{response.status_code}: {_short(response.text)}",
                retryable=False,
            )
        try:
            answer = response.json()
        except ValueError:
            return None, f"HTTP 200 with a body that is not JSON: {_short(response.text)}"
        answers = answer if isinstance(answer, list) else [answer]
        n = count or int(body["sampling_params"].get("n") or 1)
        if len(answers) != n or not all(isinstance(a, dict) and "meta_info" in a for a in answers):
            return None, f"HTTP 200 without {n} answer(s) with meta_info: {_short(response.text)}"
        return answer, ""

    def _notice(self, answer: Any) -> None:
        for one in answer if isinstance(answer, list) else [answer]:
            finish = (one.get("meta_info") or {}).get("finish_reason") or {}
            if finish.get("type") != "abort" and self.on_answer is not None:
                self.on_answer()
                return

    async def get_weight_version(self) -> str | None:
        """The version the router serves (`GET /get_weight_version`); None when it gates on
        no version or cannot be asked right now (the caller only watches for a change)."""
        try:
            response = await self._http.get(f"{self.url}/get_weight_version", timeout=5.0)
            if response.status_code != 200:
                return None
            version = response.json().get("weight_version")
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return None if version is None else str(version)
