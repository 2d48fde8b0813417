"""Which padded shape a decode step gets (decode_graphs.py): the batch and the context in blocks
each rounded up to a power of two, the context capped at the model's longest; capture_all makes
exactly the buckets that steps within the worker's limits can ask for, but none whose padded
context (batch x context) outgrows the KV pool. The padded steps' answers
are checked on the real model in test_engine_model.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from inference_worker.model.decode_graphs import DecodeGraphs, next_power_of_two


def graphs(max_position: int = 1000, block_size: int = 16, num_blocks: int = 1024) -> DecodeGraphs:
    model = SimpleNamespace(block_size=block_size, max_position=max_position, num_blocks=num_blocks,
                            scratch_slot=num_blocks * block_size, device=torch.device("cpu"))
    return DecodeGraphs(model, capture=False)  # type: ignore[arg-type]


@pytest.mark.parametrize(("n", "expected"), [(1, 1), (2, 2), (3, 4), (16, 16), (17, 32)])
def test_next_power_of_two(n, expected):
    assert next_power_of_two(n) == expected


def test_bucket_rounds_batch_and_blocks_up_and_caps_the_context():
    g = graphs()  # 1000 positions: 63 blocks of 16
    assert g.bucket_of(3, 17) == (4, 2)  # 17 tokens need 2 blocks
    assert g.bucket_of(5, 16) == (8, 1)
    assert g.bucket_of(1, 300) == (1, 32)  # 19 blocks
    assert g.bucket_of(1, 1000) == (1, 63)  # 63 blocks, not 64: no context is longer


def test_capture_all_makes_every_bucket_a_step_within_the_limits_can_ask_for():
    g = graphs()
    count = g.capture_all(max_batch=6, max_context=1000)
    made = set(g._buckets)
    assert count == len(made) == 4 * 7  # batches 1, 2, 4, 8; blocks 1, 2, 4, ..., 32, 63
    for batch in range(1, 7):
        for context in (1, 16, 17, 200, 513, 999, 1000):
            assert g.bucket_of(batch, context) in made
    # Each bucket's buffer starts as all padding: rows write the scratch slot, attend to one slot.
    bucket = g._buckets[(2, 4)]
    assert bucket.packed[4:6].tolist() == [16384, 16384] and bucket.packed[6:8].tolist() == [1, 1]


def test_no_graph_for_a_bucket_whose_padded_context_outgrows_the_pool():
    """A pool of 64 blocks (1,024 tokens): 8 sequences padded to 128 tokens fit, 16 at 1,000
    tokens do not. That step runs eagerly (run answers None) and no graph is made for it."""
    g = graphs(num_blocks=64)
    g.capture_all(max_batch=16, max_context=1000)
    assert all(b * n * 16 <= 1024 for b, n in g._buckets)
    assert (8, 8) in g._buckets and (16, 63) not in g._buckets
    many_long = g.run(ids=[1] * 16, positions=[999] * 16, slots=[0] * 16, context_lens=[1000] * 16,
                      block_tables=[[0] * 63] * 16)
    assert many_long is None
