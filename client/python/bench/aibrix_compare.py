#!/usr/bin/env python3
"""kvtier next to AIBrix's KV cache at the storage level: the same KV chunks,
stored from an engine's CPU KV buffer and retrieved back into it, through
aibrix-kvcache 0.8.0 (the offloading framework of the AIBrix serving stack)
and through kvtierd, in one run.

The engine, the chunks, the kvtier rows, the baselines and the method are
lmcache_compare.py's, imported from it: a KV buffer of Llama-8B's shape
(128 KiB a token) cut into chunks of --chunk-tokens (16: 2 MiB); each
repetition stores --chunks new chunks, retrieves them into the buffer again
and checks the bytes; memory tiers hold --tier-reps repetitions and are full
and evicting once the warm-ups are over; medians of --reps.

AIBrix is driven as its vLLM connector drives it (the connector itself needs
CUDA): for each of AIBrix's chunks (cache_chunk_keys, 512 tokens),
allocate_for, a copy of each block into the handle's tensors, put; to
retrieve, acquire, a copy out of the handle's tensors, release. Its blocks
are the engine's chunks (LCND: [layers, 2, 16 tokens, heads, head_dim]). The
copies are torch copies on --threads threads (default 2), as many as
kvtierd's copy threads. Those are OpenMP's, which wait for each other after
every block: while other processes take the cores they fall apart (0.26 GB/s
here with a build beside, 13 GB/s quiet; OMP_WAIT_POLICY=PASSIVE held 7
under that load but cost a third when quiet), so the in-process row needs a
quiet machine.

  kvtier host tier         kvtierd's host tier (lmcache_compare.kvtier_host);
  AIBrix in-process CPU    its L1 cache, in the engine's process, alone: LRU,
                           memory not pinned (see below);
  kvtier host+disk, disk   kvtierd with a disk tier, stored until durable on
                           disk: records written with O_DIRECT, fdatasynced
                           and indexed before the store counts; host emptied
                           (untimed), then loaded from disk with O_DIRECT;
  AIBrix disk, file/block  its SHFS backend alone (L2, no L1): one file per
                           block, one block at a time, written (buffered) to
                           a temporary file and renamed, puts synchronous;
                           an fsync of each file added after its rename, as
                           it has none, so that a stored block's data are on
                           disk when the store counts (its directory entries
                           are not synced);
  AIBrix disk, RocksDB     its RocksDB backend alone (rocksdict, a value per
                           block, 32 at a time on its 8 I/O threads; its
                           default options): its WAL is written but not
                           synced, so the bench adds one WAL sync
                           (flush_wal(sync=True)) after each repetition's
                           puts, the cheapest way to make them durable.

Between store and retrieve (untimed), AIBrix's files leave the page cache
(POSIX_FADV_DONTNEED on each, once RocksDB has flushed its memtables and
finished compacting), so that its retrieves read the disk, as kvtierd's do.
Disk tiers hold every repetition. AIBrix's memory (one 1 GiB slab) is
touched once before timing, as kvtierd prefaults its host tier.

What it took to run AIBrix here: its configuration is AIBRIX_KV_CACHE_OL_*
environment variables, set before each cache manager is made;
aibrix_kvcache.cache_manager.TESTING_DISABLE_PIN_MEMORY = True, as it pins
its CPU memory by default, which needs CUDA; and LRU, as with its default
S3FIFO a cache holding 2.5 repetitions lost a repetition's first chunk
before it was read back. No patch to AIBrix; the fsync and the WAL sync
above are the bench's, for durability equal to kvtier's.

Needs a venv with AIBrix (tools/setup-python.sh
client/python/bench/requirements-aibrix.txt build/venv-aibrix) and the
kvtier package (PYTHONPATH=build/debug/python, or its wheel installed).

  PYTHONPATH=build/debug/python build/venv-aibrix/bin/python \\
    client/python/bench/aibrix_compare.py --kvtierd build/release/bin/kvtierd
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any, Callable

import torch

from lmcache_compare import (
    DTYPE,
    HEAD_DIM,
    HEADS,
    LAYERS,
    add_arguments,
    chunk_bytes,
    direct_io_seconds,
    fill,
    kvtier_host,
    memcpy_seconds,
    prepare,
    print_ratios,
    print_table,
    tier_bytes,
    timed_reps,
)


def aibrix_cache(args: argparse.Namespace, backend: str = "", directory: str = "") -> Any:
    """A new BaseKVCacheManager for the engine's chunks: with no `backend`,
    its L1 (CPU) cache alone, of tier_bytes, LRU; with `backend` ("SHFS" or
    "ROCKSDB"), that L2 backend alone, in `directory`, puts synchronous. Its
    memory is not pinned, and is touched before it returns. The caller
    closes it."""
    from aibrix_kvcache import (
        BaseKVCacheManager,
        KVCacheBlockLayout,
        KVCacheBlockSpec,
        KVCacheConfig,
        KVCacheTensorSpec,
        ModelSpec,
        cache_manager,
    )

    os.environ.update({
        "AIBRIX_KV_CACHE_OL_L1_CACHE_ENABLED": "0" if backend else "1",
        "AIBRIX_KV_CACHE_OL_L1_CACHE_EVICTION_POLICY": "LRU",
        "AIBRIX_KV_CACHE_OL_L1_CACHE_CAPACITY_GB": str(tier_bytes(args) / 2**30),
        "AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND": backend,
        "AIBRIX_KV_CACHE_OL_L2_CACHE_INGESTION_MAX_INFLIGHT_TOKENS": "0",  # put returns once written
        "AIBRIX_KV_CACHE_OL_SHFS_ROOT": directory,
        "AIBRIX_KV_CACHE_OL_ROCKSDB_ROOT": directory,
        # Its own timing metrics off, as kvtierd's are (metrics.enabled=false).
        "AIBRIX_KV_CACHE_OL_TIME_MEASUREMENT_ENABLED": "0",
        "AIBRIX_KV_CACHE_OL_BREAKDOWN_MEASUREMENT_ENABLED": "0",
    })
    cache_manager.TESTING_DISABLE_PIN_MEMORY = True
    spec = KVCacheBlockSpec(
        block_ntokens=args.chunk_tokens,
        block_dtype=DTYPE,
        block_layout=KVCacheBlockLayout.LCND,
        tensor_spec=KVCacheTensorSpec(heads=list(range(HEADS)), layers=list(range(LAYERS)), head_size=HEAD_DIM),
    )
    tokens = args.chunk_tokens * args.chunks
    cache = BaseKVCacheManager(KVCacheConfig(block_spec=spec, model_spec=ModelSpec(max_model_len=tokens)))
    # Touched once, untimed, as kvtierd prefaults its host tier at start: its
    # allocator hands out the whole of its 1 GiB slab before reusing memory,
    # so timed stores would otherwise meet pages never touched (page faults,
    # about 2.4 GB/s here) well past the warm-ups.
    for slab in cache._allocator.slabs:
        slab.zero_()
    return cache


def aibrix_reps(args: argparse.Namespace, buffer: torch.Tensor, token_sets: list[list[int]], cache: Any,
                after_store: Callable[[], None] = lambda: None,
                between: Callable[[list[int]], None] = lambda tokens: None) -> tuple[list[float], list[float]]:
    """Seconds to store (and `after_store`), and to retrieve, each
    repetition's chunks through `cache`, which this closes."""
    from aibrix_kvcache import TokenListView

    block = args.chunk_tokens

    def tokens_of(prefix: Any, i: int) -> slice:
        start = len(prefix) + i * block
        return slice(start, start + block)

    def store(tokens: list[int]) -> None:
        for prefix, chunk, _, _ in cache.cache_chunk_keys(None, TokenListView(tokens)):
            allocated = cache.allocate_for(prefix, chunk)
            allocated.raise_if_not_ok()
            handle = allocated.get()
            if len(handle) * block != len(chunk):
                raise RuntimeError(f"AIBrix allocated {len(handle)} blocks for {len(chunk)} tokens")
            for i, tensor in enumerate(handle.to_tensors()):
                tensor.copy_(buffer[:, :, tokens_of(prefix, i)])
            put = cache.put(prefix, chunk, handle)
            if not put.is_ok() or put.get() != len(chunk):
                raise RuntimeError(f"AIBrix stored {put.get(0)} of {len(chunk)} tokens: {put}")
        after_store()

    def retrieve(tokens: list[int]) -> None:
        for prefix, chunk, _, _ in cache.cache_chunk_keys(None, TokenListView(tokens)):
            acquired = cache.acquire(prefix, chunk)
            if not acquired.is_ok() or acquired.get()[0] != len(chunk):
                raise RuntimeError(f"AIBrix found {acquired.get((0, None))[0]} of {len(chunk)} tokens: {acquired}")
            handle = acquired.get()[1]
            for i, tensor in enumerate(handle.to_tensors()):
                buffer[:, :, tokens_of(prefix, i)].copy_(tensor)
            handle.release()

    try:
        return timed_reps(args, buffer, token_sets, store, retrieve, between)
    finally:
        cache.close()


def aibrix_cpu(args: argparse.Namespace, buffer: torch.Tensor, token_sets: list[list[int]]) -> tuple[list[float], list[float]]:
    """Seconds to store, and to retrieve, each repetition's chunks with
    AIBrix's L1 (CPU) cache alone."""
    return aibrix_reps(args, buffer, token_sets, aibrix_cache(args))


def aibrix_files(args: argparse.Namespace, buffer: torch.Tensor, token_sets: list[list[int]],
                 directory: str) -> tuple[list[float], list[float]]:
    """Seconds to store each repetition's chunks until their files are
    fsynced, and to retrieve them from disk, with AIBrix's SHFS backend (one
    file per block) alone."""
    from aibrix_kvcache.l2.connectors.shfs import SHFSConnector

    plain_put = SHFSConnector._put

    def durable_put(self: SHFSConnector, key: bytes, mr: Any) -> Any:
        status = plain_put(self, key, mr)
        if status.is_ok():
            fd = os.open(self._key_to_filepath(key), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return status

    SHFSConnector._put = durable_put
    try:
        return aibrix_reps(args, buffer, token_sets, aibrix_cache(args, "SHFS", directory),
                           between=lambda tokens: drop_page_cache(directory))
    finally:
        SHFSConnector._put = plain_put


def aibrix_rocksdb(args: argparse.Namespace, buffer: torch.Tensor, token_sets: list[list[int]],
                   directory: str) -> tuple[list[float], list[float]]:
    """Seconds to store each repetition's chunks until its WAL is synced,
    and to retrieve them from disk, with AIBrix's RocksDB backend alone."""
    cache = aibrix_cache(args, "ROCKSDB", directory)
    db = cache._l2_cache._backend.store  # its rocksdict.Rdict

    def from_disk(tokens: list[int]) -> None:
        # Memtables to files, and no compaction reading them back into the
        # page cache, before the page cache lets them go.
        db.flush(wait=True)
        busy = ("rocksdb.num-running-compactions", "rocksdb.compaction-pending")
        while any(db.property_int_value(name) for name in busy):
            time.sleep(0.01)
        drop_page_cache(directory)

    return aibrix_reps(args, buffer, token_sets, cache, after_store=lambda: db.flush_wal(sync=True), between=from_disk)


def drop_page_cache(directory: str) -> None:
    """Drops every file under `directory` from the page cache, so that the
    next reads go to the disk: each written back first (the kernel keeps
    dirty pages; RocksDB may be compacting), then POSIX_FADV_DONTNEED."""
    for parent, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args()
    import aibrix_kvcache

    buffer, token_sets, size = prepare(parser, args, f"aibrix-kvcache {aibrix_kvcache.__version__}")
    results = {}
    # kvtier first, then AIBrix (whose cache manager lives in this process).
    results["kvtier host tier"] = kvtier_host(args, buffer, token_sets)
    fill(buffer, 0)
    results["AIBrix in-process CPU"] = aibrix_cpu(args, buffer, token_sets)
    if not args.no_disk:
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-disk-", dir=args.disk_dir) as directory:
            fill(buffer, 0)
            results["kvtier host+disk, disk"] = kvtier_host(args, buffer, token_sets, disk_dir=directory)
        with tempfile.TemporaryDirectory(prefix="aibrix-bench-files-", dir=args.disk_dir) as directory:
            fill(buffer, 0)
            results["AIBrix disk, file/block"] = aibrix_files(args, buffer, token_sets, directory)
        with tempfile.TemporaryDirectory(prefix="aibrix-bench-rocksdb-", dir=args.disk_dir) as directory:
            fill(buffer, 0)
            results["AIBrix disk, RocksDB"] = aibrix_rocksdb(args, buffer, token_sets, directory)
            results["O_DIRECT file, 2 MiB I/O"] = direct_io_seconds(directory, size, chunk_bytes(args.chunk_tokens), args.reps)
    print_table(results, size, memcpy_seconds(buffer, args.reps))
    print_ratios(results, [("kvtier host tier", "AIBrix in-process CPU", ">= 1x at the same thread count"),
                           ("kvtier host+disk, disk", "AIBrix disk, file/block", ">= 1x, writes as durable"),
                           ("kvtier host+disk, disk", "AIBrix disk, RocksDB", ">= 1x, writes as durable")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
