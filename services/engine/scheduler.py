"""Continuous batching: one thread owns the model, the queue and the running batch.

Ownership. Every mutation of scheduler state happens on the scheduler thread. Other threads
(the HTTP event loop, weight receivers) talk to it through `_commands`: a command is a
function run on the scheduler thread BETWEEN steps, with a concurrent Future for its result.
So no step ever sees half-updated weights or a half-removed row, without a lock held across
a forward pass.

One step (`_step`):
  1. admit waiting sequences while the batch has room: --max-running-requests rows, and
     free tokens in the KV token pool (kv/token_pool.py) for their prompts plus
     DECODE_RESERVE tokens a row;
  2. prefill them in packed forwards (`prefill_groups`: no padding, up to PREFILL_TOKENS
     new tokens each), each distinct prefix once: the n copies of a request share its
     logits and its pool slots. A new sequence samples its first token from the prefill
     logits; a retracted one (output so far kept) re-prefills prompt + output[:-1] and
     samples nothing. A sequence that asked for input logprobs from position s (SGLang's
     logprob_start_len) keeps logits for its last L - s positions, scores prompt[s+1:]
     from them (same temperature rule as the output logprobs, sampling.py) before
     sampling, and a max_new_tokens = 0 sequence finishes right there without sampling;
  3. merge survivors into the running batch (counted in `joined_running_batch` when the
     batch was already decoding: continuous batching);
  4. make room in the pool for one token a row (`_make_room`: the newest rows are
     retracted to the head of the queue while it is short; never a silent "length"),
     then one decode step for every row (paged_batch.py: attention reads each row's own
     tokens only); finished rows leave the batch at once, their slots freed.

Pause modes (SGLang's /pause_generation): "abort" aborts everything in flight and waiting;
"in_place" stops stepping and keeps the batch and its KV cache; "retract" drops the KV cache
and puts running sequences back at the head of the queue, to be re-prefilled on continue.
While paused, new requests queue up and run after /continue_generation.

Memory occupation (SGLang's /release_memory_occupation, for a trainer sharing the GPU:
--colocate): releasing "kv_cache" frees the cache, and the running sequences go back to the
head of the queue as in a retract; releasing "weights" discards them (executor/model_runner.py: no
copy to host memory); releasing anything drops the CUDA graphs ("cuda_graph" alone too).
/resume_memory_occupation allocates what it names again: the cache zeroed, the weights
uninitialized. No step runs while anything is released, nor while the weights are invalid
(resumed, and not yet written in full by weight updates: the sync that follows a resume, or
/update_weights_from_disk of the checkpoint), whatever the pause state: requests queue up,
and `info()` says why (`memory_released`, `weights_valid`). Waiting, not failing, because
in a colocated run the update is already on its way. An update while the weights are
released is refused (there is nothing to write into). Stepping resumes, with the CUDA graphs
captured again, once nothing is released, the weights are valid and generation is not
paused.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from .executor.model_runner import ModelRunner
from .kv.token_pool import PAGE, pages_for
from .paged_batch import PagedBatch
from .prefill import prefill_groups, score_prompt
from .sampling import sample_next
from .sequence import FinishReason, Sequence, StopChecker

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "in_place", "retract")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's GPU memory types


def _sizes(nbytes: dict[str, int]) -> str:
    return ", ".join(f"{tag} {n / 2**20:.1f} MiB" for tag, n in nbytes.items()) or "nothing moved"


class RequestError(ValueError):
    """A request the engine cannot serve; the message names the offending input."""


DECODE_RESERVE = 64  # pool tokens a row keeps free for its next steps when admitting others


def _reserve(seq: Sequence) -> int:
    """Pool tokens a row keeps free for its next decode steps (DECODE_RESERVE at most), in
    whole pages."""
    return PAGE * pages_for(
        max(1, min(seq.params.max_new_tokens - len(seq.output_ids), DECODE_RESERVE))
    )


@dataclass
class SchedulerStats:
    steps: int = 0
    prefill_batches: int = 0
    joined_running_batch: int = 0
    finished: int = 0
    aborted: int = 0
    generated_tokens: int = 0
    retracted: int = 0


class Scheduler:
    def __init__(self, runner: ModelRunner, batch: PagedBatch, *, weight_version: str = "default"):
        """`batch` is built by the caller (core.py `new_batch`, from the flags): its rows
        are --max-running-requests, its context length the longest a request may grow to."""
        self.runner = runner
        self.max_running_requests = batch.max_rows
        self.context_length = batch.context_length
        self.weight_version = weight_version
        self.stats = SchedulerStats()
        self.paused = False
        self.released: set[str] = set()  # memory tags released (module docstring)
        self._stop_checker = StopChecker(runner.tokenizer, runner.eos_token_ids)
        self._commands: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._waiting: deque[Sequence] = deque()
        self._batch = batch
        self._prefilling: list[Sequence] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)

    # ---- any thread -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if not self._thread.is_alive():
            return
        self.call(self._shutdown).result(timeout)
        self._thread.join(timeout)

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` on the scheduler thread between two steps; its result in a Future."""
        future: Future[Any] = Future()
        self._commands.put((fn, future))
        return future

    def validate(self, seq: Sequence) -> None:
        """Reject what can never run, with a message naming the input (RequestError)."""
        n_prompt = len(seq.prompt_ids)
        if n_prompt == 0:
            raise RequestError("input_ids: the prompt is empty")
        bad = [t for t in seq.prompt_ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise RequestError(
                f"input_ids: token ids {bad[:5]} are outside the vocabulary "
                f"[0, {self.runner.vocab_size})"
            )
        # The pool caps the context (core.py new_batch): then the message names the pool.
        limit = self._batch.pool.limit
        context = min(self.context_length, limit)
        if n_prompt >= context:
            why = (
                f" (the KV token pool holds {limit}: --max-total-tokens, or "
                "--mem-fraction-static on a GPU)"
                if limit <= self.context_length
                else ""
            )
            where = f"the context length is {context}{why}"
            raise RequestError(f"input_ids: the prompt has {n_prompt} tokens, {where}")

    def submit(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.validate(seq)
        self.call(lambda: self._waiting.extend(seqs))

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> Future[int]:
        message = "aborted by /abort_request"
        return self.call(
            lambda: self._abort(
                lambda s: abort_all or (bool(rid) and rid in (s.rid, s.request_rid)), message
            )
        )

    def pause(self, mode: str) -> Future[int]:
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode: must be one of {list(PAUSE_MODES)} (got {mode!r})")
        return self.call(lambda: self._pause(mode))

    def resume(self) -> Future[None]:
        return self.call(lambda: setattr(self, "paused", False))

    def release_memory(self, tags: list[str] | None) -> Future[dict[str, int]]:
        """Release the memory of `tags` (None: all); their bytes freed, by tag."""
        return self.call(lambda: self._release(self._tags(tags)))

    def resume_memory(self, tags: list[str] | None) -> Future[dict[str, int]]:
        """Bring back the memory of `tags` (None: all); their bytes allocated, by tag."""
        return self.call(lambda: self._resume(self._tags(tags)))

    @staticmethod
    def _tags(tags: list[str] | None) -> list[str]:
        if tags is None:
            return list(MEMORY_TAGS)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise RequestError(f"tags: {unknown} are not among {list(MEMORY_TAGS)}")
        return list(tags)

    def update_weights(
        self,
        copy_in: Callable[[], Iterable[torch.nn.Parameter] | None],
        weight_version: str | None,
        abort_all: bool = False,
    ) -> Future[None]:
        """Run `copy_in` (it returns the parameters it wrote) between two steps; the version
        changes in the same command, so every token sampled afterwards reports the new one."""

        def run() -> None:
            if "weights" in self.released:
                raise RequestError(
                    "the weights are released (/release_memory_occupation): resume them "
                    '(/resume_memory_occupation {"tags": ["weights"]}) before updating them'
                )
            if abort_all:
                self._abort(lambda _: True, "aborted for a weight update")
            written = copy_in()
            # Cached keys were computed with the old weights: never reused after this.
            self._batch.flush_cache()
            if written is not None and self.runner.note_written(written):
                log.info("every parameter written since the resume: the weights are valid")
                self._warm_graphs()
            if weight_version is not None:
                self.weight_version = weight_version

        return self.call(run)

    def flush_cache(self) -> Future[int]:
        """Drop the prefix cache's pages that no running row uses; the tokens dropped."""
        return self.call(self._batch.flush_cache)

    def info(self) -> dict[str, Any]:
        """Read from the server's threads while the scheduler steps: a row that finished
        this step (its caller already answered) leaves the batch only after the step, so
        it is not counted as running."""
        return {
            "num_running_reqs": sum(not s.done for s in self._batch.seqs),
            "num_waiting_reqs": len(self._waiting),
            "paused": self.paused,
            "memory_released": sorted(self.released),
            "weights_valid": self.runner.weights_valid,
            "max_running_requests": self.max_running_requests,
            "kv_tokens_used": self._batch.used_tokens,
            "kv_tokens_total": self._batch.pool.capacity,
            "prefix_cache_tokens": self._batch.cache.tokens,
            "prefix_cache_hit_tokens": self._batch.cache.hits,
            **vars(self.stats),
        }

    # ---- scheduler thread -------------------------------------------------------------

    def _can_step(self) -> bool:
        return not self.paused and not self.released and self.runner.weights_valid

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stopping:
                busy = self._can_step() and (self._batch.seqs or self._waiting)
                self._drain_commands(block=not busy)
                if self._stopping or not self._can_step():
                    continue
                try:
                    self._step()
                except Exception as err:  # a failed step fails its requests, not the server
                    log.exception("scheduler step failed")
                    self._fail_running(f"engine error: {type(err).__name__}: {err}")

    def _drain_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as err:
                    future.set_exception(err)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        admitted = self._admit()
        if admitted:
            self._prefilling = admitted
            self._prefill(admitted)
            self._prefilling = []
        self._make_room()
        if self._batch.seqs:
            logits_BV = self._batch.decode(self.runner.model)
            self._append_sampled(self._batch.seqs, logits_BV)
            self._batch.keep([i for i, s in enumerate(self._batch.seqs) if not s.done])
        self.stats.steps += 1

    def _admit(self) -> list[Sequence]:
        """Waiting sequences that fit: a free row (--max-running-requests) and free pool
        tokens for their prefill (each distinct prefix once) plus DECODE_RESERVE tokens a
        row, running rows included. The head of the queue alone is always admitted: it fits
        the pool once the running rows are gone (validate() checked its prompt)."""
        admitted: list[Sequence] = []
        running = len(self._batch)
        need = sum(_reserve(s) for s in self._batch.seqs)
        available = self._batch.available
        prefixes: set[tuple[int, ...]] = set()
        while self._waiting and running + len(admitted) < self.max_running_requests:
            seq = self._waiting[0]
            prefix = tuple(seq.prefix_ids())
            cost = (0 if prefix in prefixes else PAGE * pages_for(len(prefix))) + _reserve(seq)
            if (admitted or running) and need + cost > available:
                break
            self._waiting.popleft()
            if seq.params.max_new_tokens == 0 and seq.pending_logprob_start is None:
                self._finish(seq, FinishReason("length", length=0))
                continue
            admitted.append(seq)
            prefixes.add(prefix)
            need += cost
        return admitted

    def _prefill(self, seqs: list[Sequence]) -> None:
        was_decoding = bool(self._batch.seqs)
        for group in prefill_groups(seqs):
            self._prefill_group(group, was_decoding)

    def _prefill_group(self, group: list[Sequence], was_decoding: bool) -> None:
        """One packed forward over the group's distinct prefixes (the n copies of a request
        share theirs: its pool slots too), then every copy samples its own first token from
        the shared logits and joins the batch on the shared slots."""
        keyed: dict[tuple[tuple[int, ...], int | None], int] = {}
        row_of = [
            keyed.setdefault((tuple(s.prefix_ids()), s.pending_logprob_start), len(keyed))
            for s in group
        ]
        keeps = [1 if start is None else len(prefix) - start for prefix, start in keyed]
        handles, logits_UKV = self._batch.prefill([list(p) for p, _ in keyed], keeps)
        try:
            self._score_prompts(group, [logits_UKV[u] for u in row_of])
            fresh = [i for i, s in enumerate(group) if not s.output_ids]
            for i in fresh:
                if group[i].params.max_new_tokens == 0:
                    self._finish(group[i], FinishReason("length", length=0))
            fresh = [i for i in fresh if not group[i].done]
            if fresh:  # only the rows that sample: the copies share their prefix's logits
                logits_FV = torch.stack([logits_UKV[row_of[i]][-1] for i in fresh])
                self._append_sampled([group[i] for i in fresh], logits_FV)
            rows = [i for i, s in enumerate(group) if not s.done]
            for i in rows:
                self._batch.add(group[i], handles[row_of[i]])
        finally:
            self._batch.drop(handles)
        if was_decoding:
            self.stats.joined_running_batch += len(rows)
        self.stats.prefill_batches += 1

    def _make_room(self) -> None:
        """Free pool tokens for the next decode step (a page a row whose last page is
        full): retract the newest rows to the head of the queue (they are prefilled again,
        output kept, when there is room). A row alone that fills the pool ends with an
        abort that says so."""
        while self._batch.seqs and not self._batch.make_free(self._batch.step_tokens):
            if len(self._batch) == 1:
                seq = self._batch.seqs[0]
                self._batch.clear()
                self._finish(
                    seq,
                    FinishReason(
                        "abort",
                        message=(
                            f"the KV token pool ({self._batch.pool.capacity} tokens) is full "
                            f"with this request alone ({len(seq.prefix_ids())} tokens): raise "
                            "--max-total-tokens (or --mem-fraction-static on a GPU)"
                        ),
                    ),
                )
                return
            seq = self._batch.seqs[-1]
            self._batch.keep(list(range(len(self._batch) - 1)))
            self._waiting.appendleft(seq)
            self.stats.retracted += 1
            log.info(
                "KV token pool full (%d tokens): request %s retracted with %d tokens out, "
                "it runs again when there is room",
                self._batch.pool.capacity,
                seq.rid,
                len(seq.output_ids),
            )

    def _score_prompts(self, group: list[Sequence], logits_KV: list[torch.Tensor]) -> None:
        """Input logprobs for every row of a (length, start) group (`logits_KV[b]`: row b's
        kept positions); the n copies of one request share their InputLogprobs, so each is
        computed once."""
        for seq, logits in zip(group, logits_KV, strict=True):
            holder = seq.input_logprobs
            if holder is not None and holder.pending:
                score_prompt(logits, seq, holder)

    def _append_sampled(self, seqs: list[Sequence], logits_BV: torch.Tensor) -> None:
        tokens, logprobs = sample_next(logits_BV, [s.params for s in seqs], [s.rng for s in seqs])
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            seq.output_ids.append(token)
            seq.output_logprobs.append(logprob)
            self.stats.generated_tokens += 1
            reason = self._stop_checker.check(seq)
            if reason is None and len(seq.prompt_ids) + len(seq.output_ids) >= self.context_length:
                reason = FinishReason("length", length=len(seq.output_ids))
            if reason is not None:
                self._finish(seq, reason)
            else:
                seq.notify(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.set_finished(reason, self.weight_version)
        if reason.type == "abort":
            self.stats.aborted += 1
        else:
            self.stats.finished += 1
        seq.notify(seq)

    def _abort(self, match: Callable[[Sequence], bool], message: str) -> int:
        hit = [s for s in self._waiting if match(s)]
        self._waiting = deque(s for s in self._waiting if not match(s))
        rows = [i for i, s in enumerate(self._batch.seqs) if not match(s)]
        hit += [s for s in self._batch.seqs if match(s)]
        self._batch.keep(rows)
        for seq in hit:
            self._finish(seq, FinishReason("abort", message=message))
        return len(hit)

    def _pause(self, mode: str) -> int:
        self.paused = True
        if mode == "abort":
            return self._abort(lambda _: True, "aborted by /pause_generation (mode abort)")
        if mode == "retract":
            retracted = self._batch.seqs
            self._batch.clear()
            self._waiting.extendleft(reversed(retracted))
            self.stats.retracted += len(retracted)
            return len(retracted)
        return 0

    def _release(self, tags: list[str]) -> dict[str, int]:
        freed: dict[str, int] = {}
        if "kv_cache" in tags and "kv_cache" not in self.released:
            retracted = self._batch.seqs
            self._batch.clear()
            self._waiting.extendleft(reversed(retracted))
            self.stats.retracted += len(retracted)
            freed["kv_cache"] = self._batch.release()
        if "weights" in tags and "weights" not in self.released:
            freed["weights"] = self.runner.release_weights()
        if tags:  # captured graphs hold the addresses of both: captured again after a resume
            self._batch.forget_graphs()
        self.released |= set(tags)
        self.runner.empty_device_cache()
        log.info("released %s (%s)", tags, _sizes(freed))
        return freed

    def _resume(self, tags: list[str]) -> dict[str, int]:
        allocated: dict[str, int] = {}
        if "weights" in tags and "weights" in self.released:
            allocated["weights"] = self.runner.resume_weights()
        if "kv_cache" in tags and "kv_cache" in self.released:
            allocated["kv_cache"] = self._batch.resume()
        self.released -= set(tags)
        log.info("resumed %s (%s)", tags, _sizes(allocated))
        if "weights" in allocated:
            log.info(
                "the weights are allocated, uninitialized: no step runs until weight updates "
                "have written all %d parameters",
                self.runner.unwritten_parameters,
            )
        self._warm_graphs()
        return allocated

    def _warm_graphs(self) -> None:
        """The CUDA graphs captured again as soon as the engine can step
        (executor/decode_graphs.py)."""
        if not self.released and self.runner.weights_valid:
            self._batch.warm_graphs()

    def _fail_running(self, message: str) -> None:
        failed = self._batch.seqs + [
            s for s in self._prefilling if not s.done and s not in self._batch.seqs
        ]
        self._batch.clear()
        self._batch.flush_cache()  # a failed step may have left half-written keys
        self._prefilling = []
        for seq in failed:
            self._finish(seq, FinishReason("abort", message=message))

    def _shutdown(self) -> None:
        self._abort(lambda _: True, "the engine is shutting down")
        self._stopping = True
