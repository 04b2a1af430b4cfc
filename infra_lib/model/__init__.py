"""A real LLM in readable torch (L4): model, KV cache, loaders, tokenizer, sampling, generation; LoRA adapters for
it in ``infra_lib.model.lora``."""

from infra_lib.model.attention import cached_attention, causal_mask, repeat_kv
from infra_lib.model.cache import DenseKVCache, DenseLayerCache, KVCache, LayerCache
from infra_lib.model.config import LlamaConfig
from infra_lib.model.generation import Generation, TokenEvent, generate, greedy_decode, print_stream, prompt_ids, stream
from infra_lib.model.loaders import (
    ModelNotInstalled,
    default_gguf_path,
    load_default,
    load_gguf,
    load_hf_dir,
    save_hf_dir,
)
from infra_lib.model.model import Llama
from infra_lib.model.sampling import SamplingParams, filter_logits, sample
from infra_lib.model.tokenizer import Tokenizer

__all__ = [
    "DenseKVCache",
    "DenseLayerCache",
    "Generation",
    "KVCache",
    "LayerCache",
    "Llama",
    "LlamaConfig",
    "ModelNotInstalled",
    "SamplingParams",
    "TokenEvent",
    "Tokenizer",
    "cached_attention",
    "causal_mask",
    "default_gguf_path",
    "filter_logits",
    "generate",
    "greedy_decode",
    "load_default",
    "load_gguf",
    "load_hf_dir",
    "print_stream",
    "prompt_ids",
    "repeat_kv",
    "sample",
    "save_hf_dir",
    "stream",
]
