"""Paged KV-cache accounting: a fixed pool of blocks, per-sequence block tables, prefix caching.

The block manager only does bookkeeping; the K/V tensors live in the model runner's
pool, indexed by the physical block ids handed out here.

Prefix caching (as in vLLM v1): a *full* block is identified by the hash of
(parent block's hash, this block's token ids), so equal hashes mean equal prefixes. A request's
`cache_salt` goes into its first block's hash, as vLLM's does: only requests with the same salt
share blocks.
Full blocks are registered in `_cached` as soon as they are allocated for a step that
fills them: the runner writes each layer's K/V for the whole batch before attending,
so even a request scheduled in the same step can read them. A block whose ref count
drops to zero stays cached but goes to the free queue; allocation takes blocks from
the front of that queue (least recently freed first), evicting their hash then.
"""

from __future__ import annotations

from collections import OrderedDict

from inference_worker.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Free blocks in eviction order (front = evicted first). Cached blocks keep their
        # hash here until they are handed out again.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id

    # ---- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a live sequence (cached-but-free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # ---- prefix cache -----------------------------------------------------------------
    def _hash_full_blocks(self, seq: Sequence, upto_tokens: int) -> None:
        """Extend seq.block_hashes to cover every full block within the first `upto_tokens`."""
        bs = self.block_size
        hashes = seq.block_hashes
        tokens = seq.token_ids
        salt = seq.sampling.cache_salt
        for i in range(len(hashes), upto_tokens // bs):
            parent = hashes[i - 1] if i else (0 if salt is None else hash(("cache_salt", salt)))
            hashes.append(hash((parent, *tokens[i * bs : (i + 1) * bs])))

    def reads_cache(self, seq: Sequence) -> bool:
        """Whether seq's admission looks the prefix cache up at all (and so counts a query)."""
        # A request for prompt logprobs needs every prompt position computed (vLLM's
        # skip_reading_prefix_cache: no lookup, and no query counted).
        return self.enable_prefix_caching and seq.sampling.prompt_logprobs is None

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Physical blocks holding the longest cached prefix of seq (full blocks only).

        The last token is always left to compute, so a fully cached prompt still
        yields logits for its next token.
        """
        if not self.reads_cache(seq):
            return []
        limit = seq.num_tokens - 1
        self._hash_full_blocks(seq, limit)
        blocks = []
        for i in range(limit // self.block_size):
            block = self._cached.get(seq.block_hashes[i])
            if block is None:
                break
            blocks.append(block)
        return blocks

    def can_allocate(self, seq: Sequence, cached_blocks: list[int], num_tokens: int,
                     keep_free: int = 0) -> bool:
        """Whether seq (holding no blocks yet) can get `num_tokens` of slots, reusing cached_blocks,
        and still leave `keep_free` blocks free."""
        need = -(-num_tokens // self.block_size) - len(cached_blocks)
        # Cached blocks that sit in the free queue would be taken out of it, not allocated.
        reclaimable = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        return need + keep_free <= len(self._free) - reclaimable

    def take_cached(self, seq: Sequence, cached_blocks: list[int]) -> None:
        """Attach cached blocks to seq's (empty) block table; their tokens count as computed."""
        for b in cached_blocks:
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1
        seq.block_table.extend(cached_blocks)
        seq.num_computed_tokens = len(cached_blocks) * self.block_size

    # ---- allocation ---------------------------------------------------------------------
    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        self._uncache(block)  # evict: this block's contents are about to be overwritten
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's block table to hold num_computed + num_new_tokens slots. False if out of blocks."""
        total = seq.num_computed_tokens + num_new_tokens
        need = self.blocks_needed(seq, total)
        if need > len(self._free):
            return False
        table = seq.block_table
        for _ in range(need):
            table.append(self._pop_free())
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, total)
        return True

    def _register_full_blocks(self, seq: Sequence, total: int) -> None:
        """Cache every block that is full once this step has written `total` tokens."""
        bs = self.block_size
        full = min(total, seq.num_tokens) // bs
        first_new = seq.num_computed_tokens // bs
        if full <= first_new:
            return
        self._hash_full_blocks(seq, full * bs)
        for i in range(first_new, full):
            block = seq.block_table[i]
            h = seq.block_hashes[i]
            if self.block_hash[block] is None and h not in self._cached:
                self.block_hash[block] = h
                self._cached[h] = block

    def _uncache(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if self._cached.get(h) == block:
                del self._cached[h]
            self.block_hash[block] = None

    def forget_unwritten(self, seq: Sequence) -> None:
        """Take seq's blocks that the coming step was to fill out of the prefix cache.

        They were cached when allocated for that step (see the module docstring); a sequence
        preempted after it was scheduled in the step is not computed, so its blocks from index
        num_computed_tokens // block_size on do not hold what their hashes name, and a later
        request must not be handed them.
        """
        for block in seq.block_table[seq.num_computed_tokens // self.block_size :]:
            self._uncache(block)

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Tail blocks go to the eviction front: they are the least shareable."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is None:
                    self._free[block] = None
                    self._free.move_to_end(block, last=False)  # uncached: reuse first
                else:
                    self._free[block] = None
        seq.block_table.clear()
        seq.num_computed_tokens = 0
