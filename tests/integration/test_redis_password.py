"""--redis-password-file against a real redis-server that requires a password.

Every service's connection flags resolve the file the same way, and the client they make
connects; a wrong password fails naming the URL and the flags, never a password; a real
reward worker given only the file scores a group; the run config published to Redis carries
neither the Redis password nor the admin token.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from millstream.common.config import parse_run_config
from millstream.common.config import store as config_store
from millstream.common.errors import ServiceUnavailable
from millstream.common.keys import RunKeys
from millstream.common.redis_conn import connect
from millstream.common.types import PromptGroup, Sample, SampleGroup
from millstream.reward.config import parse_celery_args
from millstream.reward.config import parse_worker_args as parse_reward_args
from millstream.rollout.config import parse_worker_args as parse_rollout_args
from tests.support.redis_server import RedisServer
from tests.support.reward_proc import RewardProcs, collect_scored, publish_config, publish_groups

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

PASSWORD = "r3dis-pa55word"
WRONG = "n0t-the-pa55word"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-pw"), password=PASSWORD)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def no_env_password(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the file may supply the password here (child processes inherit this)."""
    monkeypatch.delenv("REDIS_PASSWORD", raising=False)


def bare_url(server: RedisServer) -> str:
    return f"redis://127.0.0.1:{server.port}/0"


def password_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / f"redis-password-{uuid.uuid4().hex[:6]}"
    path.write_text(text + "\n")  # as `echo pw > file` writes it
    path.chmod(0o600)
    return str(path)


def configs_of(url: str, file: str) -> dict[str, tuple[str, str | None]]:
    """Each service's (url, resolved password), parsed from the flags it is started with."""
    common = ["--redis-url", url, "--run-id", "pw", "--redis-password-file", file]
    run = parse_run_config([*common, "--rollout-batch-size", "1"]).connection
    rollout = parse_rollout_args(common)
    reward = parse_reward_args(common)
    celery = parse_celery_args(common)
    return {
        "train": (run.redis_url, run.redis_password),  # type: ignore[dict-item]
        "rollout": (rollout.redis_url, rollout.redis_password),  # type: ignore[dict-item]
        "reward": (reward.redis_url, reward.redis_password),
        "reward-celery": (celery.redis_url, celery.redis_password),
    }


def test_every_service_connects_with_the_password_file(secured: RedisServer, tmp_path: Path):
    configs = configs_of(bare_url(secured), password_file(tmp_path, PASSWORD))

    async def ping(url: str, password: str | None) -> bool:
        client = await connect(url, password, timeout_s=2)
        try:
            return await client.ping()
        finally:
            await client.aclose()

    for service, (url, password) in configs.items():
        assert password == PASSWORD, service  # the trailing newline is not part of it
        assert asyncio.run(ping(url, password)), service


def test_a_wrong_password_file_fails_naming_the_url_and_flags_not_the_password(
    secured: RedisServer, tmp_path: Path
):
    url, password = configs_of(bare_url(secured), password_file(tmp_path, WRONG))["rollout"]
    with pytest.raises(ServiceUnavailable) as err:
        asyncio.run(connect(url, password, timeout_s=2))
    message = str(err.value)
    assert f"127.0.0.1:{secured.port}" in message and "--redis-password-file" in message
    assert WRONG not in message and PASSWORD not in message


def test_a_reward_worker_given_only_the_file_scores_a_group(secured: RedisServer, tmp_path: Path):
    run_id = f"pw{uuid.uuid4().hex[:8]}"
    cfg = parse_run_config(
        ["--run-id", run_id, "--rollout-batch-size", "1", "--stream-block-ms", "100",
         "--custom-rm-path", "tests.support.reward_plugins.exact_sync"],
        mode="async",
    )  # fmt: skip
    asyncio.run(publish_config(secured.url, cfg))
    procs = RewardProcs(bare_url(secured), run_id, tmp_path)
    try:
        procs.reward("rw-file", "--redis-password-file", password_file(tmp_path, PASSWORD))
        procs.wait_for_log("rw-file", "consuming")
        samples = [Sample(group_id="g", index=0, response_text="yes", label="yes")]
        group = SampleGroup(prompt=PromptGroup(group_id="g", n_samples=1), samples=samples)

        async def score() -> list:
            redis = await connect(secured.url)
            try:
                await publish_groups(redis, run_id, [group])
                return await collect_scored(redis, run_id, 1, timeout_s=30)
            finally:
                await redis.aclose()

        scored = asyncio.run(score())
        assert [s.group.samples[0].reward for s, _ in scored] == [1.0]
        assert procs.stop("rw-file") == 0

        wrong = procs.reward("rw-wrong", "--redis-password-file", password_file(tmp_path, WRONG))
        assert wrong.wait(timeout=30) != 0
        log = procs.log("rw-wrong")
        assert "refused us" in log and "--redis-password-file" in log, log
        assert WRONG not in log and PASSWORD not in log
    finally:
        procs.stop_all()


def test_the_published_config_has_no_redis_password_and_no_admin_token(
    secured: RedisServer, tmp_path: Path
):
    file = password_file(tmp_path, PASSWORD)
    for url, password_flags in (
        (secured.url, []),  # in the URL
        (bare_url(secured), ["--redis-password-file", file]),
        (bare_url(secured), ["--redis-password", PASSWORD]),
    ):
        run_id = f"pub{uuid.uuid4().hex[:8]}"
        flags = ["--run-id", run_id, "--rollout-batch-size", "1", "--redis-url", url]
        flags += ["--admin-token", "adm1n-t0ken"]
        cfg = parse_run_config([*flags, *password_flags])

        async def round_trip(cfg=cfg, run_id=run_id) -> tuple[bytes, object]:
            redis = await connect(cfg.connection.redis_url, cfg.connection.redis_password)  # type: ignore[arg-type]
            try:
                await config_store.publish(redis, cfg)
                raw = await redis.get(RunKeys(run_id).config)
                return raw, await config_store.load(redis, run_id)
            finally:
                await redis.aclose()

        raw, loaded = asyncio.run(round_trip())
        assert PASSWORD.encode() not in raw and b"adm1n-t0ken" not in raw
        assert loaded == config_store.without_secrets(cfg)
        assert loaded.service.admin_token is None and loaded.connection.redis_password is None
        assert loaded.rollout == cfg.rollout  # everything else as the trainer resolved it
        written = config_store.write_file(cfg, tmp_path / run_id).read_text()
        assert PASSWORD not in written and "adm1n-t0ken" not in written


def test_a_worker_starting_while_redis_restarts_waits_for_it(tmp_path: Path):
    """A stream worker's first connect (`wait_s`) outlasts a Redis restart instead of exiting
    (the chaos run replaces a worker and restarts Redis in the same minute); without a wait,
    or past it, it fails at once naming the URL; a wrong password never waits."""
    server = RedisServer(tmp_path, password=PASSWORD)
    url = f"redis://127.0.0.1:{server.port}/0"
    server.proc.terminate()
    server.proc.wait(timeout=10)

    async def scenario() -> float:
        with pytest.raises(ServiceUnavailable, match=f"cannot reach Redis at {url}"):
            await connect(url, PASSWORD, timeout_s=1)
        started = asyncio.get_running_loop().time()
        restarting = asyncio.get_running_loop().run_in_executor(
            None, lambda: (time.sleep(1.5), server.start())
        )
        client = await connect(url, PASSWORD, timeout_s=1, wait_s=30)
        waited = asyncio.get_running_loop().time() - started
        assert await client.ping()
        await client.aclose()
        await restarting
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(ServiceUnavailable, match="refused us"):
            await connect(url, WRONG, timeout_s=1, wait_s=30)
        assert asyncio.get_running_loop().time() - t0 < 5
        return waited

    try:
        assert 1.4 < asyncio.run(scenario()) < 20
    finally:
        server.stop()
