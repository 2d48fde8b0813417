"""The real model: loading (GGUF alias or HF dir), tokenizer wrapper, our batched Llama forward."""
