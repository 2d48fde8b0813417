"""Iteration-level scheduler: which sequences run in the next step, and how many tokens each.

One token budget (max_num_batched_tokens) is shared by every sequence of a step, as in
vLLM v1: running sequences first (decodes, or the next chunk of a chunked prefill),
then waiting ones in FCFS order while seats (max_num_seqs), budget and blocks last.
When a running sequence cannot get a block, the newest running sequence is preempted
by recompute: its blocks are freed, it goes back to the front of the waiting queue and
later recomputes prompt + output as a prefill (prefix-cached blocks make that cheap).

With policy "priority" (vLLM's `--scheduling-policy priority`) the waiting queue is ordered
by each request's `priority` (lower first), then arrival; a preempted sequence goes back in
that order, and the victim is the running sequence of the worst (priority, arrival). As in
vLLM, a running sequence keeps its seat: a better priority waits for a free one.

With chunked prefill off (vLLM's `--no-enable-chunked-prefill`, the vLLM V0 default) a step
is either all prefills or all decodes, as in the V0 scheduler: waiting sequences are
admitted first, each with its whole prompt in one step (the prompt must fit the budget);
only a step that admits nobody runs the decodes. Every prefill then stalls every decode of
the worker, and a preempted sequence recomputes in a step of its own. Admission also keeps
1 % of the blocks free (V0's watermark): without it a sequence preempted for lack of blocks
is re-admitted into the room its neighbours grow into a step later, recomputes, and is
preempted again.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from inference_worker.engine.block_manager import BlockManager
from inference_worker.engine.sequence import Sequence, SequenceStatus
from inference_worker.engine.stats import EngineEventType, PrefixCacheStats
from inference_worker.engine.types import ScheduledSequence, StepBatch

# vLLM V0's BlockSpaceManager watermark: the share of blocks a prompt admission leaves free.
V0_ADMISSION_WATERMARK = 0.01


def admission_keep_free(num_blocks: int, chunked_prefill: bool) -> int:
    """Blocks an admission must leave free: none in V1 order, V0's watermark without chunking."""
    return 0 if chunked_prefill else int(V0_ADMISSION_WATERMARK * num_blocks)


@dataclass(slots=True)
class SchedulerOutput:
    batch: StepBatch
    scheduled: list[Sequence]  # same order as batch.sequences
    preempted: list[Sequence] = field(default_factory=list)
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        clock: Callable[[], float],
        chunked_prefill: bool = True,
        policy: Literal["fcfs", "priority"] = "fcfs",
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.clock = clock
        self.chunked_prefill = chunked_prefill
        self.by_priority = policy == "priority"
        # V1 admits into any free block; V0 keeps a watermark (see the module docstring).
        self.admission_keep_free = admission_keep_free(block_manager.num_blocks, chunked_prefill)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.record(EngineEventType.QUEUED, self.clock())
        if self.by_priority:
            bisect.insort_right(self.waiting, seq, key=_rank)
        else:
            self.waiting.append(seq)

    # ---- one step -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput(batch=StepBatch(), scheduled=[])
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        if not self.chunked_prefill:
            # V0 order: a prefill-only step whenever someone can be admitted.
            self._schedule_waiting(out, budget, now)
            if out.scheduled:
                return out

        # 1) Running sequences, oldest first. Preempt from the back when blocks run out.
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            got_blocks = True
            while not bm.allocate(seq, num_new):
                at = self._victim_index()
                victim = running.pop(at)
                if at < i:  # it ran earlier in this step: the rest moved up by one
                    i -= 1
                # A victim scheduled earlier in this step gives its tokens back (as vLLM v1 does):
                # those ranked better, after it in running, may use them in this same step.
                budget += self._preempt(victim, now, out)
                if victim is seq:
                    got_blocks = False
                    break
            if not got_blocks:
                # seq preempted itself. FCFS: it was the newest, nobody is left after it. By
                # priority it was the worst ranked: those after it rank better and still run, in
                # the room it left (a break gave them no token this step).
                continue  # running[i] is the next one now
            self._add_to_batch(out, seq, num_new)
            budget -= num_new
            i += 1

        # 2) Waiting sequences, FCFS, unless this step already had to preempt.
        if self.chunked_prefill and not out.preempted:
            self._schedule_waiting(out, budget, now)
        return out

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.match_prefix(seq)
            cached_tokens = len(cached) * bm.block_size
            num_new = min(seq.num_tokens - cached_tokens, budget)
            if num_new < seq.num_tokens - cached_tokens and not self.chunked_prefill:
                break  # the whole prompt must go in one step; FCFS: nobody overtakes it
            if not bm.can_allocate(seq, cached, cached_tokens + num_new, self.admission_keep_free):
                break
            self.waiting.popleft()
            bm.take_cached(seq, cached)
            if not bm.allocate(seq, num_new):  # cannot happen after can_allocate; keep state sane
                bm.free(seq)
                self.waiting.appendleft(seq)
                break
            if not seq.ever_scheduled:  # resumes after preemption are not counted (as in vLLM)
                seq.ever_scheduled = True
                seq.num_cached_tokens = cached_tokens
                seq.first_scheduled_time = now
                # As in vLLM: no lookup (caching off, or prompt logprobs wanted), no query counted.
                if bm.reads_cache(seq):
                    pc = out.prefix_cache
                    pc.requests += 1
                    pc.queries += seq.num_tokens
                    pc.hits += cached_tokens
            seq.status = SequenceStatus.RUNNING
            seq.record(EngineEventType.SCHEDULED, now)
            self.running.append(seq)
            self._add_to_batch(out, seq, num_new)
            budget -= num_new

    def _preempt(self, seq: Sequence, now: float, out: SchedulerOutput) -> int:
        """Preempt seq by recompute; return the tokens it had been given in this step (or 0)."""
        # The priority policy's victim may already sit in this step's batch: the blocks cached
        # for this step would stay in the prefix cache, never written (a no-op for any other victim).
        self.block_manager.forget_unwritten(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        seq.record(EngineEventType.PREEMPTED, now)
        if self.by_priority:
            bisect.insort_left(self.waiting, seq, key=_rank)
        else:
            self.waiting.appendleft(seq)
        out.preempted.append(seq)
        # It may already sit in this step's batch (scheduled before a later sequence ran out).
        # Taking it out of the batch is all the per-step accounting there is to undo: the step's
        # counts (sequences, prefill and decode tokens) are read off the batch, and its prefix-cache
        # stats only count admissions, which a step that preempts does not make.
        if seq not in out.scheduled:
            return 0
        idx = out.scheduled.index(seq)
        del out.scheduled[idx]
        return out.batch.sequences.pop(idx).num_new_tokens

    def _victim_index(self) -> int:
        """The running sequence to preempt: the newest (FCFS), or the worst priority."""
        running = self.running
        if not self.by_priority:
            return len(running) - 1
        return max(range(len(running)), key=lambda k: _rank(running[k]))

    @staticmethod
    def _add_to_batch(out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        out.scheduled.append(seq)
        out.batch.sequences.append(
            ScheduledSequence(
                seq_id=seq.seq_id,
                token_ids=seq.token_ids,
                num_computed_tokens=seq.num_computed_tokens,
                num_new_tokens=num_new,
                block_table=seq.block_table,
                sampling=seq.sampling,
                needs_sample=seq.num_computed_tokens + num_new == seq.num_tokens,
                is_prefill=seq.is_prefill,
                num_output_tokens=seq.num_output_tokens,
            )
        )

    # ---- after the step ---------------------------------------------------------------
    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED


def _rank(seq: Sequence) -> tuple[int, float]:
    return seq.sampling.priority, seq.arrival_time
