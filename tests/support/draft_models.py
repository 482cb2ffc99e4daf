"""Draft model checkpoints for STANDALONE speculative decoding, written by transformers' ``save_pretrained``.

- `small_llama_draft`: a tiny random Llama (2 layers, hidden 32) with stories260K's vocabulary and tokenizer: its
  drafts are mostly rejected, sometimes accepted.
- `shallow_stories_draft`: stories260K's first 4 of 5 layers (same embeddings, norm and head): a realistic
  draft whose greedy tokens often, not always, match the target's.
- `other_vocab_draft`: a tiny random Llama with 600 tokens (another vocabulary).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from pd_cluster.engine.assets import DEFAULT_MODEL

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _with_tokenizer(folder: Path) -> str:
    for name in _TOKENIZER_FILES:
        shutil.copy(Path(DEFAULT_MODEL) / name, folder / name)
    return str(folder)


def small_llama_draft(folder: Path, vocab_size: int = 512, seed: int = 3) -> str:
    """A random 2-layer Llama of hidden size 32 with `vocab_size` tokens (stories260K's tokenizer when 512)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return _with_tokenizer(folder) if vocab_size == 512 else str(folder)


def shallow_stories_draft(folder: Path, num_layers: int = 4) -> str:
    """stories260K cut to its first `num_layers` layers."""
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return _with_tokenizer(folder)


def other_vocab_draft(folder: Path) -> str:
    """A random Llama with 600 tokens: not stories260K's vocabulary."""
    return small_llama_draft(folder, vocab_size=600)
