"""Disaggregated prefill and decode across two kvtierd nodes sharing a Redis
Cluster (the remote tier, docs/remote-tier.md): the prefill node computes a
prompt with a real model and stores its KV through node A; the decode node,
another process with its own model and its own client of node B, finds the
prompt in the cluster, loads it and decodes, computing only the prompt's
last, partial block. Its logits are bit-exact with the same computation done
without kvtier. The nodes share their tenants' secrets (node A's salts/),
as a fleet's nodes must.

Run it as an example: pytest client/python/tests/test_disaggregated.py -s
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Any, Iterator

import pytest
import torch
from transformers import DynamicCache

import kvtier
from conftest import Daemon
from llama_kv import EngineKv, TinyLlama, cache_from, decode, forward, kv_of, store_prefix
from redis_cluster import RedisCluster
from test_model_e2e import BLOCK_TOKENS, CAPACITY_BLOCKS, CHILD_TIMEOUT_S, STEPS, bits, load_and_decode, same_bytes, tokens
from test_model_e2e import other_process  # noqa: F401 (a fixture)

PROMPT_TOKENS = 100  # 6 full blocks and 4 tokens


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    c = RedisCluster(masters=3, replicas=1)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def nodes(cluster: RedisCluster) -> Iterator[tuple[Daemon, Daemon]]:
    remote = [
        "tiers.remote.enabled=true",
        f"tiers.remote.seeds=[{','.join(cluster.seeds)}]",
        f"tiers.remote.key_prefix=py-disagg-{time.monotonic_ns()}/",
    ]
    with tempfile.TemporaryDirectory(prefix="kvtier-py-a-") as dir_a, tempfile.TemporaryDirectory(
        prefix="kvtier-py-b-"
    ) as dir_b:
        a = Daemon(dir_a, remote)
        a.start()
        shutil.copytree(f"{dir_a}/state/salts", f"{dir_b}/state/salts")
        b = Daemon(dir_b, remote)
        b.start()
        try:
            yield a, b
        finally:
            b.stop()
            a.stop()


def counter(client: kvtier.Client, name: str) -> int:
    return int(client.stats()["counters"].get(name, 0))


def test_prefill_on_one_node_decode_on_another(nodes: tuple[Daemon, Daemon], other_process: Any) -> None:
    a, b = nodes
    spec = TinyLlama(dtype="fp32")
    model = spec.build()
    prompt = tokens(7, PROMPT_TOKENS, spec.vocab_size)
    full_blocks = PROMPT_TOKENS // BLOCK_TOKENS

    # The prefill node: the whole prompt computed, its full blocks stored
    # through node A, which puts them to the cluster.
    with kvtier.Client.connect(a.socket, name="prefill-node") as client:
        engine = EngineKv(client, spec.layout(BLOCK_TOKENS), CAPACITY_BLOCKS)
        cache = DynamicCache(config=model.config)
        forward(model, prompt, cache)
        keys = store_prefix(client, engine, kv_of(cache, PROMPT_TOKENS), prompt)
        assert len(keys) == full_blocks
        deadline = time.monotonic() + 20
        while counter(client, "remote_writes") < full_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert counter(client, "remote_writes") == full_blocks, a.log()

    # The decode node: another process, node B, which has never seen the
    # prompt: every full block comes from the cluster.
    got = other_process.apply_async(
        load_and_decode, (b.socket, spec, prompt, STEPS, torch.get_num_threads())
    ).get(timeout=CHILD_TIMEOUT_S)
    assert (got["hits"], got["loaded_blocks"]) == (full_blocks, full_blocks), b.log()
    assert set(got["tiers"]) == {"remote"}, got["tiers"]
    prefix = full_blocks * BLOCK_TOKENS
    assert same_bytes(got["kv"], kv_of(cache, prefix)), "the KV node B loaded differs from what node A stored"

    # The same computation without kvtier: bit-exact.
    reference = cache_from(kv_of(cache, prefix), model.config)
    ref_tokens, ref_logits = decode(model, reference, forward(model, prompt[prefix:], reference), STEPS)
    assert got["tokens"] == ref_tokens
    for step, (x, y) in enumerate(zip(got["logits"], ref_logits)):
        assert torch.equal(bits(x), bits(y)), f"logits of step {step} differ from the recompute"
    with kvtier.Client.connect(b.socket, name="decode-node-stats") as client:
        assert counter(client, "remote_promotions") == full_blocks
        assert counter(client, "remote_corrupt") == 0
    print(f"decode node: {full_blocks} blocks ({prefix} tokens) from the cluster, {PROMPT_TOKENS - prefix} computed, "
          f"{STEPS} decoded; tokens {got['tokens']}")
