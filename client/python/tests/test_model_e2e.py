"""A real model end to end: a seeded Llama (transformers, no download)
prefills a prompt here and stores its KV blocks through kvtierd; another
process, with its own client and its own copy of the model, loads the blocks
a second prompt shares with it, computes the rest of that prompt and decodes.

Its logits are compared with recomputes done here without kvtier:
- the same computation (the stored prefix's KV, then the rest of the second
  prompt, then decoding): bit-exact, fp32 and bf16 alike, since the KV comes
  back byte for byte and the same operations run on the same shapes;
- the whole second prompt in one forward pass: BLAS and attention kernels
  then see other shapes and may round differently, so fp32 is compared within
  a tight tolerance, and bf16 within its rounding of the bf16 single pass and
  of the fp32 model (see _BF16_TOLERANCE_U).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import tempfile
import time
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import kvtier
from conftest import Daemon
from llama_kv import (
    EngineKv,
    LayerKv,
    TinyLlama,
    _prefill_by_layer,
    cache_from,
    decode,
    forward,
    kv_of,
    prefill_with_kvtier,
    store_prefix,
)

BLOCK_TOKENS = 16
SHARED_TOKENS = 90  # the shared prefix: 5 full blocks, and 10 tokens of a 6th
SHARED_BLOCKS = SHARED_TOKENS // BLOCK_TOKENS
STEPS = 4  # tokens decoded after the prompt
CAPACITY_BLOCKS = 8  # engine blocks: both prompts fit
# The loading process gets this long for start-up (importing torch and
# transformers) and its work.
CHILD_TIMEOUT_S = 120


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: torch.equal on floats calls -0 and +0 equal."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bytes(a: list[LayerKv], b: list[LayerKv]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(bits(ka), bits(kb)) and torch.equal(bits(va), bits(vb)) for (ka, va), (kb, vb) in zip(a, b)
    )


def fields(placements: list[kvtier.Placement]) -> list[tuple[int, ...]]:
    names = ("region", "offset_bytes", "block_stride_bytes", "token_stride_bytes", "head_stride_bytes")
    return [tuple(getattr(p, n) for n in names) for p in placements]


def load_and_decode(
    socket: str, spec: TinyLlama, prompt: list[int], steps: int, threads: int, by_layer: bool = False
) -> dict[str, Any]:
    """The loading engine, in the other process: its own model (the same
    seed), its own client and KV memory. Prefills prompt with what kvtier
    has (loaded whole, or by layer under the forward pass), then decodes
    greedily."""
    # The same thread count as the process that compares, so BLAS splits the
    # work the same way.
    torch.set_num_threads(threads)
    model = spec.build()
    with kvtier.Client.connect(socket, name="model-e2e-loader") as client:
        engine = EngineKv(client, spec.layout(BLOCK_TOKENS), CAPACITY_BLOCKS)
        prefill = prefill_with_kvtier(client, engine, model, prompt, by_layer=by_layer)
        out_tokens, logits = decode(model, prefill.cache, prefill.logits, steps)
        loaded = [(k.clone(), v.clone()) for k, v in engine.kv(prefill.loaded_blocks)]
    return {
        "pid": os.getpid(),
        "hits": prefill.hits,
        "tiers": prefill.tiers,
        "loaded_blocks": prefill.loaded_blocks,
        "redone": "redone" in prefill.seconds,
        "kv": loaded,
        "tokens": out_tokens,
        "logits": logits,
    }


@pytest.fixture(scope="module")
def other_process() -> Iterator[Any]:
    """A second Python process (spawned: no state shared with this one),
    kept for the module's tests so that it imports torch once."""
    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        yield pool
    finally:
        pool.terminate()
        pool.join()


# bf16 against fp32: the bf16 model is the fp32 one with its weights rounded
# to bf16 (8 significant bits, unit roundoff u = 2^-8), and every activation,
# the KV and the logits are rounded to bf16 as well. Rounding the logits alone
# moves them by up to u * |logit|; the weights' and activations' rounding, in
# two layers of sums over 128-256 terms, adds a few such errors (random signs
# grow as the square root of the number of terms). So a logit may differ by a
# small multiple of u times the logits' scale: 8 u * max|logit| is that bound
# with a margin (measured here: 1.6 u; the test prints it with -s).
_BF16_TOLERANCE_U = 8
_BF16_U = 2.0**-8


@pytest.mark.parametrize("dtype,by_layer", [("fp32", False), ("bf16", False), ("fp32", True), ("bf16", True)])
def test_a_prefix_stored_here_is_loaded_in_another_process_and_decodes_as_a_recompute(
    daemon: Daemon, client: kvtier.Client, other_process: Any, dtype: str, by_layer: bool
) -> None:
    spec = TinyLlama(dtype=dtype)
    model = spec.build()
    config = model.config
    vocab = spec.vocab_size
    shared = tokens(1, SHARED_TOKENS, vocab)
    prompt_a = shared + tokens(2, 22, vocab)  # 112 tokens: 7 full blocks
    prompt_b = shared + tokens(3, 13, vocab)  # 103 tokens: 6 full blocks, the first 5 shared
    prefix = SHARED_BLOCKS * BLOCK_TOKENS

    # This process: prompt A prefilled, its full blocks stored.
    engine = EngineKv(client, spec.layout(BLOCK_TOKENS), CAPACITY_BLOCKS)
    cache_a = DynamicCache(config=config)
    forward(model, prompt_a, cache_a)
    keys_a = store_prefix(client, engine, kv_of(cache_a, len(prompt_a)), prompt_a)
    assert len(keys_a) == len(prompt_a) // BLOCK_TOKENS == 7

    # Chain keys: prompt B hits the shared full blocks and nothing after them
    # (its 6th block mixes shared tokens with its own); one other token, a
    # different first token or another model misses from there on.
    keys_b = client.compute_keys(engine.cache, prompt_b)
    assert keys_b[:SHARED_BLOCKS] == keys_a[:SHARED_BLOCKS] and keys_b[SHARED_BLOCKS] != keys_a[SHARED_BLOCKS]
    assert client.lookup(engine.cache, keys_b).hits == SHARED_BLOCKS
    changed = list(prompt_b)
    changed[3 * BLOCK_TOKENS + 7] = (changed[3 * BLOCK_TOKENS + 7] + 1) % vocab
    assert client.lookup(engine.cache, client.compute_keys(engine.cache, changed)).hits == 3
    changed = [(prompt_b[0] + 1) % vocab] + prompt_b[1:]
    assert client.lookup(engine.cache, client.compute_keys(engine.cache, changed)).hits == 0
    other_model = EngineKv(client, dataclasses.replace(spec, seed=1).layout(BLOCK_TOKENS), 1)
    assert client.lookup(other_model.cache, client.compute_keys(other_model.cache, prompt_b)).hits == 0

    # The other process loads prompt B's cached blocks and decodes.
    loads_by_layer = client.stats()["counters"]["loads_by_layer"]
    got = other_process.apply_async(
        load_and_decode, (daemon.socket, spec, prompt_b, STEPS, torch.get_num_threads(), by_layer)
    ).get(timeout=CHILD_TIMEOUT_S)
    assert got["pid"] != os.getpid()
    assert (got["hits"], got["loaded_blocks"], got["redone"]) == (SHARED_BLOCKS, SHARED_BLOCKS, False)
    assert client.stats()["counters"]["loads_by_layer"] - loads_by_layer == int(by_layer)
    assert set(got["tiers"]) == {"host"}, got["tiers"]
    assert same_bytes(got["kv"], kv_of(cache_a, prefix)), "the loaded KV differs from the stored bytes"

    # The same computation without kvtier: bit-exact.
    reference = cache_from(kv_of(cache_a, prefix), config)
    ref_tokens, ref_logits = decode(model, reference, forward(model, prompt_b[prefix:], reference), STEPS)
    assert got["tokens"] == ref_tokens
    assert len(got["logits"]) == STEPS + 1
    for step, (a, b) in enumerate(zip(got["logits"], ref_logits)):
        assert torch.equal(bits(a), bits(b)), f"logits of step {step} differ from the recompute"

    # Prompt B in one pass, then the same tokens fed (teacher forcing).
    full = DynamicCache(config=config)
    _, full_logits = decode(model, full, forward(model, prompt_b, full), STEPS, forced=got["tokens"])
    diff_full = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got["logits"], full_logits))
    if dtype == "fp32":
        # Other shapes, possibly other roundings: equal up to a few fp32 ulps
        # (the logits are below 1 here). On the machine this was written on,
        # they were equal.
        print(f"fp32 logits: max |diff| {diff_full:.3g} from the single pass")
        assert diff_full <= 1e-5
        return

    # bf16: within bf16 rounding of the bf16 single pass and of the fp32 model.
    model32 = dataclasses.replace(spec, dtype="fp32").build()
    full32 = DynamicCache(config=model32.config)
    _, logits32 = decode(model32, full32, forward(model32, prompt_b, full32), STEPS, forced=got["tokens"])
    scale = max(float(t.abs().max()) for t in logits32)
    bound = _BF16_TOLERANCE_U * _BF16_U * scale
    diff_fp32 = max(float((a.float() - b).abs().max()) for a, b in zip(got["logits"], logits32))
    print(
        f"bf16 logits: max |diff| {diff_full:.3g} from the bf16 single pass, {diff_fp32:.3g} from fp32 "
        f"({diff_fp32 / (_BF16_U * scale):.2f} u * max|logit|); bound {bound:.3g}"
    )
    assert diff_full <= bound and diff_fp32 <= bound


def test_a_load_by_layer_that_ends_short_is_prefilled_again_on_the_blocks_that_arrived(client: kvtier.Client) -> None:
    """A load by layer runs under the forward pass. Where it ends short (here
    its 4th key is one kvtierd does not hold, as a block evicted between the
    lookup and the load), the pass has read engine blocks nothing loaded: it
    is thrown away and the prompt prefilled again on the 3 blocks that
    arrived, bit-exact with that computation done here."""
    spec = TinyLlama()
    model = spec.build()
    prompt = tokens(5, 5 * BLOCK_TOKENS + 3, spec.vocab_size)
    cache = DynamicCache(config=model.config)
    forward(model, prompt, cache)
    engine = EngineKv(client, spec.layout(BLOCK_TOKENS), CAPACITY_BLOCKS)
    keys = store_prefix(client, engine, kv_of(cache, len(prompt)), prompt)
    assert len(keys) == 5
    other = client.compute_keys(engine.cache, prompt[: 3 * BLOCK_TOKENS] + tokens(6, 2 * BLOCK_TOKENS, spec.vocab_size))
    assert other[:3] == keys[:3] and client.lookup(engine.cache, other).hits == 3
    engine.zero()

    prefill = _prefill_by_layer(client, engine, model, prompt, other, ["host"] * 5, time.perf_counter())
    assert prefill.loaded_blocks == 3 and "redone" in prefill.seconds, prefill
    reference = cache_from(kv_of(cache, 3 * BLOCK_TOKENS), model.config)
    want = forward(model, prompt[3 * BLOCK_TOKENS :], reference)
    assert torch.equal(bits(prefill.logits), bits(want))
    assert prefill.cache.get_seq_length() == len(prompt)


# fp8 (E4M3, one scale per head_dim values of a token) keeps each element
# within 0.0665·|x| + 2^-10·s of its value (docs/compression.md).
_FP8_RELATIVE = 0.0665


def within_fp8_bound(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Every element of got within fp8's bound of want; groups are the last dim (head_dim)."""
    x, y = want.float(), got.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 448
    return bool(((y - x).abs() <= _FP8_RELATIVE * x.abs() + scale * 2.0**-10).all())


def test_an_fp8_offloaded_prefix_decodes_close_to_the_exact_one() -> None:
    """The prefix's blocks stored with codec fp8, written to disk (where they
    are compressed) and loaded back: the KV is within fp8's bound of what was
    stored, and the logits of decoding on it are compared with decoding on
    the exact KV at the same tokens (max |difference| and top-1 agreement)."""
    with tempfile.TemporaryDirectory(prefix="kvtier-py-") as directory:
        tenant = f"{{name: local, uid: {os.getuid()}, admin: true, codecs: [none, fp8]}}"
        daemon = Daemon(directory, ["tiers.disk.enabled=true", "tiers.disk.bytes=64MiB", "tiers.disk.region_bytes=1MiB",
                                    f"tenants=[{tenant}]"])
        daemon.start()
        try:
            with kvtier.Client.connect(daemon.socket, name="fp8-e2e") as client:
                spec = TinyLlama(dtype="bf16")
                model = spec.build()
                vocab = spec.vocab_size
                shared = tokens(1, SHARED_TOKENS, vocab)
                prompt_a = shared + tokens(2, 22, vocab)
                prompt_b = shared + tokens(3, 13, vocab)
                prefix = SHARED_BLOCKS * BLOCK_TOKENS
                engine = EngineKv(client, spec.layout(BLOCK_TOKENS), CAPACITY_BLOCKS, codec="fp8")
                cache_a = DynamicCache(config=model.config)
                forward(model, prompt_a, cache_a)
                keys = store_prefix(client, engine, kv_of(cache_a, len(prompt_a)), prompt_a)
                for _ in range(500):  # the flush moves host blocks to disk, packed
                    client.flush()
                    if set(client.lookup(engine.cache, keys).tiers) == {"disk"}:
                        break
                    time.sleep(0.01)
                assert set(client.lookup(engine.cache, keys).tiers) == {"disk"}
                engine.zero()
                prefill = prefill_with_kvtier(client, engine, model, prompt_b)
                assert (prefill.loaded_blocks, set(prefill.tiers)) == (SHARED_BLOCKS, {"disk"})
                stats = client.stats()["counters"]
                # Read up coded, and decoded by the load's copy into the engine's pages.
                assert stats["codec_encoded"] == len(keys) and stats["codec_decoded"] == 0

                exact = kv_of(cache_a, prefix)
                loaded = engine.kv(SHARED_BLOCKS)
                for (k, v), (kx, vx) in zip(loaded, exact):
                    assert within_fp8_bound(k, kx) and within_fp8_bound(v, vx)
                assert not same_bytes(loaded, exact), "fp8 is lossy: the KV must have changed"

                fp8_tokens, fp8_logits = decode(model, prefill.cache, prefill.logits, STEPS)
                reference = cache_from(exact, model.config)
                _, ref_logits = decode(model, reference, forward(model, prompt_b[prefix:], reference), STEPS,
                                       forced=fp8_tokens)
                diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(fp8_logits, ref_logits))
                scale = max(float(b.float().abs().max()) for b in ref_logits)
                top1 = sum(int(torch.argmax(a)) == int(torch.argmax(b)) for a, b in zip(fp8_logits, ref_logits))
                print(
                    f"fp8-offloaded prefix: logits max |diff| {diff:.3g} ({diff / scale:.3g} of max|logit|), "
                    f"top-1 agreement {top1}/{len(ref_logits)}"
                )
                # A tenth of the logits' scale: fp8's 6.65% per element, through two
                # layers, stays well within it; a wrong block would not.
                assert diff <= 0.1 * scale
                assert top1 >= len(ref_logits) - 1
        finally:
            daemon.stop()


def test_the_placements_store_blocks_in_kvtiers_canonical_order(client: kvtier.Client) -> None:
    # The engine's blocks are [K/V][heads][tokens][head_dim] per layer (as
    # transformers orders a sequence); kvtier holds a block as, per layer, K
    # then V, each [tokens][heads][head_dim] (common/kv_cache_layout.h). Loading the stored blocks into a
    # canonical (contiguous) cache shows the placements address the right
    # rows, not merely rows that round-trip: another engine's layout gets the
    # same KV.
    spec = TinyLlama()
    model = spec.build()
    layout = spec.layout(BLOCK_TOKENS)
    prompt = tokens(4, 3 * BLOCK_TOKENS + 5, spec.vocab_size)
    cache = DynamicCache(config=model.config)
    forward(model, prompt, cache)
    engine = EngineKv(client, layout, CAPACITY_BLOCKS)
    # The placements taken from the tensors' strides are those of vLLM's HND.
    assert fields(engine.placements()) == fields(kvtier.placements(layout, CAPACITY_BLOCKS, "vllm_hnd"))
    keys = store_prefix(client, engine, kv_of(cache, len(prompt)), prompt)
    assert len(keys) == 3

    canonical = kvtier.CpuKvCache(layout, 4)
    target = client.register_cpu_cache(canonical)
    assert client.load(target, keys, [1, 2, 3]).blocks == 3
    blocks = torch.frombuffer(canonical, dtype=torch.uint8).view(spec.torch_dtype)
    blocks = blocks.view(4, spec.num_layers, 2, BLOCK_TOKENS, spec.num_kv_heads, spec.head_dim)
    for layer, (k, v) in enumerate(kv_of(cache, 3 * BLOCK_TOKENS)):
        for part, t in enumerate((k, v)):
            # [1, heads, 3 * block_tokens, head_dim] -> [3, block_tokens, heads, head_dim]
            want = t[0].view(spec.num_kv_heads, 3, BLOCK_TOKENS, spec.head_dim).permute(1, 2, 0, 3)
            assert torch.equal(bits(blocks[1:4, layer, part]), bits(want)), (layer, part)
    assert not blocks[0].any(), "block 0 was not loaded into"
