"""ModelRunner for the real model: StepBatch -> index tensors -> ONE forward -> sampled tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference_worker.engine.sampler import logprobs_of, rows_logprobs, sample
from inference_worker.engine.types import SampleLogprobs, ScheduledSequence, StepBatch
from inference_worker.model.decode_graphs import DecodeGraphs
from inference_worker.model.llama import AttentionGroup, PagedLlama, StepInputs

# Rows of prompt logits computed at once for prompt logprobs: 256 x a 49k vocabulary is 50 MB.
PROMPT_LOGITS_SLICE = 256


class TorchModelRunner:
    """Implements engine.types.ModelRunner over PagedLlama."""

    def __init__(self, model: PagedLlama, decode_graphs: bool | None = None) -> None:
        """decode_graphs: run decode-only steps from CUDA graphs (decode_graphs.py); default on
        CUDA. True on CPU runs the same padded steps uncaptured (what tests check it with)."""
        self.model = model
        self.block_size = model.block_size
        self.num_kv_blocks = model.num_blocks
        self.device = model.device
        self._arange_bs = torch.arange(self.block_size, device=self.device)
        on_cuda = self.device.type == "cuda"
        use_graphs = on_cuda if decode_graphs is None else decode_graphs
        self.decode_graphs = DecodeGraphs(model, capture=on_cuda) if use_graphs else None
        self.num_graph_steps = 0  # decode steps run through self.decode_graphs

    # ---- batch tensors --------------------------------------------------------------------
    def _context_slots(self, seqs: Sequence[ScheduledSequence], max_ctx: int) -> torch.Tensor:
        """[B * max_ctx] pool slots of each sequence's first max_ctx positions (block 0 where padded)."""
        bs = self.block_size
        nblocks = -(-max_ctx // bs)
        tables = [
            list(s.block_table[:nblocks]) + [0] * (nblocks - len(s.block_table[:nblocks])) for s in seqs
        ]
        bt = torch.tensor(tables, dtype=torch.long, device=self.device)
        slots = (bt.unsqueeze(-1) * bs + self._arange_bs).view(len(seqs), nblocks * bs)[:, :max_ctx]
        return slots.reshape(-1)

    def _decode_group(self, seqs: list[ScheduledSequence]) -> AttentionGroup:
        ctx = [s.num_computed_tokens + 1 for s in seqs]
        max_ctx = max(ctx)
        kv_slots = self._context_slots(seqs, max_ctx)
        lens = torch.tensor(ctx, device=self.device)
        mask = (torch.arange(max_ctx, device=self.device) < lens[:, None]).view(len(seqs), 1, 1, max_ctx)
        return AttentionGroup(0, len(seqs), kv_slots, mask, None, len(seqs), 1)

    def _prefill_group(self, seqs: list[ScheduledSequence], start: int) -> AttentionGroup:
        dev = self.device
        b = len(seqs)
        q_lens = [s.num_new_tokens for s in seqs]
        max_q = max(q_lens)
        max_ctx = max(s.num_computed_tokens + s.num_new_tokens for s in seqs)
        kv_slots = self._context_slots(seqs, max_ctx)
        starts = torch.tensor([s.num_computed_tokens for s in seqs], device=dev)
        q_pos = starts[:, None] + torch.arange(max_q, device=dev)  # [B, Q] absolute positions
        mask = torch.arange(max_ctx, device=dev)[None, None, :] <= q_pos[:, :, None]  # causal, [B, Q, C]
        groups = self.model.groups
        mask = mask.unsqueeze(1).expand(b, groups, max_q, max_ctx).reshape(b, 1, groups * max_q, max_ctx)
        pad_index = torch.cat(
            [torch.arange(i * max_q, i * max_q + n, device=dev) for i, n in enumerate(q_lens)]
        )
        return AttentionGroup(start, start + sum(q_lens), kv_slots, mask, pad_index, b, max_q)

    def build_inputs(self, batch: StepBatch) -> tuple[StepInputs, list[int]]:
        """Tensors for one step, and the batch order they use (single-query sequences first)."""
        seqs = batch.sequences
        order = [i for i, s in enumerate(seqs) if s.num_new_tokens == 1]
        order += [i for i, s in enumerate(seqs) if s.num_new_tokens != 1]
        ordered = [seqs[i] for i in order]
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        for s in ordered:
            start, n = s.num_computed_tokens, s.num_new_tokens
            ids.extend(s.token_ids[start : start + n])
            table = s.block_table
            for p in range(start, start + n):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            if s.needs_sample:
                logits_rows.append(len(ids) - 1)
        dev = self.device
        num_single = sum(1 for s in ordered if s.num_new_tokens == 1)
        decode = self._decode_group(ordered[:num_single]) if num_single else None
        prefill = self._prefill_group(ordered[num_single:], num_single) if num_single < len(ordered) else None
        inputs = StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            decode=decode,
            prefill=prefill,
            logits_index=torch.tensor(logits_rows, dtype=torch.long, device=dev),
        )
        return inputs, order

    # ---- prompt logprobs (echo) -------------------------------------------------------------
    @staticmethod
    def _prompt_rows(ordered: list[ScheduledSequence]) -> list[tuple[ScheduledSequence, list[int]]]:
        """For each prefill that asks for prompt logprobs: the rows of the step's tokens whose
        next token is a prompt token (the last prompt position predicts the answer instead)."""
        found = []
        first_row = 0
        for s in ordered:
            if s.sampling.prompt_logprobs is not None and s.is_prefill:
                prompt_len = len(s.token_ids) - s.num_output_tokens
                start = s.num_computed_tokens
                end = min(start + s.num_new_tokens, prompt_len - 1)
                if end > start:
                    found.append((s, list(range(first_row, first_row + end - start))))
            first_row += s.num_new_tokens
        return found

    def _prompt_logprobs(
        self, hidden: torch.Tensor, prompt_rows: list[tuple[ScheduledSequence, list[int]]]
    ) -> None:
        """Log-probabilities of each row's next prompt token and its likeliest alternatives,
        PROMPT_LOGITS_SLICE rows at a time (a whole prompt's logits at once would be
        rows x vocab floats)."""
        at = 0
        for seq, rows in prompt_rows:
            start = seq.num_computed_tokens
            targets = torch.tensor(seq.token_ids[start + 1 : start + 1 + len(rows)], device=self.device)
            top_n = seq.sampling.prompt_logprobs or 0
            found: list[SampleLogprobs] = []
            for lo in range(0, len(rows), PROMPT_LOGITS_SLICE):
                part = hidden[at + lo : at + min(lo + PROMPT_LOGITS_SLICE, len(rows))]
                found += rows_logprobs(self.model.logits(part), targets[lo : lo + part.shape[0]], top_n)
            seq.prompt_logprobs = found
            at += len(rows)

    # ---- decode steps from graphs -------------------------------------------------------------
    def _graph_hidden(self, seqs: Sequence[ScheduledSequence]) -> torch.Tensor | None:
        """Final hidden states of a step where every sequence computes one token and samples the
        next, from self.decode_graphs; None for any other step (it runs eagerly). Such a token is
        a decode or a prompt's last token, which has no prompt logprobs to give (_prompt_rows)."""
        if self.decode_graphs is None or not all(s.num_new_tokens == 1 and s.needs_sample for s in seqs):
            return None
        bs = self.block_size
        positions = [s.num_computed_tokens for s in seqs]
        hidden = self.decode_graphs.run(
            ids=[s.token_ids[p] for s, p in zip(seqs, positions, strict=True)],
            positions=positions,
            slots=[s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions, strict=True)],
            context_lens=[p + 1 for p in positions],
            block_tables=[s.block_table for s in seqs],
        )
        if hidden is not None:
            self.num_graph_steps += 1
        return hidden

    # ---- ModelRunner ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> list[int | None]:
        if not batch.sequences:
            return []
        hidden = self._graph_hidden(batch.sequences)
        if hidden is not None:
            return self._sample(batch, list(range(len(batch.sequences))), self.model.logits(hidden))
        inputs, order = self.build_inputs(batch)
        prompt_rows = self._prompt_rows([batch.sequences[i] for i in order])
        if not prompt_rows:
            logits = self.model.forward(inputs)
        else:
            num_sampled = inputs.logits_index.shape[0]
            extra = [row for _, rows in prompt_rows for row in rows]
            inputs.logits_index = torch.cat(
                (inputs.logits_index, torch.tensor(extra, dtype=torch.long, device=self.device))
            )
            hidden = self.model.hidden(inputs)
            logits = self.model.logits(hidden[:num_sampled])
            self._prompt_logprobs(hidden[num_sampled:], prompt_rows)
        return self._sample(batch, order, logits)

    def _sample(self, batch: StepBatch, order: list[int], logits: torch.Tensor) -> list[int | None]:
        """Tokens for the sequences that sample, from their logits rows (in `order`)."""
        sampled_seqs = [batch.sequences[i] for i in order if batch.sequences[i].needs_sample]
        params = [s.sampling for s in sampled_seqs]
        tokens = sample(
            logits, params, [s.num_output_tokens for s in sampled_seqs], [s.token_ids for s in sampled_seqs]
        )
        if any(p.logprobs is not None for p in params):
            for seq, logprobs in zip(sampled_seqs, logprobs_of(logits, params, tokens), strict=True):
                seq.sampled_logprobs = logprobs
        result: list[int | None] = [None] * len(batch.sequences)
        it = iter(tokens)
        for i in order:
            if batch.sequences[i].needs_sample:
                result[i] = next(it)
        return result
