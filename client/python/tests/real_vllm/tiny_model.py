"""A tiny Llama that vLLM can serve on the CPU, built here, with nothing downloaded.

Seeded random weights (transformers' LlamaForCausalLM from a config) and a
word-level tokenizer whose words are "w0" .. "w<vocab-1>", so a prompt is
either token ids or words, and its text maps to the same ids.
"""

from __future__ import annotations

import json
import pathlib

VOCAB = 512


def build(
    directory: pathlib.Path,
    *,
    seed: int = 0,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    dtype: str = "float32",
) -> pathlib.Path:
    """Writes the model (head_dim 64, so hidden = 64 x heads) and its
    tokenizer into `directory` (once: a directory that already holds the same
    model is kept) and returns it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    wanted = {"seed": seed, "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "dtype": dtype, "vocab": VOCAB}
    stamp = directory / "kvtier-tiny-model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(directory)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0", bos_token="w1", eos_token="w2")
    fast.save_pretrained(directory)
    stamp.write_text(json.dumps(wanted))
    return directory


def words(ids: list[int]) -> str:
    """The prompt text whose tokens are `ids`."""
    return " ".join(f"w{i}" for i in ids)
