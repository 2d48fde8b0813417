"""Build the AsyncEngine for a WorkerConfig: the real torch model, or the sim backend."""

from __future__ import annotations

import logging
import os

from inference_worker.config import WorkerConfig
from inference_worker.engine.async_engine import AsyncEngine
from inference_worker.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

# Default KV pool on CPU when neither --num-kv-blocks nor --kv-cache-memory-bytes is given.
DEFAULT_CPU_KV_BYTES = 512 << 20  # ~11.6k tokens of SmolLM2 in float32; the pool is resident memory
# On CUDA: this share of the memory left free after loading the weights.
CUDA_KV_FRACTION = 0.6


def resolve_device_dtype(device: str, dtype: str):
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available")
    if dtype == "auto":
        # bfloat16 where the GPU computes it (Ampere on); an older card (V100, T4) only emulates
        # it, slowly, so float16 there, as vLLM picks for a bfloat16 model on such a card.
        if device != "cuda":
            torch_dtype = torch.float32
        elif torch.cuda.is_bf16_supported(including_emulation=False):
            torch_dtype = torch.bfloat16
        else:
            torch_dtype = torch.float16
    else:
        torch_dtype = getattr(torch, dtype)
    return torch.device(device), torch_dtype


def default_num_threads() -> int:
    """torch threads for the CPU forward: WORKER_TORCH_THREADS, else every core we may run on."""
    if os.environ.get("WORKER_TORCH_THREADS", "").isdigit() and int(os.environ["WORKER_TORCH_THREADS"]) > 0:
        return int(os.environ["WORKER_TORCH_THREADS"])
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _num_kv_blocks(config: WorkerConfig, bytes_per_block: int, device) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_bytes is not None:
        blocks = config.kv_cache_memory_bytes // bytes_per_block
        if blocks < 2:
            raise ValueError(f"--kv-cache-memory-bytes is below two blocks ({2 * bytes_per_block} bytes)")
        return blocks
    wanted = config.max_num_seqs * -(-config.max_model_len // config.block_size)
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * CUDA_KV_FRACTION)
    else:
        budget = DEFAULT_CPU_KV_BYTES
    return max(2, min(wanted, budget // bytes_per_block))


def step_token_budget(config: WorkerConfig, default_budget: int, max_model_len: int) -> int:
    """Tokens one engine step may compute: the flag, else the default; with chunked prefill
    off and no flag, at least max_model_len (vLLM V0's default), so every prompt fits a step."""
    if "max_num_batched_tokens" in config.model_fields_set or config.enable_chunked_prefill:
        return default_budget
    return max(default_budget, max_model_len)


def build_torch_engine(config: WorkerConfig) -> AsyncEngine:
    import torch

    from inference_worker.model.llama import PagedLlama
    from inference_worker.model.loader import load_model
    from inference_worker.model.tokenizer import HFTokenizer
    from inference_worker.model.torch_runner import TorchModelRunner

    device, dtype = resolve_device_dtype(config.device, config.dtype)
    if device.type == "cpu":
        torch.set_num_threads(default_num_threads())
    loaded = load_model(config.model, device=str(device), dtype=dtype)
    hf_config = loaded.hf_model.config
    eos = hf_config.eos_token_id
    tokenizer = HFTokenizer(loaded.hf_tokenizer, extra_eos_token_ids=eos if isinstance(eos, list) else [eos])
    max_model_len = min(config.max_model_len, int(getattr(hf_config, "max_position_embeddings", 1 << 30)))
    num_blocks = _num_kv_blocks(
        config, PagedLlama.kv_bytes_per_block(hf_config, config.block_size, dtype), device
    )
    model = PagedLlama(loaded.hf_model, num_blocks, config.block_size, device, dtype)
    del loaded  # PagedLlama holds the weights it needs
    runner = TorchModelRunner(model, decode_graphs=device.type == "cuda" and not config.enforce_eager)
    if runner.decode_graphs is not None:  # every graph now, not at a request's first step
        try:
            runner.decode_graphs.capture_all(config.max_num_seqs, max_model_len)
        except RuntimeError as e:  # a torch or driver that cannot capture: serve, eagerly
            log.error("decode CUDA graphs could not be captured (%s): every step runs eagerly; "
                      "--enforce-eager skips the attempt", e)
            runner.decode_graphs = None
    engine = LLMEngine(
        runner,
        tokenizer,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=step_token_budget(config, config.max_num_batched_tokens, max_model_len),
        max_model_len=max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_chunked_prefill=config.enable_chunked_prefill,
        scheduling_policy=config.scheduling_policy,
    )
    log.info(
        "engine ready: %s on %s/%s, %d KV blocks of %d tokens, max_model_len %d",
        config.model,
        device,
        str(dtype).removeprefix("torch."),
        num_blocks,
        config.block_size,
        engine.max_model_len,
    )

    def gpu_memory() -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(device)
        return total - free, total

    return AsyncEngine(
        engine,
        model_name=config.model_name,
        log_stats_interval=config.log_stats_interval,
        gpu_memory_fn=gpu_memory if device.type == "cuda" else None,
        step_context=torch.inference_mode,
    )


def build_sim_engine(config: WorkerConfig) -> AsyncEngine:
    from inference_worker.sim import build_sim_setup  # the sim backend; imported only when used

    # The setup already applies the profile's defaults except where the user set a flag.
    setup = build_sim_setup(config)
    engine = LLMEngine(
        setup.runner,
        setup.tokenizer,
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=step_token_budget(config, setup.max_num_batched_tokens, setup.max_model_len),
        max_model_len=setup.max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_chunked_prefill=config.enable_chunked_prefill,
        scheduling_policy=config.scheduling_policy,
        clock=setup.clock,  # monotonic / time_scale: metrics report simulated seconds
        num_kv_blocks=setup.num_kv_blocks,
    )
    return AsyncEngine(engine, model_name=config.model_name, log_stats_interval=config.log_stats_interval)


def build_engine(config: WorkerConfig) -> AsyncEngine:
    """Blocking (loads the model): call it before starting the event loop, or via asyncio.to_thread."""
    if config.backend == "sim":
        return build_sim_engine(config)
    return build_torch_engine(config)
