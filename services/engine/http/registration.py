"""--register-with ROUTER_URL: announce this engine to a router, and withdraw it on exit;
--coordinator HOST:PORT: ask the trainer to add it instead (JoinEngine), weights first.

Miles' router API: `POST {router}/add_worker?url=http://host:port` once the engine listens,
`POST {router}/remove_worker?url=...` on shutdown, with `Authorization: Bearer TOKEN` when
an admin token is set (JoinEngine carries the same token in its gRPC metadata).
Registration retries with backoff (common/retry.py: a router started alongside may not listen
yet) and raises ServiceUnavailable with the router's last answer if it never succeeds;
withdrawal is tried a few times and only logged, since the engine is exiting.

A router that restarts forgets the engines it had. The engine does not announce itself
again: the trainer adds back the engines it synced, gated on the current version first
(trainer/weights/sync.py `readmit`, docs/weight-sync.md says why); a router used without a
trainer gets its engines back from --worker-urls.
"""

from __future__ import annotations

import logging

import httpx

from millstream.common.auth import bearer_headers
from millstream.common.errors import ServiceUnavailable
from millstream.common.http_pool import make_client
from millstream.common.retry import Backoff, retrying

log = logging.getLogger(__name__)


async def _post(router_url: str, path: str, worker_url: str, admin_token: str | None) -> None:
    async with make_client(httpx.Timeout(10.0)) as client:
        resp = await client.post(
            f"{router_url.rstrip('/')}/{path}",
            params={"url": worker_url},
            headers=bearer_headers(admin_token),
        )
    if resp.status_code >= 400:
        raise httpx.HTTPStatusError(
            f"{resp.status_code} {resp.text[:200]}", request=resp.request, response=resp
        )


def _refused(err: BaseException) -> bool:
    """A token the router refuses is refused again: not worth a retry (as JoinEngine's)."""
    return isinstance(err, httpx.HTTPStatusError) and err.response.status_code in (401, 403)


async def register(
    router_url: str,
    worker_url: str,
    admin_token: str | None,
    attempts: int = 5,
    delay_s: float = 0.5,
) -> None:
    try:
        async for attempt in retrying(
            Backoff(attempts=attempts, first_s=delay_s, max_s=5.0),
            f"registering with router {router_url}",
            retry_on=lambda err: isinstance(err, httpx.HTTPError) and not _refused(err),
            logger=log,
        ):
            with attempt:
                await _post(router_url, "add_worker", worker_url, admin_token)
    except httpx.HTTPError as err:
        if _refused(err):
            raise ServiceUnavailable(
                f"--register-with {router_url}: the router refused this engine's admin "
                f"token ({err}): give the engine the router's --admin-token"
            ) from None
        raise ServiceUnavailable(
            f"--register-with {router_url}: add_worker failed {attempts} times ({err}); "
            "check the router is up and the admin token matches"
        ) from None
    log.info("registered %s with router %s", worker_url, router_url)


async def join(
    coordinator: str, worker_url: str, admin_token: str | None = None, timeout_s: float = 600.0
) -> int:
    """--coordinator HOST:PORT: ask the trainer to add this engine (Coordinator.JoinEngine).

    Retried with backoff while the trainer is not serving yet (compose starts engines and
    the trainer together; the trainer loads its model first); ServiceUnavailable after
    `timeout_s`. A refused token or URL is not retried. Returns the trainer's version at the
    time: the engine serves it (or a later one) once the trainer's next sync has sent it the
    weights."""
    import grpc

    from millstream.common import telemetry
    from millstream.common.pb import services_pb2, services_pb2_grpc

    auth = [("authorization", f"Bearer {admin_token}")] if admin_token else []
    refusals = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED)
    async with grpc.aio.insecure_channel(coordinator) as channel:
        stub = services_pb2_grpc.CoordinatorStub(channel)
        try:
            async for attempt in retrying(
                Backoff(within_s=timeout_s, first_s=0.5, max_s=5.0),
                f"JoinEngine at {coordinator} (the trainer may still be starting)",
                retry_on=lambda err: (
                    isinstance(err, grpc.aio.AioRpcError) and err.code() not in refusals
                ),
                logger=log,
                every=10,
            ):
                with attempt:
                    answer = await stub.JoinEngine(
                        services_pb2.JoinEngineRequest(engine_url=worker_url),
                        timeout=5.0,
                        metadata=[*telemetry.grpc_metadata(), *auth],
                    )
        except grpc.aio.AioRpcError as err:
            if err.code() in refusals:
                raise ServiceUnavailable(
                    f"--coordinator {coordinator}: {err.code().name}: {err.details()}"
                ) from None
            raise ServiceUnavailable(
                f"--coordinator {coordinator}: no trainer answered JoinEngine within "
                f"{timeout_s:.0f} s ({err.code().name}: {err.details()}); is the "
                "trainer running with that --coordinator-port?"
            ) from None
    log.info("joined via coordinator %s: %s", coordinator, answer.message)
    return int(answer.version)


async def unregister(
    router_url: str, worker_url: str, admin_token: str | None, attempts: int = 3
) -> None:
    try:
        async for attempt in retrying(
            Backoff(attempts=attempts, first_s=0.2, max_s=1.0),
            f"removing {worker_url} from router {router_url}",
            retry_on=httpx.HTTPError,
            logger=log,
        ):
            with attempt:
                await _post(router_url, "remove_worker", worker_url, admin_token)
    except httpx.HTTPError as err:  # the engine is exiting: said, not raised
        log.warning("removing %s from router %s failed: %s", worker_url, router_url, err)
        return
    log.info("removed %s from router %s", worker_url, router_url)
