"""kvtier.sglang.KvtierStore, SGLang's HiCache storage backend, against a real
kvtierd and SGLang's own classes: HiCacheStorage, HiCacheStorageConfig,
StorageBackendFactory (the "dynamic" backend path), HiCacheStorageExtraInfo,
PoolName and the host-pool allocator alloc_mmap.

SGLang's host pool class (MHATokenToKVPoolHost) cannot be built here: its
module imports torchvision, which this CPU environment lacks, and it needs a
device KV pool. HostPool below carries the attributes a storage backend reads,
with kv_buffer shaped as MHATokenToKVPoolHost.init_kv_buffer shapes it
(pool_host/mha.py) and allocated by SGLang's own allocator, in its default
shared mode (the backend bounces pages) or its private one (the daemon copies
in place).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import signal
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import pytest
import torch

from conftest import Daemon

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed")
from sglang.srt.environ import envs  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
)
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.storage.mmap.mmap_allocator import alloc_mmap  # noqa: E402

import kvtier  # noqa: E402
from kvtier.sglang import KvtierStore  # noqa: E402

# 16 KiB pages: 16 tokens x 2 layers x (K, V) x 2 heads x 64 dims x bf16.
TOKENS, LAYERS, HEADS, DIM = 16, 2, 2, 64
PAGE_BYTES = 2 * TOKENS * LAYERS * HEADS * DIM * 2
DYNAMIC = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore"}
EXTRA = {**DYNAMIC, "interface_v1": 1}

Allocator = Callable[[tuple[int, ...]], torch.Tensor]


def private(dims: tuple[int, ...]) -> torch.Tensor:
    """SGLang's allocator in its private mode: a page-aligned anonymous private
    mapping of its own, which kvtier shares in place. (Small torch.zeros
    tensors can share a heap page, which kvtier will not adopt twice.)"""
    with envs.SGLANG_HICACHE_HOST_PARALLEL_ALLOC_THREADS.override(1):
        return alloc_mmap(dims, torch.bfloat16)


def sglang_mmap(dims: tuple[int, ...]) -> torch.Tensor:
    """SGLang's allocator by default: shared anonymous memory, which kvtier
    cannot share in place."""
    return alloc_mmap(dims, torch.bfloat16)


@dataclass
class HostPool:
    """What a storage backend reads of SGLang's MHATokenToKVPoolHost."""

    kv_buffer: torch.Tensor
    layout: str
    page_size: int = TOKENS
    layer_num: int = LAYERS
    head_num: int = HEADS
    head_dim: int = DIM
    v_head_dim: int = DIM
    dtype: torch.dtype = torch.bfloat16
    pin_memory: bool = False


def host_pool(layout: str, pages: int, allocate: Allocator = private) -> HostPool:
    dims = {
        "page_first": (2, pages * TOKENS, LAYERS, HEADS, DIM),
        "layer_first": (2, LAYERS, pages * TOKENS, HEADS, DIM),
        "page_first_direct": (2, pages, LAYERS, TOKENS, HEADS, DIM),
        "page_head": (2, pages, HEADS, TOKENS, LAYERS, DIM),
    }[layout]
    return HostPool(allocate(dims), layout)


# An MLA latent: kv_lora_rank 64 + qk_rope_head_dim 16 (DeepSeek's: 512 + 64).
LORA, ROPE = 64, 16


@dataclass
class MLAHostPool:
    """What a storage backend reads of SGLang's MLATokenToKVPoolHost."""

    kv_buffer: torch.Tensor
    layout: str
    page_size: int = TOKENS
    layer_num: int = LAYERS
    kv_lora_rank: int = LORA
    qk_rope_head_dim: int = ROPE
    dtype: torch.dtype = torch.bfloat16
    pin_memory: bool = False


def mla_host_pool(layout: str, pages: int, allocate: Allocator = private) -> MLAHostPool:
    """kv_buffer shaped as MLATokenToKVPoolHost.init_kv_buffer shapes it
    (pool_host/mla.py)."""
    d = LORA + ROPE
    dims = {
        "page_first": (pages * TOKENS, LAYERS, 1, d),
        "layer_first": (LAYERS, pages * TOKENS, 1, d),
        "page_first_direct": (pages, LAYERS, TOKENS, 1, d),
    }[layout]
    return MLAHostPool(allocate(dims), layout)


def mla_page(pool: MLAHostPool, page: int) -> torch.Tensor:
    """Page `page` of the MLA pool as [layer, token, latent]."""
    kv, t = pool.kv_buffer, TOKENS
    if pool.layout == "page_first":
        return kv[page * t : (page + 1) * t, :, 0].transpose(0, 1)
    if pool.layout == "layer_first":
        return kv[:, page * t : (page + 1) * t, 0]
    return kv[page, :, :, 0]


def page_kv(pool: HostPool, page: int) -> torch.Tensor:
    """Page `page` of the pool as [K/V, layer, token, head, dim]."""
    kv, t = pool.kv_buffer, TOKENS
    if pool.layout == "page_first":
        return kv[:, page * t : (page + 1) * t].permute(0, 2, 1, 3, 4)
    if pool.layout == "layer_first":
        return kv[:, :, page * t : (page + 1) * t]
    return kv[:, page]


def fill(pool: HostPool, pages: list[int], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in pages:
        page_kv(pool, p).copy_(torch.randn((2, LAYERS, TOKENS, HEADS, DIM), generator=generator))


def slots(pages: list[int]) -> torch.Tensor:
    """SGLang's host_indices for whole pages: page_size token slots each."""
    if not pages:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([torch.arange(p * TOKENS, (p + 1) * TOKENS) for p in pages])


def page_keys(seed: str, n: int) -> list[str]:
    """Keys as SGLang makes them: hex SHA-256 page hashes."""
    return [hashlib.sha256(f"{seed}/{i}".encode()).hexdigest() for i in range(n)]


def storage_config(socket: str, **extra: object) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="kvtier/sglang-tests",
        extra_config={**EXTRA, "kvtier_socket": socket, **extra},
    )


@pytest.fixture
def make_store(daemon: Daemon) -> Iterator[Callable[..., KvtierStore]]:
    """Builds stores as SGLang's cache controller does: the factory's dynamic
    path, then register_mem_pool_host. Closes them at the end."""
    # Memory another test adopted stays refused while its KvCache lives (a
    # reference cycle may keep it until a collection), and a new pool at the
    # same address would then bounce instead of being shared in place.
    gc.collect()
    stores: list[KvtierStore] = []

    def make(pool: HostPool | MLAHostPool, tp: tuple[int, int] = (0, 1), **extra: object) -> KvtierStore:
        config = storage_config(daemon.socket, **extra)
        config.tp_rank, config.tp_size = tp
        config.is_mla_model = isinstance(pool, MLAHostPool)
        store = StorageBackendFactory.create_backend("dynamic", config, pool)
        assert type(store) is KvtierStore
        stores.append(store)
        store.register_mem_pool_host(pool)
        return store

    yield make
    for store in stores:
        store.close()


def test_sglangs_factory_builds_the_backend(daemon: Daemon, make_store: Callable[..., KvtierStore]) -> None:
    assert issubclass(KvtierStore, HiCacheStorage)
    store = StorageBackendFactory.create_backend("dynamic", storage_config(daemon.socket), None)
    assert isinstance(store, KvtierStore) and store.mode is None
    assert store.model_id() == "kvtier/sglang-tests"
    store.close()
    sharded = storage_config(daemon.socket, kvtier_model_id="llama")
    sharded.pp_rank, sharded.pp_size = 1, 2
    assert KvtierStore(sharded).model_id() == "llama/pp1-of-2"
    assert make_store(host_pool("page_first", 4)).mode == "in_place"
    assert make_store(host_pool("page_first", 4, sglang_mmap)).mode == "bounce"
    pinned = host_pool("page_first", 4)
    pinned.pin_memory = True  # never moved under cudaHostRegister's pins
    assert make_store(pinned).mode == "bounce"


def test_pages_round_trip_byte_exact_across_layouts_and_modes(make_store: Callable[..., KvtierStore]) -> None:
    source = host_pool("page_first", 8)
    writer = make_store(source)
    assert writer.mode == "in_place"
    fill(source, list(range(8)), seed=1)
    keys = page_keys("round-trip", 5)
    source_pages = [3, 0, 6, 1, 7]
    assert writer.batch_set_v1(keys, slots(source_pages)) == [True] * 5
    assert writer.batch_set_v1(keys, slots(source_pages)) == [True] * 5  # already stored

    # Into pools of every layout, through the daemon's in-place copies and
    # the bounce buffer (two pages at a time), at other pages.
    cases = [
        ("page_first", sglang_mmap, "bounce"),
        ("layer_first", private, "in_place"),
        ("page_first_direct", private, "in_place"),
        ("layer_first", sglang_mmap, "bounce"),
    ]
    for layout, allocate, mode in cases:
        target = host_pool(layout, 8, allocate)
        reader = make_store(target, kvtier_bounce_bytes=2 * PAGE_BYTES)
        assert reader.mode == mode, layout
        target_pages = [5, 2, 7, 0, 4]
        assert reader.batch_get_v1(keys, slots(target_pages)) == [True] * 5
        for p, q in zip(source_pages, target_pages):
            assert torch.equal(page_kv(target, q), page_kv(source, p)), (layout, p, q)
        for q in {1, 3, 6}:
            assert not page_kv(target, q).any(), f"{layout}: page {q} was not loaded into but changed"

    # Back: stored through a bounce buffer, loaded in place.
    bounced = host_pool("page_first_direct", 8, sglang_mmap)
    bouncer = make_store(bounced, kvtier_bounce_bytes=2 * PAGE_BYTES)
    fill(bounced, [1, 3, 6], seed=2)
    more = page_keys("bounced", 3)
    parent = HiCacheStorageExtraInfo(prefix_keys=keys)
    assert bouncer.batch_set_v1(more, slots([1, 3, 6]), parent) == [True] * 3
    assert writer.batch_get_v1(more, slots([2, 4, 5])) == [True] * 3
    for p, q in zip([1, 3, 6], [2, 4, 5]):
        assert torch.equal(page_kv(source, q), page_kv(bounced, p))


@pytest.mark.parametrize("allocate", [private, sglang_mmap], ids=["in_place", "bounce"])
def test_leading_hits_and_misses(make_store: Callable[..., KvtierStore], allocate: Allocator) -> None:
    pool = host_pool("page_first", 8, allocate)
    store = make_store(pool)
    fill(pool, [0, 1, 2, 3], seed=3)
    k0, k1, k2, odd = page_keys("hits", 3) + ["not a hex page hash"]  # the last is hashed to 32 bytes
    unknown = page_keys("never stored", 1)[0]
    assert store.batch_set_v1([k0, k1, k2, odd], slots([0, 1, 2, 3])) == [True] * 4

    assert store.batch_exists([k0, k1, k2, odd]) == 4
    assert store.batch_exists([k0, k1, unknown, k2]) == 2
    assert store.batch_exists([unknown, k0]) == 0
    assert store.batch_exists([]) == 0
    assert store.exists(k1) and not store.exists(unknown)

    # A load stops at the first miss; the pages after it stay as they were.
    fill(pool, [5, 6, 7], seed=4)
    before = [page_kv(pool, p).clone() for p in (6, 7)]
    assert store.batch_get_v1([odd, unknown, k1], slots([5, 6, 7])) == [True, False, False]
    assert torch.equal(page_kv(pool, 5), page_kv(pool, 3))
    assert torch.equal(page_kv(pool, 6), before[0]) and torch.equal(page_kv(pool, 7), before[1])
    assert store.batch_get_v1([unknown], slots([4])) == [False]
    assert store.batch_get_v1([], slots([])) == []
    # Given a prefill rate, host hits (a memcpy away) are still hits.
    rated = make_store(pool, kvtier_prefill_tokens_per_s=1000.0)
    rated.batch_get_v1([k0, k1], slots([5, 6]))  # timed: host loads
    assert rated.batch_exists([k0, k1, k2, odd]) == 4


def test_unsupported_paths_raise_not_implemented(
    daemon: Daemon, make_store: Callable[..., KvtierStore]
) -> None:
    pool = host_pool("page_first", 4)
    store = make_store(pool)
    keys = page_keys("unsupported", 1)
    for call in (
        lambda: store.get(keys[0]),
        lambda: store.batch_get(keys, [torch.zeros(4)]),
        lambda: store.set(keys[0], torch.zeros(4)),
        lambda: store.batch_set(keys, [torch.zeros(4)]),
    ):
        with pytest.raises(NotImplementedError, match="interface_v1"):
            call()
    for call in (
        lambda: store.batch_exists_v2(keys),
        lambda: store.batch_get_v2([]),
        lambda: store.batch_set_v2([]),
    ):
        with pytest.raises(NotImplementedError, match="MHA"):
            call()

    # The pools of hybrid models fail the attach, not every later call.
    store.register_mem_host_pool_v2(pool, PoolName.KV)
    store.on_host_pools_registered()
    store.register_mem_host_pool_v2(pool, PoolName.MAMBA)
    with pytest.raises(NotImplementedError, match="mamba"):
        store.on_host_pools_registered()

    with pytest.raises(NotImplementedError, match="page_head"):
        make_store(host_pool("page_head", 4))
    narrow_v = host_pool("page_first", 4)
    narrow_v.v_head_dim = 32
    with pytest.raises(NotImplementedError, match="V heads"):
        make_store(narrow_v)
    with pytest.raises(NotImplementedError, match="no single kv_buffer"):
        KvtierStore(storage_config(daemon.socket)).register_mem_pool_host(object())


def test_bad_input_is_a_clear_exception(daemon: Daemon, make_store: Callable[..., KvtierStore]) -> None:
    without_v1 = storage_config(daemon.socket)
    without_v1.extra_config = DYNAMIC
    with pytest.raises(ValueError, match="interface_v1"):
        StorageBackendFactory.create_backend("dynamic", without_v1, None)
    with pytest.raises(ValueError, match="kvtier_bounce_bytes"):
        KvtierStore(storage_config(daemon.socket, kvtier_bounce_bytes=0))
    with pytest.raises(ValueError, match="kvtier_timeout_s"):
        KvtierStore(storage_config(daemon.socket, kvtier_timeout_s=0))
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="kvtier_prefill_tokens_per_s"):
            KvtierStore(storage_config(daemon.socket, kvtier_prefill_tokens_per_s=bad))
    with pytest.raises(RuntimeError, match="register_mem_pool_host"):
        KvtierStore(storage_config(daemon.socket)).batch_exists(page_keys("early", 1))
    wrong_shape = host_pool("page_first", 4)
    wrong_shape.layer_num = LAYERS + 1
    with pytest.raises(ValueError, match="shape"):
        make_store(wrong_shape)

    store = make_store(host_pool("page_first", 4))
    keys = page_keys("bad", 2)
    with pytest.raises(ValueError, match="16 slots; 2 keys need 32"):
        store.batch_set_v1(keys, slots([0]))
    with pytest.raises(ValueError, match="32 slots; 1 keys need 16"):
        store.batch_get_v1(keys[:1], slots([0, 1]))
    with pytest.raises(ValueError, match="whole pages"):
        store.batch_set_v1(keys[:1], slots([0]) + 3)
    with pytest.raises(ValueError, match="whole pages"):
        store.batch_get_v1(keys, slots([0, 1]).flip(0))
    with pytest.raises(ValueError, match="outside"):
        store.batch_get_v1(keys[:1], slots([4]))
    with pytest.raises(ValueError, match="twice"):
        store.batch_get_v1(keys, slots([1, 1]))
    with pytest.raises(TypeError, match="str"):
        store.batch_exists([42])  # type: ignore[list-item]


def test_a_stopped_daemon_means_misses_then_a_restart_works(
    daemon: Daemon, make_store: Callable[..., KvtierStore], caplog: pytest.LogCaptureFixture
) -> None:
    pools = [host_pool("page_first", 4), host_pool("page_first", 4, sglang_mmap)]
    stores = [make_store(pool) for pool in pools]
    assert [s.mode for s in stores] == ["in_place", "bounce"]
    keys = page_keys("restart", 2)
    for pool, store in zip(pools, stores):
        fill(pool, [0, 1], seed=5)
        assert store.batch_set_v1(keys, slots([0, 1])) == [True, True]

    daemon.stop(signal.SIGKILL)
    caplog.set_level(logging.WARNING, logger="kvtier.sglang")
    for _ in range(3):
        for store in stores:
            assert store.batch_exists(keys) == 0
            assert not store.exists(keys[0])
            assert store.batch_get_v1(keys, slots([2, 3])) == [False, False]
            assert store.batch_set_v1(keys, slots([0, 1])) == [False, False]
    unavailable = [r for r in caplog.records if r.name == "kvtier.sglang" and "unavailable" in r.getMessage()]
    assert len(unavailable) == len(stores), "each store logs the outage once"

    daemon.start()
    for pool, store in zip(pools, stores):
        deadline = time.monotonic() + 10
        while store.batch_set_v1(keys, slots([0, 1])) != [True, True]:  # the client reconnects by itself
            assert time.monotonic() < deadline, "no store after the restart"
            time.sleep(0.05)
        assert store.batch_exists(keys) == 2
        assert store.batch_get_v1(keys, slots([2, 3])) == [True, True]
        assert torch.equal(page_kv(pool, 2), page_kv(pool, 0))
        assert torch.equal(page_kv(pool, 3), page_kv(pool, 1))


def test_a_hung_daemon_costs_one_timeout_then_misses_and_never_writes_late(
    daemon: Daemon, make_store: Callable[..., KvtierStore]
) -> None:
    pool = host_pool("page_first", 4)
    store = make_store(pool, kvtier_timeout_s=0.5)
    assert store.mode == "in_place"
    keys = page_keys("hung", 2)
    fill(pool, [0, 1], seed=7)
    assert store.batch_set_v1(keys, slots([0, 1])) == [True, True]
    fill(pool, [2, 3], seed=8)  # the engine's own: a load given up on never lands here
    mine = [page_kv(pool, 2).clone(), page_kv(pool, 3).clone()]
    assert daemon.process is not None
    watch = kvtier.Client.connect(daemon.socket, name="watch")
    cancelled = watch.stats()["counters"]["ops_cancelled"]
    daemon.process.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert store.batch_get_v1(keys, slots([2, 3])) == [False, False]
        waited = time.monotonic() - started
        assert 0.5 <= waited < 2.0, waited  # the call's timeout, and its cancel
        # Left alone meanwhile: misses at once, no call waits again.
        started = time.monotonic()
        assert store.batch_exists(keys) == 0
        assert store.batch_set_v1(keys, slots([0, 1])) == [False, False]
        assert time.monotonic() - started < 0.1
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    # The daemon reads the load once it continues, and copies nothing.
    deadline = time.monotonic() + 10
    while watch.stats()["counters"]["ops_cancelled"] == cancelled:
        assert time.monotonic() < deadline, "the load given up on was never cancelled"
        time.sleep(0.05)
    assert torch.equal(page_kv(pool, 2), mine[0]) and torch.equal(page_kv(pool, 3), mine[1])
    # After the pause (1 s) it is answered again.
    deadline = time.monotonic() + 10
    while store.batch_get_v1(keys, slots([2, 3])) != [True, True]:
        assert time.monotonic() < deadline, "no load after the daemon continued"
        time.sleep(0.1)
    assert torch.equal(page_kv(pool, 2), page_kv(pool, 0)) and torch.equal(page_kv(pool, 3), page_kv(pool, 1))


def test_a_daemon_down_at_start_is_a_miss_until_it_answers(
    daemon: Daemon, make_store: Callable[..., KvtierStore]
) -> None:
    daemon.stop()
    pool = host_pool("page_first", 4)
    store = make_store(pool)  # neither the constructor nor the registration raises
    assert store.mode == "bounce"  # memory cannot be shared in place once the pool is in use
    keys = page_keys("late daemon", 2)
    fill(pool, [0, 1], seed=6)
    assert store.batch_exists(keys) == 0
    assert store.batch_set_v1(keys, slots([0, 1])) == [False, False]

    daemon.start()
    deadline = time.monotonic() + 10
    while store.batch_set_v1(keys, slots([0, 1])) != [True, True]:
        assert time.monotonic() < deadline, "the store never connected"
        time.sleep(0.05)
    assert store.batch_get_v1(keys, slots([2, 3])) == [True, True]
    assert torch.equal(page_kv(pool, 2), page_kv(pool, 0))


def test_an_mla_pool_is_one_namespace_at_any_tp_rank_across_layouts_and_modes(
    make_store: Callable[..., KvtierStore],
) -> None:
    """SGLang's MLA host pool (one latent per token, the same on every TP
    rank): TP rank 0 of 2 stores pages (SGLang has its first rank alone
    write), and rank 1, in pools of every layout, in place and through the
    bounce buffer, loads them byte-exact."""
    source = mla_host_pool("page_first", 8)
    writer = make_store(source, tp=(0, 2))
    assert writer.mode == "in_place"
    generator = torch.Generator().manual_seed(3)
    for p in range(8):
        mla_page(source, p).copy_(torch.randn((LAYERS, TOKENS, LORA + ROPE), generator=generator))
    keys = page_keys("mla", 4)
    source_pages = [6, 1, 4, 2]
    assert writer.batch_set_v1(keys, slots(source_pages)) == [True] * 4
    page_bytes = TOKENS * LAYERS * (LORA + ROPE) * 2
    cases = [
        ("page_first", sglang_mmap, "bounce"),
        ("layer_first", private, "in_place"),
        ("page_first_direct", private, "in_place"),
        ("page_first_direct", sglang_mmap, "bounce"),
    ]
    for layout, allocate, mode in cases:
        target = mla_host_pool(layout, 8, allocate)
        reader = make_store(target, tp=(1, 2), kvtier_bounce_bytes=2 * page_bytes)
        assert reader.mode == mode, layout
        assert reader.batch_exists(keys) == 4, layout
        target_pages = [0, 7, 3, 5]
        assert reader.batch_get_v1(keys, slots(target_pages)) == [True] * 4, layout
        for p, q in zip(source_pages, target_pages):
            assert torch.equal(mla_page(target, q), mla_page(source, p)), (layout, p, q)
        for q in {1, 2, 4, 6}:
            assert not mla_page(target, q).any(), f"{layout}: page {q} was not loaded into but changed"
    # An MHA pool of the same model at TP rank 1 is a namespace of its own.
    assert make_store(host_pool("page_first", 4), tp=(1, 2)).batch_exists(keys) == 0
