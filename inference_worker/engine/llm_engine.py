"""The synchronous engine: one `step()` = schedule -> one batched forward -> postprocess -> stats.

Runs on the engine thread (see async_engine.py); nothing here touches asyncio.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import count
from typing import Literal

from inference_worker.engine.block_manager import BlockManager
from inference_worker.engine.detokenizer import IncrementalDetokenizer
from inference_worker.engine.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    EngineRequestError,
    PromptTooLongError,
)
from inference_worker.engine.logprobs import collect_prompt_logprobs, token_logprobs
from inference_worker.engine.scheduler import Scheduler, SchedulerOutput, admission_keep_free
from inference_worker.engine.sequence import Sequence as Seq
from inference_worker.engine.sequence import SequenceStatus
from inference_worker.engine.stats import (
    CacheConfigInfo,
    EngineEventType,
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
    StatLogger,
)
from inference_worker.engine.types import (
    FinishReason,
    ModelRunner,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
    WorkerTokenizer,
)


def validate_request(prompt_token_ids: Sequence[int], params: SamplingParams, max_model_len: int) -> None:
    """Raise an EngineRequestError (a ValueError) for a request the engine cannot serve."""
    if not prompt_token_ids:
        raise EmptyPromptError("the prompt is empty")
    if params.max_tokens < 1:
        raise EngineRequestError(f"max_tokens must be at least 1, got {params.max_tokens}")
    if params.min_tokens > params.max_tokens:
        raise EngineRequestError(
            f"min_tokens ({params.min_tokens}) must be less than or equal to max_tokens ({params.max_tokens})"
        )
    n = len(prompt_token_ids)
    if n + params.max_tokens > max_model_len:
        raise PromptTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n + params.max_tokens} tokens ({n} in the messages, {params.max_tokens} in the completion)."
        )


def _max_tokens_param(params: SamplingParams) -> int:
    """The max_tokens vLLM's request_params_max_tokens sees: its OpenAI server always sets
    SamplingParams.max_tokens (the client's value, else max_model_len - prompt length), so
    the effective limit stands in when the client left it unset."""
    return params.max_tokens if params.max_tokens_param is None else params.max_tokens_param


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: WorkerTokenizer,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        scheduling_policy: Literal["fcfs", "priority"] = "fcfs",
        clock: Callable[[], float] = time.monotonic,
        num_kv_blocks: int | None = None,
    ) -> None:
        """num_kv_blocks: use only the first N blocks of the runner's pool (default: all of it)."""
        self.runner = runner
        self.tokenizer = tokenizer
        self.clock = clock
        self.block_size = runner.block_size
        if num_kv_blocks is not None and num_kv_blocks > runner.num_kv_blocks:
            raise ValueError(f"num_kv_blocks {num_kv_blocks} > the runner's pool ({runner.num_kv_blocks})")
        self.num_kv_blocks = num_kv_blocks or runner.num_kv_blocks
        # A sequence must fit in the pool on its own, or preempting everyone else could not help
        # it; in V0 order beside the admission watermark, or it would wait forever (and, FCFS,
        # everyone behind it): such a request is refused up front instead.
        usable = self.num_kv_blocks - admission_keep_free(self.num_kv_blocks, enable_chunked_prefill)
        self.max_model_len = min(max_model_len, usable * self.block_size)
        if not enable_chunked_prefill and max_num_batched_tokens < self.max_model_len:
            # As vLLM: without chunking a prompt must fit one step, so a smaller budget would
            # silently cap the context length.
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) with chunked prefill off: raise --max-num-batched-tokens, "
                "lower --max-model-len or enable chunked prefill"
            )
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = BlockManager(self.num_kv_blocks, self.block_size, enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs, max_num_batched_tokens, clock,
            chunked_prefill=enable_chunked_prefill, policy=scheduling_policy,
        )
        self.cache_info = CacheConfigInfo(
            block_size=self.block_size,
            num_gpu_blocks=self.num_kv_blocks,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.stat_loggers: list[StatLogger] = []
        self._seqs: dict[str, Seq] = {}
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._pending_aborts: list[str] = []
        self._ids = count()
        self._eos = frozenset(tokenizer.eos_token_ids)
        self.num_computed_tokens_total = 0  # tokens the runner was asked to compute (tests, benchmarks)
        self.num_model_steps = 0  # forwards the runner was asked for (benchmarks: time per step)

    # ---- requests -----------------------------------------------------------------------
    def add_stat_logger(self, logger: StatLogger) -> None:
        self.stat_loggers.append(logger)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        validate_request(prompt_token_ids, params, self.max_model_len)
        if params.min_tokens:
            eos = () if params.ignore_eos else tuple(sorted(self._eos))
            params = replace(params, ends_answer_ids=(*params.stop_token_ids, *eos))
        if request_id in self._seqs:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        seq = Seq(
            seq_id=next(self._ids),
            request_id=request_id,
            prompt_len=len(prompt_token_ids),
            token_ids=list(prompt_token_ids),
            sampling=params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
        )
        self._seqs[request_id] = seq
        self._detok[seq.seq_id] = IncrementalDetokenizer(
            self.tokenizer, seq.token_ids, params.stop, params.include_stop_str_in_output
        )
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Mark for abort; the sequence ends and frees its blocks at the next step."""
        if request_id in self._seqs:
            self._pending_aborts.append(request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        iteration = IterationStats(iteration_timestamp=0.0)
        for request_id in self._pending_aborts:
            seq = self._seqs.get(request_id)
            if seq is not None:
                outputs.append(self._abort(seq))
        self._pending_aborts.clear()

        sched = self.scheduler.schedule()
        tokens: list[int | None] = []
        if not sched.is_empty:
            tokens = self.runner.execute(sched.batch)
            self.num_computed_tokens_total += sum(s.num_new_tokens for s in sched.batch.sequences)
            self.num_model_steps += 1
        now = self.clock()
        iteration.iteration_timestamp = now
        iteration.num_preempted_reqs = len(sched.preempted)
        self._postprocess(sched, tokens, now, iteration, outputs)
        self._record(sched, iteration)
        return outputs

    def _postprocess(
        self,
        sched: SchedulerOutput,
        tokens: list[int | None],
        now: float,
        iteration: IterationStats,
        outputs: list[RequestOutput],
    ) -> None:
        for seq, scheduled, token in zip(sched.scheduled, sched.batch.sequences, tokens, strict=True):
            if scheduled.prompt_logprobs:
                collect_prompt_logprobs(self.tokenizer, seq, scheduled)
            seq.num_computed_tokens += scheduled.num_new_tokens
            if token is None:
                continue  # a non-final prefill chunk
            seq.token_ids.append(token)
            first = seq.first_token_time is None
            if first:
                seq.first_token_time = now
                iteration.num_prompt_tokens += seq.prompt_len
                iteration.num_cached_prompt_tokens += seq.num_cached_tokens
                iteration.time_to_first_tokens_iter.append(now - seq.arrival_time)
            else:  # includes any time spent preempted since the previous token
                iteration.inter_token_latencies_iter.append(now - seq.last_token_time)
            seq.last_token_time = now
            iteration.num_generation_tokens += 1
            logprobs = token_logprobs(self.tokenizer, token, scheduled.sampled_logprobs)
            out = self._after_token(seq, token, now, iteration, logprobs)
            if first and seq.sampling.prompt_logprobs is not None:
                out.prompt_logprobs = seq.prompt_logprobs
            outputs.append(out)

    def _after_token(
        self,
        seq: Seq,
        token: int,
        now: float,
        iteration: IterationStats,
        logprobs: list[TokenLogprobs] | None,
    ) -> RequestOutput:
        params = seq.sampling
        detok = self._detok[seq.seq_id]
        reason: FinishReason | None = None
        matched: str | int | None = None
        # Before min_tokens nothing but the length ends the answer (the sampler kept EOS and the
        # stop ids out; stop strings are not looked for), as in vLLM.
        may_stop = seq.num_output_tokens >= params.min_tokens
        if may_stop and token in params.stop_token_ids:
            reason, matched = FinishReason.STOP, token
        elif may_stop and token in self._eos and not params.ignore_eos:
            reason = FinishReason.STOP
        else:
            stop = detok.add_token(token, find_stop=may_stop)
            if stop is not None:
                reason, matched = FinishReason.STOP, stop
            elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
        if reason is not None:
            return self._finish(seq, reason, iteration, now, token, matched, logprobs)
        return RequestOutput(
            request_id=seq.request_id,
            text=detok.take(final=False),
            token_ids=[token],
            finished=False,
            finish_reason=None,
            num_prompt_tokens=seq.prompt_len,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=logprobs,
        )

    def _finish(
        self,
        seq: Seq,
        reason: FinishReason,
        iteration: IterationStats,
        now: float,
        token: int,
        matched: str | int | None = None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> RequestOutput:
        iteration.finished_requests.append(self._finished_stats(seq, reason, now))
        return self._release(seq, reason, token, matched, logprobs)

    def _abort(self, seq: Seq) -> RequestOutput:
        """End an aborted request (its client left, or its caller closed it) without stats: vLLM
        v1 records a request's finished stats (request_success_total, the latency and length
        histograms) only for one the engine finished, not for one aborted from outside; the
        tokens it produced were already counted step by step, as there."""
        if seq.sampling.parallel is not None:
            seq.sampling.parallel.drop()
        return self._release(seq, FinishReason.ABORT, None)

    def _release(
        self,
        seq: Seq,
        reason: FinishReason,
        token: int | None,
        matched: str | int | None = None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> RequestOutput:
        """Free the sequence's blocks and state; its last output."""
        self.scheduler.finish(seq)
        del self._seqs[seq.request_id]
        detok = self._detok.pop(seq.seq_id)
        return RequestOutput(
            request_id=seq.request_id,
            text=detok.take(final=True),
            token_ids=[] if token is None else [token],
            finished=True,
            finish_reason=reason,
            num_prompt_tokens=seq.prompt_len,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            matched_stop=matched,
            logprobs=logprobs,
        )

    @staticmethod
    def _finished_stats(seq: Seq, reason: FinishReason, now: float) -> FinishedRequestStats:
        queued_ts = next(e.timestamp for e in seq.events if e.type is EngineEventType.QUEUED)
        scheduled_ts = seq.first_scheduled_time
        first, last = seq.first_token_time, seq.last_token_time
        n_gen = seq.num_output_tokens
        decode = (last - first) if first is not None else 0.0
        n_param, max_gen = 1, n_gen
        parallel = seq.sampling.parallel
        if parallel is not None:
            last_choice = parallel.finish(n_gen)
            n_param = parallel.n if last_choice else None
            max_gen = parallel.max_generation_tokens if last_choice else None
        return FinishedRequestStats(
            finish_reason=reason,
            e2e_latency=now - seq.arrival_time,
            num_prompt_tokens=seq.prompt_len,
            num_generation_tokens=n_gen,
            max_tokens_param=_max_tokens_param(seq.sampling),
            n_param=n_param,
            max_num_generation_tokens=max_gen,
            queued_time=(scheduled_ts - queued_ts) if scheduled_ts is not None else 0.0,
            prefill_time=(first - scheduled_ts) if first is not None and scheduled_ts is not None else 0.0,
            inference_time=(last - scheduled_ts) if first is not None and scheduled_ts is not None else 0.0,
            decode_time=decode,
            mean_time_per_output_token=decode / (n_gen - 1) if n_gen > 1 else 0.0,
            num_preemptions=seq.num_preemptions,
            num_cached_tokens=seq.num_cached_tokens,
        )

    # ---- stats ----------------------------------------------------------------------------
    def scheduler_stats(self, sched: SchedulerOutput | None = None) -> SchedulerStats:
        stats = SchedulerStats(
            num_running_reqs=len(self.scheduler.running),
            num_waiting_reqs=len(self.scheduler.waiting),
            kv_cache_usage=self.block_manager.usage,
        )
        if sched is not None:
            stats.prefix_cache_stats = sched.prefix_cache
        return stats

    def _record(self, sched: SchedulerOutput, iteration: IterationStats) -> None:
        if not self.stat_loggers:
            return
        stats = self.scheduler_stats(sched)
        for logger in self.stat_loggers:
            logger.record(stats, iteration)

    def record_idle(self) -> None:
        """Report the idle state once, so gauges (running, waiting, KV usage) drop to 0."""
        idle = getattr(self.runner, "idle", None)  # the sim's timeline (sim/runner.py) restarts
        if idle is not None:
            idle()
        stats = self.scheduler_stats()
        for logger in self.stat_loggers:
            logger.record(stats, None)

    def log_stats(self) -> None:
        for logger in self.stat_loggers:
            logger.log()

    def sequence(self, request_id: str) -> Seq | None:
        """The live sequence of a request (tests and introspection)."""
        return self._seqs.get(request_id)

    def is_waiting(self, request_id: str) -> bool:
        seq = self._seqs.get(request_id)
        return seq is not None and seq.status is SequenceStatus.WAITING
