"""Decode steps replayed from CUDA graphs.

On a GPU a small model's decode step is bound by the host, not the GPU: ~680 kernel launches
at ~8 us each plus torch's dispatch around them, while the GPU sits idle 80% of the step
(RESULTS.md, "The worker on a GPU"). A CUDA graph records a step's kernels once and launches
them all with one call, as vLLM does for its decode batches.

A graph fixes every tensor's shape and address, so a decode-only step is padded to a bucket:
its batch to the next power of two, its context (in KV blocks) to the next power of two,
capped at the model's longest context. Each bucket gets its own graph, captured the first time
it is needed (or all at start-up, `capture_all`, as the worker does), and all graphs share one
memory pool. A step's integers travel to the GPU in one copy into the graph's input buffer;
the graph gathers each sequence's context slots from its block table and builds its mask itself.

Only buckets of at most as many padded context tokens (batch x context) as the KV pool holds
get a graph: a step gathers its whole padded context, and a bucket of 256 sequences at a 32k
context would need more memory than the pool itself, for batches the pool cannot hold anyway.
A step beyond that runs eagerly.

Padded rows compute token 0 at position 0, attend to slot 0 only (any finite slot would do:
an all-masked row would give NaN), and write their K/V into a scratch slot past the pool's end
that no real sequence reads. Real rows are computed as in the eager forward; only the number of
rows in each matmul changes, which moves the last bits of a float as batching does
(llama.py's docstring).

Without CUDA (`capture=False`) the padded step runs as it is, uncaptured: the tests here check
the padding with it, and the GPU check (benchmarks/cuda_check.sh) runs the same tests captured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inference_worker.model.llama import AttentionGroup, PagedLlama, StepInputs

log = logging.getLogger(__name__)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass
class _Bucket:
    """One padded shape: its input buffer (ids, positions, slots, context lengths and block
    tables, packed so that one copy fills it), its output, and its graph (None uncaptured)."""

    batch: int
    blocks: int
    packed: torch.Tensor  # long [4 * batch + batch * blocks]
    hidden: torch.Tensor | None = None  # [batch, hidden] final normed states: the graph's output
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """Runs decode-only steps of `model` padded to buckets, from CUDA graphs when `capture`."""

    def __init__(self, model: PagedLlama, capture: bool) -> None:
        self.model = model
        self.capture = capture
        self.block_size = model.block_size
        self.max_blocks = -(-model.max_position // model.block_size)
        self.scratch_slot = model.scratch_slot
        self.max_padded_tokens = model.num_blocks * model.block_size  # the pool's slots
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._arange_bs = torch.arange(self.block_size, device=model.device)

    def bucket_of(self, batch: int, max_context: int) -> tuple[int, int]:
        blocks = -(-max_context // self.block_size)
        return next_power_of_two(batch), min(next_power_of_two(blocks), self.max_blocks)

    def has_room(self, batch: int, blocks: int) -> bool:
        """Whether a bucket's padded context fits the pool's size (module docstring)."""
        return batch * blocks * self.block_size <= self.max_padded_tokens

    @torch.inference_mode()
    def capture_all(self, max_batch: int, max_context: int) -> int:
        """Capture every bucket up to these limits (the largest first, as their memory is then
        reused by the smaller ones); returns how many graphs exist."""
        top_batch, top_blocks = self.bucket_of(max_batch, max_context)
        batches = [1 << i for i in range(top_batch.bit_length())]  # top_batch is a power of two
        powers = range(next_power_of_two(top_blocks).bit_length())  # top_blocks may be the cap
        blocks = sorted({min(1 << i, self.max_blocks) for i in powers})
        t0 = time.perf_counter()
        for b in reversed(batches):
            for n in reversed(blocks):
                if self.has_room(b, n):
                    self._bucket(b, n)
        log.info("decode CUDA graphs: %d captured in %.1f s (batch up to %d, context up to %d "
                 "tokens, batch x context up to %d)", len(self._buckets), time.perf_counter() - t0,
                 top_batch, top_blocks * self.block_size, self.max_padded_tokens)
        return len(self._buckets)

    def run(self, ids: list[int], positions: list[int], slots: list[int],
            context_lens: list[int], block_tables: list[Sequence[int]]) -> torch.Tensor | None:
        """Final hidden states [B, hidden] of one decode-only step (one new token per sequence);
        None when its bucket is beyond the pool's size (the caller runs it eagerly)."""
        b = len(ids)
        shape = self.bucket_of(b, max(context_lens))
        if not self.has_room(*shape):
            return None
        bucket = self._bucket(*shape)
        pad = bucket.batch - b
        table: list[int] = []
        for t in block_tables:
            row = t[: bucket.blocks]
            table.extend(row)
            table.extend([0] * (bucket.blocks - len(row)))
        host = torch.tensor(
            ids + [0] * pad + positions + [0] * pad + slots + [self.scratch_slot] * pad
            + context_lens + [1] * pad + table + [0] * (pad * bucket.blocks),
            dtype=torch.long,
        )
        bucket.packed.copy_(host, non_blocking=True)
        if bucket.graph is not None:
            bucket.graph.replay()
            assert bucket.hidden is not None
            return bucket.hidden[:b]
        return self._forward(bucket)[:b]

    # ---- buckets ---------------------------------------------------------------------------
    def _bucket(self, batch: int, blocks: int) -> _Bucket:
        found = self._buckets.get((batch, blocks))
        if found is not None:
            return found
        packed = torch.zeros(4 * batch + batch * blocks, dtype=torch.long, device=self.model.device)
        packed[2 * batch : 3 * batch] = self.scratch_slot  # a warm-up writes only to the scratch slot
        packed[3 * batch : 4 * batch] = 1  # every row attends to one slot: no all-masked row
        bucket = _Bucket(batch, blocks, packed)
        if self.capture:
            self._capture(bucket)
        self._buckets[(batch, blocks)] = bucket
        return bucket

    def _capture(self, bucket: _Bucket) -> None:
        t0 = time.perf_counter()
        side = torch.cuda.Stream(device=self.model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: lazy inits, cuBLAS workspaces
            self._forward(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's other thread may ask CUDA for its memory use meanwhile.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            bucket.hidden = self._forward(bucket)
        bucket.graph = graph
        log.debug("decode CUDA graph for batch %d, %d blocks: %.0f ms",
                  bucket.batch, bucket.blocks, (time.perf_counter() - t0) * 1e3)

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        """The padded step from the bucket's input buffer: what the graph records."""
        b, n = bucket.batch, bucket.blocks
        p = bucket.packed
        ids, positions, slots, lens = p[:b], p[b : 2 * b], p[2 * b : 3 * b], p[3 * b : 4 * b]
        tables = p[4 * b :].view(b, n)
        context = n * self.block_size
        kv_slots = (tables.unsqueeze(-1) * self.block_size + self._arange_bs).reshape(-1)
        positions_axis = torch.arange(context, device=p.device)
        mask = (positions_axis < lens[:, None]).view(b, 1, 1, context)
        group = AttentionGroup(0, b, kv_slots, mask, None, b, 1)
        rows = torch.arange(b, device=p.device)
        return self.model.hidden(StepInputs(ids, positions, slots, group, None, rows))
