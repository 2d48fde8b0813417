"""The inference engine: continuous batching over a paged KV cache with prefix caching.

Entry point: `inference_worker.engine.factory.build_engine(config) -> AsyncEngine`
(kept out of this module so that importing the contracts does not import torch).
"""
