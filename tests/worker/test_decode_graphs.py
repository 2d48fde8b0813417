"""Which padded shape a decode step gets (decode_graphs.py): the batch and the context in blocks
each rounded up to a power of two, the context capped at the model's longest; capture_all makes
exactly the buckets that steps within the worker's limits can ask for. The padded steps' answers
are checked on the real model in test_engine_model.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from inference_worker.model.decode_graphs import DecodeGraphs, next_power_of_two


def graphs(max_position: int = 1000, block_size: int = 16) -> DecodeGraphs:
    model = SimpleNamespace(block_size=block_size, max_position=max_position, scratch_slot=4096,
                            device=torch.device("cpu"))
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
    assert bucket.packed[4:6].tolist() == [4096, 4096] and bucket.packed[6:8].tolist() == [1, 1]
