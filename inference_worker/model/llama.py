"""Our own batched Llama forward over a paged KV pool (nano-vllm style), using HF weights.

One call computes every scheduled token of a step, prefill chunks and decodes together:
the tokens of all sequences are concatenated into one [T, hidden] activation so every
linear layer is a single matmul over the batch. Per layer, the new K/V rows are first
written into the pool (`slot_mapping`), then each query attends to its sequence's
context gathered from the pool. Attention runs in two groups, so a long prefill never
pads the decodes: decodes (one query each) in one SDPA call over [B, kv_heads, groups, ctx],
and prefill chunks in one padded, causally masked SDPA call. The query heads sharing a KV
head are folded into the query axis, so K/V are never repeated for GQA.

Numerics: float32 matmuls are not bit-identical across batch sizes (MKL picks kernels by
the row count; measured differences ~1e-5), so logits of a sequence differ in the last bits
between running alone and batched. Greedy ids are what must match (tested for alone,
batched, prefix-hit and preempted runs); only an argmax near-tie below that noise could flip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    """Index tensors for one attention group, built once per step and reused by every layer."""

    start: int  # this group's rows of the step's token axis are [start, end)
    end: int
    kv_slots: torch.Tensor  # [B * C] pool slots of each sequence's context (0 where padded), flattened
    mask: torch.Tensor  # bool, [B, 1, Q, C] (decode: Q = 1); True = may attend
    pad_index: torch.Tensor | None  # [N] positions in the flattened [B * Q] padded query axis
    num_seqs: int
    max_q: int


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] pool slot each new token's K/V is written to
    decode: AttentionGroup | None
    prefill: AttentionGroup | None
    logits_index: torch.Tensor  # [S] rows of T whose logits are needed (last token of sampled seqs)


class PagedLlama:
    def __init__(
        self, hf_model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        cfg = hf_model.config
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.groups = self.num_heads // self.num_kv_heads
        self.eps = cfg.rms_norm_eps
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        self.scale = self.head_dim**-0.5

        def w(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=device, dtype=dtype).contiguous()

        def w_t(t: torch.Tensor) -> torch.Tensor:
            """The weight transposed (a view, no copy), so that `x @ w_t(weight)` projects x."""
            return w(t).T

        inner = hf_model.model
        self.embed = w(inner.embed_tokens.weight)
        self.lm_head = w(hf_model.lm_head.weight) if not cfg.tie_word_embeddings else self.embed
        self.final_norm = w(inner.norm.weight)
        # Per layer: norm, [hidden, q+k+v], [q, hidden], norm, [hidden, gate+up], [intermediate, hidden].
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                (
                    w(layer.input_layernorm.weight),
                    w_t(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])),
                    w_t(attn.o_proj.weight),
                    w(layer.post_attention_layernorm.weight),
                    w_t(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                    w_t(mlp.down_proj.weight),
                )
            )
        if any(getattr(layer.self_attn.q_proj, "bias", None) is not None for layer in inner.layers):
            raise ValueError("attention biases are not supported by this Llama forward")
        self.intermediate = self.layers[0][4].shape[1] // 2
        self._init_rope(hf_model, cfg)
        # The KV pool: per layer, [slots, 2 (K, V), kv_heads, head_dim], slot = block * block_size + offset.
        # K and V side by side: one index_copy_ writes and one index_select gathers both.
        # One slot past the blocks is scratch: padded rows of a CUDA-graph step write there
        # (decode_graphs.py), and no sequence's context ever reads it.
        self.scratch_slot = num_blocks * block_size
        shape = (self.num_layers, self.scratch_slot + 1, 2, self.num_kv_heads, self.head_dim)
        self.kv_cache = torch.zeros(shape, device=device, dtype=dtype)
        if device.type == "cuda":
            # cuDNN's attention (torch's first choice for bfloat16 on Hopper) costs ~1.2 ms of
            # host time per call here, against ~30 us of GPU time: it builds a plan for each new
            # shape, and a step's shapes change with every context length. At 256 sequences it
            # was 67% of a step's host time and the GPU sat idle 89% of the time (RESULTS.md,
            # "The worker on a GPU"). The memory-efficient kernel takes our masks as they are.
            # Process-wide, as the worker's process holds one model.
            torch.backends.cuda.enable_cudnn_sdp(False)

    def _init_rope(self, hf_model, cfg) -> None:
        # Reuse the HF rotary module so every rope scaling variant matches transformers exactly.
        rotary = hf_model.model.rotary_emb
        max_pos = int(getattr(cfg, "max_position_embeddings", 8192))
        pos = torch.arange(max_pos, device=rotary.inv_freq.device)[None]
        dummy = torch.zeros(1, device=rotary.inv_freq.device, dtype=torch.float32)
        with torch.no_grad():
            cos, sin = rotary(dummy, pos)
        self.cos = cos[0].to(device=self.device, dtype=self.dtype)  # [max_pos, head_dim]
        # rotate_half(x) * sin == roll(x, half) * (sin with its first half negated): see _rope.
        half = self.head_dim // 2
        sin_signed = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        self.sin_signed = sin_signed.to(device=self.device, dtype=self.dtype)
        self.max_position = max_pos

    @staticmethod
    def kv_bytes_per_block(cfg, block_size: int, dtype: torch.dtype) -> int:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * head_dim * elem

    # ---- forward -----------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """HF's x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) written as
        roll(x) = cat(x2, x1) times a sign folded into sin: three ops instead of five (on a GPU
        a small model's step is bound by the host's cost per op)."""
        return torch.addcmul(x * cos, x.roll(self.head_dim // 2, dims=-1), sin_signed)

    def _attend(self, group: AttentionGroup, q, layer: int) -> torch.Tensor:
        """q: [N, heads, head_dim] of this group's tokens -> [N, heads * head_dim]."""
        b, kvh, g, d = group.num_seqs, self.num_kv_heads, self.groups, self.head_dim
        # index_select copies whole rows: several times faster than advanced indexing on CPU.
        kv = self.kv_cache[layer].index_select(0, group.kv_slots).view(b, -1, 2, kvh, d)
        k = kv[:, :, 0].transpose(1, 2)  # [B, kvh, C, d]
        v = kv[:, :, 1].transpose(1, 2)
        if group.pad_index is None:  # decode: one query per sequence
            qg = q.view(b, kvh, g, d)
            out = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.mask, scale=self.scale)
            return out.reshape(b, kvh * g * d)
        qmax = group.max_q
        padded = q.new_zeros(b * qmax, kvh * g, d)
        padded[group.pad_index] = q
        # [B, Q, kvh, g, d] -> [B, kvh, g * Q, d]: fold the query heads of one KV head into the query axis.
        qg = padded.view(b, qmax, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * qmax, d)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.mask, scale=self.scale)
        out = out.view(b, kvh, g, qmax, d).permute(0, 3, 1, 2, 4).reshape(b * qmax, kvh * g * d)
        return out[group.pad_index]

    def forward(self, inp: StepInputs) -> torch.Tensor:
        """Return logits [S, vocab] for the rows in inp.logits_index."""
        return self.logits(self.hidden(inp))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] final hidden states (see `hidden`) -> [R, vocab] logits."""
        return hidden @ self.lm_head.T

    def hidden(self, inp: StepInputs) -> torch.Tensor:
        """The final (normed) hidden states [S, hidden] of the rows in inp.logits_index: many
        rows' logits (prompt logprobs) can then be computed a slice at a time."""
        x = F.embedding(inp.input_ids, self.embed)
        cos = self.cos[inp.positions].unsqueeze(1)
        sin = self.sin_signed[inp.positions].unsqueeze(1)
        h_, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = h_ * d, kvh * d
        t = x.shape[0]
        slots = inp.slot_mapping
        dec, pre = inp.decode, inp.prefill
        norm_shape = (x.shape[-1],)
        for li, (ln1, wqkv, wo, ln2, wgu, wdown) in enumerate(self.layers):
            h = F.rms_norm(x, norm_shape, ln1, self.eps)
            qkv = h @ wqkv
            # Q and K rotate together: one set of rope ops per layer instead of two.
            qk = self._rope(qkv[:, : q_size + kv_size].view(t, h_ + kvh, d), cos, sin)
            q, k = qk[:, :h_], qk[:, h_:]
            v = qkv[:, q_size + kv_size :].view(t, kvh, d)
            self.kv_cache[li].index_copy_(0, slots, torch.stack((k, v), dim=1))
            if pre is None:
                attn = self._attend(dec, q, li)
            elif dec is None:
                attn = self._attend(pre, q, li)
            else:  # the runner puts single-query sequences first
                attn = torch.cat((self._attend(dec, q[: dec.end], li), self._attend(pre, q[pre.start :], li)))
            x = torch.addmm(x, attn, wo)
            h = F.rms_norm(x, norm_shape, ln2, self.eps)
            gu = h @ wgu
            act = F.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate :]
            x = torch.addmm(x, act, wdown)
        x = x[inp.logits_index]
        return F.rms_norm(x, norm_shape, self.final_norm, self.eps)
