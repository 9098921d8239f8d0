"""Retention hints from Python (docs/policy.md) against a real kvtierd with a
small host tier: what a store or a hint asks to keep is kept while
unhinted blocks of the same age go; a finished session goes first; a
partial tail block is not stored; bad hints are exceptions."""

from __future__ import annotations

import tempfile
from typing import Iterator

import numpy as np
import pytest

import kvtier
from conftest import Daemon, small_layout

HOST_BLOCKS = 128  # 2 MiB of 16 KiB blocks
PROMPT = 16


@pytest.fixture
def small_client() -> Iterator[kvtier.Client]:
    with tempfile.TemporaryDirectory(prefix="kvtier-py-") as directory:
        d = Daemon(directory, ["tiers.host.bytes=2MiB", "policy.watermarks.host={high: 1.0, low: 0.99}"])
        d.start()
        c = kvtier.Client.connect(d.socket, name="pytest-hints", reconnect_interval=0.02)
        try:
            yield c
        finally:
            c.close()
            d.stop()


def keys_of(client: kvtier.Client, cache: kvtier.KvCache, seed: int, blocks: int = PROMPT) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return client.compute_keys(cache, [int(t) for t in rng.integers(0, 128000, blocks * 16)])


def test_hinted_blocks_are_kept_and_a_finished_session_goes_first(small_client: kvtier.Client) -> None:
    c = small_client
    cache = c.register_cpu_cache(kvtier.CpuKvCache(small_layout(), PROMPT))
    ids = list(range(PROMPT))
    next_turn, important, plain, over = (keys_of(c, cache, s) for s in (1, 2, 3, 4))
    assert c.store(cache, next_turn, ids, next_use_ms=600_000).blocks == PROMPT
    assert c.store(cache, important, ids, priority=1).blocks == PROMPT
    assert c.store(cache, plain, ids).blocks == PROMPT
    assert c.store_async(cache, over, ids).wait().blocks == PROMPT
    assert c.hint(cache, over, session_over=True) == {"hinted": PROMPT, "refused": 0}
    # One prompt past the tier: the finished session goes, not the older plain one.
    for s in range(100, 100 + (HOST_BLOCKS - 4 * PROMPT) // PROMPT + 1):
        assert c.store(cache, keys_of(c, cache, s), ids).blocks == PROMPT
    assert c.lookup(cache, over).hits == 0
    assert c.lookup(cache, plain).hits == PROMPT
    # Then twice the tier: only what was hinted to be kept stays.
    for s in range(200, 200 + 2 * HOST_BLOCKS // PROMPT):
        assert c.store(cache, keys_of(c, cache, s), ids).blocks == PROMPT
    assert c.lookup(cache, plain).hits == 0
    assert c.lookup(cache, important).hits == PROMPT
    assert c.lookup(cache, next_turn).hits == PROMPT
    counters = c.stats()["counters"]
    assert counters["hinted"] == 3 * PROMPT and counters["hints_refused"] == 0


def test_a_partial_tail_is_not_stored_and_bad_hints_are_exceptions(small_client: kvtier.Client) -> None:
    c = small_client
    cache = c.register_cpu_cache(kvtier.CpuKvCache(small_layout(), 4))
    keys = keys_of(c, cache, 7, 3)
    assert c.store(cache, keys, [0, 1, 2], last_partial=True).blocks == 2
    assert c.lookup(cache, keys).hits == 2
    assert c.stats()["counters"]["partial_not_admitted"] == 1
    with pytest.raises(kvtier.InvalidArgumentError, match="priority 3"):
        c.store(cache, keys, [0, 1, 2], priority=3)
    with pytest.raises(kvtier.InvalidArgumentError, match="next_use_ms"):
        c.hint(cache, keys, next_use_ms=4_000_000)
    with pytest.raises(kvtier.InvalidArgumentError, match="priority -2"):
        c.hint(cache, keys, priority=-2)
