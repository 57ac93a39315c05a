"""Build the trainer's parts from the resolved config, resuming from --load when it holds a
checkpoint (else the actor starts from --hf-checkpoint / --ref-load)."""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from millstream.common import aio, threads
from millstream.common.config import RunConfig
from millstream.common.config.rollout import is_default_source
from millstream.common.errors import MillstreamError
from millstream.common.keys import RunKeys
from millstream.common.prom import start_metrics
from millstream.common.redis_conn import outages_of
from millstream.common.streams import default_consumer_name

from . import preflight
from .admission import Admission, ByteBound, TerminalCounts, prior_group_bytes
from .backends import distributed
from .backends.distributed import DataParallel
from .backends.loop import StepLoop
from .backends.offload import TrainOffload
from .backends.torch_backend import TorchBackend
from .buffer import Buffer
from .checkpoints import checkpoint, megatron_ckpt
from .data import EMPTY_PROMPTS, PluginDataSource, PromptDataSource, labels_are_text
from .evaluate import Evaluator
from .janitor import Tidied, run_janitor
from .lease import Lease
from .observe.metrics import MetricsLogger
from .observe.profiler import TrainProfiler
from .observe.prom import TrainerMetrics
from .observe.watch import Watch
from .teacher import TeacherClient
from .trainer import Parts, Trainer
from .weights.colocate import Colocation
from .weights.coordinator import Coordinator, host_address
from .weights.keeper import EngineBook
from .weights.sync import WeightSync

log = logging.getLogger(__name__)
Closer = Callable[[], Awaitable[None]]


def colocation(cfg: RunConfig, backend: Any, sync: WeightSync) -> Colocation | None:
    """--colocate's turns (weights/colocate.py), with Miles' offload defaults: each of
    --offload-train and --offload-rollout as given, else on with --offload or --colocate."""
    s = cfg.sglang
    if not s.colocate:
        return None
    train = s.offload_train if s.offload_train is not None else s.offload or s.colocate
    rollout = s.offload_rollout if s.offload_rollout is not None else s.offload or s.colocate
    offload = TrainOffload(getattr(backend, "backend", backend)) if train else None
    return Colocation(sync, offload, rollout)


def load_tokenizer(cfg: RunConfig) -> Any:
    return _tokenizer(cfg.ckpt.hf_checkpoint or cfg.ckpt.ref_load, cfg.rollout.chat_template_path)


@functools.cache
def _tokenizer(path: str, chat_template_path: str | None = None) -> Any:
    """Loaded once per process (the data sources and the build share it); with
    --chat-template-path, that Jinja file is its chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if chat_template_path:
        try:
            tokenizer.chat_template = Path(chat_template_path).read_text(encoding="utf-8")
        except OSError as err:
            raise MillstreamError(f"--chat-template-path {chat_template_path}: {err}") from None
    return tokenizer


def master_address(cfg: RunConfig) -> str:
    """Where engines reach this trainer (rank 0's weight-update rendezvous and its Coordinator):
    --weight-sync-master-address, else loopback when the router is (one machine), else this
    host's address (compose)."""
    if cfg.sglang.weight_sync_master_address:
        return cfg.sglang.weight_sync_master_address
    host = urlsplit(cfg.service.router_url or "").hostname or "127.0.0.1"
    if _loopback(host):
        return "127.0.0.1"
    return host_address()


def _loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def loopback_warning(cfg: RunConfig, address: str) -> str | None:
    """A run whose router is on another host while this host's name resolves to a loopback
    address (Debian's /etc/hosts maps it to 127.0.1.1): engines elsewhere could reach neither
    the Coordinator nor the rendezvous."""
    router = urlsplit(cfg.service.router_url or "").hostname or "127.0.0.1"
    if _loopback(router) or not _loopback(address):
        return None
    return (
        f"[trainer] warning: this host's address resolves to {address}, a loopback address, "
        f"while the router is at {router}: engines on other hosts cannot reach this trainer's "
        "Coordinator or its weight-sync rendezvous; pass --weight-sync-master-address with an "
        "address they can reach"
    )


def data_sources(
    cfg: RunConfig, tokenizer: Any
) -> tuple[PromptDataSource | PluginDataSource, dict[str, PromptDataSource]]:
    r, e = cfg.rollout, cfg.eval
    train: PromptDataSource | PluginDataSource
    template_kwargs = r.apply_chat_template_kwargs
    if not is_default_source(r.data_source_path) or not r.rollout_global_dataset:
        # a DataSource class, or Miles' default one without its data set: empty prompts
        path = r.data_source_path if not is_default_source(r.data_source_path) else EMPTY_PROMPTS
        train = PluginDataSource(
            path, cfg, tokenizer, apply_chat_template=r.apply_chat_template,
            prompt_special_tokens=r.prompt_special_tokens, chat_template_kwargs=template_kwargs,
        )  # fmt: skip
    else:
        train = PromptDataSource(
            r.prompt_data, tokenizer, input_key=r.input_key, label_key=r.label_key,
            metadata_key=r.metadata_key, tool_key=r.tool_key, apply_chat_template=r.apply_chat_template,
            max_prompt_len=r.rollout_max_prompt_len, prompt_special_tokens=r.prompt_special_tokens,
            shuffle=r.rollout_shuffle, seed=r.rollout_seed, skip_bad_lines=r.skip_bad_lines,
            text_labels=labels_are_text(cfg), chat_template_kwargs=template_kwargs,
        )  # fmt: skip
    evals = {
        name: PromptDataSource(
            path,
            tokenizer,
            input_key=e.eval_input_key or r.input_key,
            label_key=e.eval_label_key or r.label_key,
            metadata_key=e.eval_metadata_key or r.metadata_key,
            tool_key=r.tool_key,
            apply_chat_template=r.apply_chat_template,
            prompt_special_tokens=r.prompt_special_tokens,
            max_prompt_len=e.eval_max_prompt_len,
            skip_bad_lines=r.skip_bad_lines,
            text_labels=labels_are_text(cfg),
            chat_template_kwargs=template_kwargs,
        )
        for name, path in e.datasets().items()
    }
    return train, evals


def longest_prompt(cfg: RunConfig, source: PromptDataSource | PluginDataSource) -> int:
    """A prompt's tokens at the most, for the byte bound's first guess (every sample carries
    its prompt): the data set's longest, else --rollout-max-prompt-len, else 0 (a data
    source plugin's prompts are not known before it hands them out)."""
    if isinstance(source, PromptDataSource) and source.rows:
        return max(len(row.prompt_token_ids) for row in source.rows)
    return cfg.rollout.rollout_max_prompt_len or 0


def num_rollouts(cfg: RunConfig, source: PromptDataSource | PluginDataSource) -> int:
    if cfg.rollout.num_rollout:
        return cfg.rollout.num_rollout
    if isinstance(source, PluginDataSource):  # preflight asks for --num-rollout first
        raise MillstreamError("--data-source-path has no length: give --num-rollout")
    n = cfg.rollout.num_epoch * len(source.rows) // cfg.rollout.rollout_batch_size  # type: ignore[operator]
    if n == 0:
        raise MillstreamError(
            f"--num-epoch {cfg.rollout.num_epoch} over {len(source.rows)} prompts is less than one rollout"
        )
    return n


def lend_idle_cores(
    cfg: RunConfig,
    budget: threads.CpuBudget | None,
    backend: Any,
    admission: Admission,
    buffer: Buffer,
) -> threads.BorrowedCores | None:
    """Async mode with engines started here (`budget`: the launcher's split) and no
    --num-threads: the train step takes the engines' cores whenever every admitted group is
    back in the buffer (nothing left to generate until the next sync), and gives them back
    when one is in flight again (common/threads.py BorrowedCores). One trainer process only."""
    if (
        budget is None
        or cfg.max_staleness <= 0
        or not budget.engines
        or cfg.service.num_threads
        or budget.trainer >= budget.cores
        or distributed.world_size_from_env() > 1
    ):
        return None
    lender = threads.BorrowedCores(
        budget.trainer, budget.cores, idle=lambda: len(admission.in_flight) <= buffer.ready
    )
    for model in (backend.model, getattr(backend, "critic", None)):
        if model is not None:
            lender.hook_layers(model)
    print(
        f"[trainer] {budget.cores} compute thread(s) while the engines have nothing to "
        f"generate, {budget.trainer} while they do",
        flush=True,
    )
    return lender


@dataclass
class Prepared:
    """The parts of the trainer that cost seconds of CPU and need no service: made by
    `prepare`, in a thread while the engines load their model."""

    source: PromptDataSource | PluginDataSource
    eval_sources: dict[str, PromptDataSource]
    total: int  # rollouts in the run
    resume_from: int | None  # the --load iteration to resume, if any
    state: dict[str, Any] | None  # the trainer state saved there
    backend: StepLoop | DataParallel


def prepare(cfg: RunConfig) -> Prepared:
    """Tokenizer, data, the resume point and the backend with its model and optimizer."""
    tokenizer = load_tokenizer(cfg)
    source, eval_sources = data_sources(cfg, tokenizer)
    total = num_rollouts(cfg, source)
    resume_from = resume_iteration(cfg)
    state = checkpoint.load_state(cfg.ckpt.load, resume_from) if resume_from is not None else None  # type: ignore[arg-type]
    backend: StepLoop | DataParallel = build_backend(cfg, total)
    dtype = str(backend.dtype).removeprefix("torch.") + (
        " (fp32 masters)" if backend.keeps_masters else ""
    )
    print(f"[trainer] the actor on {backend.device}, {dtype}", flush=True)
    backend.profiler = TrainProfiler.from_config(cfg)  # rank 0 only, as Megatron's default
    if distributed.world_size_from_env() > 1:
        if state is not None and cfg.ckpt.train_backend == "fsdp":  # before sharding
            backend.load_weights(checkpoint.iter_dir(cfg.ckpt.load, resume_from))  # type: ignore[arg-type]
        backend = DataParallel(backend)
    return Prepared(source, eval_sources, total, resume_from, state, backend)


async def build_trainer(
    cfg: RunConfig,
    redis: Any,
    budget: threads.CpuBudget | None = None,
    prepared: Prepared | None = None,
    placements: dict[str, dict[str, Any]] | None = None,
    lease: Lease | None = None,
) -> tuple[Trainer, list[Closer]]:
    """The trainer and what to close after it; `budget`: the local launcher's CPU split, when
    it started the engines here (lend_idle_cores); `prepared`: `prepare(cfg)`, made already."""
    keys = RunKeys(cfg.run_id)
    outages_of(redis).configure(who="trainer", timeout_s=cfg.service.redis_outage_timeout)
    p = prepared or prepare(cfg)
    source, eval_sources, total, backend = p.source, p.eval_sources, p.total, p.backend
    resume_from, state = p.resume_from, p.state

    # Which start of this run id admits the groups: kept through resumes, new at a fresh
    # start, so the groups an earlier run left in the streams are told apart (buffer.py).
    run_instance = (state or {}).get("run_instance") or uuid.uuid4().hex[:12]
    print(
        f"[trainer] run {cfg.run_id}, instance {run_instance}: "
        + (
            "resumed"
            if state
            else "a fresh start (groups of earlier runs with this id are dropped)"
        ),
        flush=True,
    )
    r = cfg.rollout
    slack = (r.over_sampling_batch_size - r.rollout_batch_size) if r.over_sampling_batch_size else 0
    holder: dict[str, Trainer] = {}
    bound = None
    if cfg.service.max_buffer_bytes:  # the buffer's bytes, known once it exists (below)
        prior = prior_group_bytes(
            r.n_samples_per_prompt, r.rollout_max_response_len, longest_prompt(cfg, source)
        )
        bound = ByteBound(
            cfg.service.max_buffer_bytes, prior, lambda: (buffer.held_bytes, buffer.held_groups)
        )
    admission = Admission(
        redis,
        keys.prompts,
        source,
        r.rollout_batch_size,
        r.n_samples_per_prompt,
        cfg.max_staleness,
        slack,
        run_instance=run_instance,
        bytes=bound,
    )
    buffer = Buffer(
        redis, keys, default_consumer_name("trainer"), claim_idle_ms=cfg.service.claim_idle_ms,
        max_deliveries=cfg.service.max_deliveries, block_ms=cfg.service.stream_block_ms,
        on_terminal=lambda gid, st: holder["t"].on_terminal(gid, st),
        expected=admission.in_flight.__contains__,
        max_consecutive_failed_groups=cfg.service.max_consecutive_failed_groups,
        run_instance=run_instance, fence=None if lease is None else lease.fence,
        on_size=None if bound is None else lambda n: holder["t"].on_group_bytes(n),
    )  # fmt: skip
    lend_idle_cores(cfg, budget, backend, admission, buffer)
    iteration = version = 0
    if state is not None:
        iteration, version = restore(cfg, state, backend, source, admission, resume_from)  # type: ignore[arg-type]
    # What started is stopped again when a later step fails: no gRPC server or reader task
    # is left to an event loop that is closing (asyncio and grpc.aio tracebacks at exit).
    closers: list[Closer] = []
    try:
        coordinator = Coordinator(
            cfg.run_id, version=version, redis=redis, admin_token=cfg.service.admin_token
        )
        port = await coordinator.start(cfg.service.coordinator_port)
        closers.append(coordinator.stop)
        here = master_address(cfg)
        address = await coordinator.advertise(redis, port, here)
        print(f"[trainer] coordinator (gRPC) at {address}", flush=True)
        if (warning := loopback_warning(cfg, here)) is not None:
            print(warning, flush=True)
        sync = WeightSync(
            cfg.service.router_url, admin_token=cfg.service.admin_token, pause_mode=cfg.sglang.pause_mode,
            bucket_bytes=cfg.sglang.update_weight_buffer_size, timeout_s=cfg.sglang.weight_sync_timeout,
            load_format=None if cfg.sglang.weight_sync_format == "per_tensor" else "flattened_bucket",
            master_address=here, transport=cfg.sglang.update_weight_transport,
            disk_dir=cfg.sglang.update_weight_disk_dir or Path(cfg.run_dir) / "weight_updates",
            placements=placements, stall_timeout_s=cfg.service.stall_timeout,
        )  # fmt: skip
        closers.append(sync.close)
        if lease is not None:  # every admin call carries the fencing number (lease.py)
            sync.fence_headers = lease.headers
        metrics = TrainerMetrics()
        timed_sync = metrics.timed(sync)  # every sync's seconds, the resume sync's too
        evaluator = None
        if eval_sources:
            evaluator = Evaluator(
                redis, keys.prompts, eval_sources, cfg.eval.n_samples_per_eval_prompt, buffer
            )
        logger = MetricsLogger(cfg, Path(cfg.run_dir))
        closers.append(_async(logger.close))
        teacher = None
        if cfg.algo.distills and cfg.algo.opd_teacher_url:
            teacher = TeacherClient(cfg.algo.opd_teacher_url, cfg.rollout.logprob_temperature)
            closers.append(teacher.close)
        watch = Watch(redis, keys, sync.routed_engines, stall_timeout_s=cfg.service.stall_timeout)
        tidied = Tidied()
        janitor = functools.partial(
            run_janitor, redis, keys, interval_s=cfg.service.trim_interval,
            consumer_idle_ms=max(60_000, 10 * cfg.service.claim_idle_ms), tidied=tidied,
        )  # fmt: skip
        parts = Parts(
            backend,
            admission,
            buffer,
            timed_sync,
            evaluator,
            logger,
            coordinator,
            teacher,
            watch,
            janitor,
            colocation(cfg, backend, sync),
            EngineBook(redis, keys),
            lease,
        )
        trainer = holder["t"] = Trainer(cfg, parts, total, iteration=iteration, version=version)
        metrics.watch(trainer)
        if cfg.service.metrics_port is not None:
            server = start_metrics(
                "trainer", metrics.registry, cfg.service.metrics_port,
                redis_url=cfg.connection.redis_url, redis_password=cfg.connection.redis_password,
                streams=[keys.prompts, keys.generated, keys.scored, keys.dead],
            )  # fmt: skip
            closers.append(server.aclose)
        await buffer.start()
        closers.append(buffer.stop)
        start = getattr(backend, "backend", backend).start_checkpoint
        if start is not None and state is None:
            print(f"[trainer] the actor starts from the torch_dist checkpoint {start}", flush=True)
            trainer.sync_at_start = True  # engines have --hf-checkpoint's
        if state is not None:  # engines serve the resumed weights, then the groups go again
            trainer.sync_at_start = trainer.readmit_at_start = True
    except BaseException:
        await close_all(closers)
        raise
    return trainer, closers


CLOSE_TIMEOUT_S = 60.0


async def close_all(closers: list[Closer], timeout_s: float = CLOSE_TIMEOUT_S) -> None:
    """Run the closers, last started first; every one runs even when one fails or hangs
    (each gets `timeout_s`: a stop must end)."""
    for close in reversed(closers):
        name = getattr(close, "__qualname__", close)
        try:
            await aio.wait_for(close(), timeout_s)
        except TimeoutError:
            log.error("closing %s took more than %.0f s: left behind", name, timeout_s)
        except Exception as err:
            log.warning("closing %s failed: %s", name, err)


def _async(fn: Callable[[], None]) -> Closer:
    async def call() -> None:
        fn()

    return call


def resume_iteration(cfg: RunConfig) -> int | None:
    """The iteration of our own --load checkpoint to resume, None for a fresh start (a
    Megatron torch_dist --load is the megatron backend's starting weights: MegatronBackend)."""
    if megatron_ckpt.torch_dist_dir(cfg.ckpt.load):
        return None
    return checkpoint.latest_iteration(cfg.ckpt.load)


def build_backend(cfg: RunConfig, total_rollouts: int) -> StepLoop:
    """The actor from --hf-checkpoint (an FP8 one: from --ref-load, docs/fp8.md); the reference
    when a KL needs it; the critic (ppo) from --critic-load or the actor's weights; a local
    teacher from --opd-teacher-load."""
    a = cfg.algo
    actor = cfg.ckpt.hf_checkpoint or cfg.ckpt.ref_load
    needs_ref = a.use_kl_loss or a.use_kl_in_reward
    ref_load = cfg.ckpt.ref_load
    if megatron_ckpt.torch_dist_dir(ref_load):  # the megatron backend's (preflight): it
        ref_load = None  # loads the weights into the --hf-checkpoint skeleton
    if ref_load and preflight.fp8_checkpoint(cfg.ckpt.hf_checkpoint):
        actor = ref_load  # FP8 rollout: the engines serve the FP8 copy (docs/fp8.md)
    ref = (ref_load or cfg.ckpt.hf_checkpoint) if needs_ref else None
    critic = (a.critic_load or actor) if a.uses_critic else None
    teacher = a.opd_teacher_load if a.distills else None
    cls: type[StepLoop] = TorchBackend
    if cfg.ckpt.train_backend == "megatron":
        from .backends.megatron.backend import MegatronBackend

        cls = MegatronBackend
    return cls(
        cfg, actor, ref_dir=ref, critic_dir=critic, teacher_dir=teacher,  # type: ignore[arg-type]
        total_steps=total_rollouts * cfg.rollout.num_steps_per_rollout,  # type: ignore[operator]
    )  # fmt: skip


def build_follower(cfg: RunConfig) -> DataParallel:
    """A data parallel rank > 0: the backend alone, from the same model, seed and --load
    checkpoint as rank 0, so that all ranks start with the same weights and optimizer."""
    total = cfg.rollout.num_rollout or num_rollouts(cfg, data_sources(cfg, load_tokenizer(cfg))[0])
    backend = build_backend(cfg, total)
    resume_from = resume_iteration(cfg)
    if resume_from is None:
        return DataParallel(backend)
    state = checkpoint.load_state(cfg.ckpt.load, resume_from)  # type: ignore[arg-type]
    checkpoint.set_rng_state(state["rng"])
    directory = checkpoint.iter_dir(cfg.ckpt.load, resume_from)  # type: ignore[arg-type]
    if cfg.ckpt.train_backend == "fsdp":
        backend.load_weights(directory)  # before sharding; the optimizer shard after it
    dp = DataParallel(backend)
    dp.load(directory, load_optimizer=not cfg.ckpt.no_load_optim)
    return dp


def restore(
    cfg: RunConfig, state: dict[str, Any], backend: StepLoop | DataParallel, source: PromptDataSource | PluginDataSource,
    admission: Admission, iteration: int,
) -> tuple[int, int]:  # fmt: skip
    checkpoint.set_rng_state(state["rng"])
    backend.load(
        checkpoint.iter_dir(cfg.ckpt.load, iteration), load_optimizer=not cfg.ckpt.no_load_optim
    )  # type: ignore[arg-type]
    source.load_state_dict(state["data"])
    admission.counts = TerminalCounts(**state["counts"])
    admission.in_flight.clear()  # the buffer holds this dict's `__contains__`: update in place
    admission.in_flight.update({gid: (pos[0], pos[1]) for gid, pos in state["in_flight"].items()})
    return state["iteration"], state["version"]
