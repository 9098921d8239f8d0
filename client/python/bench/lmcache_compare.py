#!/usr/bin/env python3
"""kvtier next to LMCache at the storage level: the same KV chunks, stored
from an engine's CPU KV buffer and retrieved back into it, through LMCache
0.5.6 and through kvtierd, in one run.

LMCache's vLLM connector needs CUDA, so the engine here is this script: a KV
buffer of Llama-8B's shape (32 layers, K and V, 8 KV heads of 128, bf16:
128 KiB a token) in CPU memory, cut into chunks of --chunk-tokens (16: 2 MiB
each). Each repetition stores --chunks new chunks (new tokens: nothing is
"already stored"), then retrieves them all into the buffer again, and checks
the bytes that came back.

  lmcache-cpu   LMCache's in-process engine with its local CPU backend
                (LMCacheEngine.store / retrieve; the copies between the
                buffer and LMCache's memory objects are torch copies, done by
                the small CPU connector below, as LMCache ships none for CPU);
  kvtier        kvtierd's host tier: Client.store / load of the same chunks,
                the buffer registered in place (the daemon copies).

Both at the same thread count: kvtierd copies with its 2 copy threads, and
torch gets --threads (default 2). Both hold --tier-reps repetitions' chunks,
and the timed repetitions come after enough warm-ups to fill them: each
store evicts, as in a cache that is full, as caches are most of their life.
Medians of --reps repetitions, and memcpy of the same bytes as a baseline.

Needs a venv with LMCache (tools/setup-python.sh
client/python/bench/requirements-lmcache.txt build/venv-lmcache) and the
kvtier package installed there.

  python client/python/bench/lmcache_compare.py --kvtierd build/release/bin/kvtierd
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch

ROOT = pathlib.Path(__file__).resolve().parents[3]
LAYERS, HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B's KV
DTYPE = torch.bfloat16


def chunk_bytes(tokens: int) -> int:
    return LAYERS * 2 * tokens * HEADS * HEAD_DIM * 2


# --------------------------------------------------------------------------
# LMCache in-process.


def lmcache_cpu(args: argparse.Namespace, buffer: torch.Tensor, token_sets: list[list[int]]) -> tuple[list[float], list[float]]:
    """Seconds to store, and to retrieve, each repetition's chunks."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import GPUConnectorInterface
    from lmcache.v1.metadata import LMCacheMetadata

    class CpuConnector(GPUConnectorInterface):
        """Copies tokens [start, end) of the engine's buffer [layers, 2,
        tokens, heads, head_dim] to and from LMCache's memory objects."""

        def __init__(self, kv: torch.Tensor) -> None:
            self.kv = kv

        @staticmethod
        def _shaped(memory_obj, tokens: int) -> torch.Tensor:
            # LMCache's object holds [layers, 2, tokens, heads x head_dim].
            return memory_obj.tensor.view(LAYERS, 2, tokens, HEADS, HEAD_DIM)

        def from_gpu(self, memory_obj, start: int, end: int, **kwargs: Any) -> None:
            self._shaped(memory_obj, end - start).copy_(self.kv[:, :, start:end])

        def to_gpu(self, memory_obj, start: int, end: int, **kwargs: Any) -> None:
            self.kv[:, :, start:end].copy_(self._shaped(memory_obj, end - start))

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:
            for m, s, e in zip(memory_objs, starts, ends):
                self.from_gpu(m, s, e)

        def batched_to_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:
            for m, s, e in zip(memory_objs, starts, ends):
                self.to_gpu(m, s, e)

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([LAYERS, 2, num_tokens, HEADS, HEAD_DIM])

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=args.chunk_tokens,
        local_cpu=True,
        max_local_cpu_size=tier_bytes(args) / 1e9,
        save_unfull_chunk=False,
    )
    metadata = LMCacheMetadata(
        model_name="kvtier-bench",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=DTYPE,
        kv_shape=(LAYERS, 2, args.chunk_tokens, HEADS, HEAD_DIM),
    )
    engine = LMCacheEngineBuilder.get_or_create("kvtier-bench", config, metadata, CpuConnector(buffer), None, None)
    engine.post_init()

    def retrieve(tokens: list[int]) -> None:
        mask = engine.retrieve(torch.tensor(tokens, dtype=torch.long))
        if int(mask.sum()) != len(tokens):
            raise RuntimeError(f"LMCache retrieved {int(mask.sum())} of {len(tokens)} tokens")

    try:
        return timed_reps(args, buffer, token_sets, lambda tokens: engine.store(torch.tensor(tokens, dtype=torch.long)), retrieve)
    finally:
        LMCacheEngineBuilder.destroy("kvtier-bench")


# --------------------------------------------------------------------------
# kvtier.


def kvtier_host(args: argparse.Namespace, buffer: torch.Tensor, token_sets: list[list[int]]) -> tuple[list[float], list[float]]:
    import kvtier

    chunks = args.chunks
    with tempfile.TemporaryDirectory(prefix="kvtier-lmcache-") as directory:
        socket = os.path.join(directory, "kvtierd.sock")
        host_bytes = tier_bytes(args)
        daemon = subprocess.Popen(
            [args.kvtierd, "--foreground", "--set", f"socket.path={socket}", "--set", f"state_dir={directory}/state",
             "--set", "tiers.disk.enabled=false", "--set", "metrics.enabled=false", "--set", "log.level=warn",
             "--set", f"tiers.host.bytes={host_bytes}"],
        )
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(socket):
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("kvtierd did not start")
                time.sleep(0.02)
            with kvtier.Client.connect(socket, name="bench") as client:
                layout = kvtier.Layout("kvtier-bench", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                                       dtype="bf16", block_tokens=args.chunk_tokens)
                element = buffer.element_size()
                tokens_total = buffer.shape[2]
                placements = [
                    kvtier.Placement(
                        region=0,
                        offset_bytes=((layer * 2 + kv) * tokens_total) * HEADS * HEAD_DIM * element,
                        block_stride_bytes=args.chunk_tokens * HEADS * HEAD_DIM * element,
                        token_stride_bytes=HEADS * HEAD_DIM * element,
                        head_stride_bytes=HEAD_DIM * element,
                    )
                    for layer in range(LAYERS)
                    for kv in (0, 1)
                ]
                cache = client.register_host_memory(layout, chunks, [(buffer.data_ptr(), buffer.nbytes)], placements)
                ids = list(range(chunks))

                def store(tokens: list[int]) -> None:
                    if (n := client.store(cache, client.compute_keys(cache, tokens), ids).blocks) != chunks:
                        raise RuntimeError(f"kvtier stored {n} of {chunks} chunks")

                def load(tokens: list[int]) -> None:
                    if (n := client.load(cache, client.compute_keys(cache, tokens), ids).blocks) != chunks:
                        raise RuntimeError(f"kvtier loaded {n} of {chunks} chunks")

                result = timed_reps(args, buffer, token_sets, store, load)
                del cache
                return result
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)


# --------------------------------------------------------------------------


def timed_reps(
    args: argparse.Namespace,
    buffer: torch.Tensor,
    token_sets: list[list[int]],
    store: Callable[[list[int]], None],
    retrieve: Callable[[list[int]], None],
) -> tuple[list[float], list[float]]:
    """Seconds of each timed repetition's store, and of its retrieve: the
    buffer holds the repetition's data, is stored, zeroed, retrieved into
    and checked."""
    stores, loads = [], []
    for rep, tokens in enumerate(token_sets):
        started = time.perf_counter()
        store(tokens)
        stored = time.perf_counter()
        buffer.zero_()
        zeroed = time.perf_counter()
        retrieve(tokens)
        done = time.perf_counter()
        check(buffer, rep)
        if rep >= warmups(args):
            stores.append(stored - started)
            loads.append(done - zeroed)
        fill(buffer, rep + 1)
    return stores, loads


def tier_bytes(args: argparse.Namespace) -> int:
    """What LMCache's CPU backend and kvtier's host tier hold: --tier-reps
    repetitions' chunks, so that both are full and evicting once the
    warm-ups are over, as a cache is most of its life; with --tier-reps 0,
    room for every repetition (nothing is evicted; first stores into memory
    never touched before)."""
    reps = args.tier_reps or warmups(args) + args.reps
    return chunk_bytes(args.chunk_tokens) * args.chunks * reps + (64 << 20)


def warmups(args: argparse.Namespace) -> int:
    """Repetitions before the timed ones: enough to fill the tier, and one more."""
    return args.tier_reps + 1


def fill(buffer: torch.Tensor, rep: int) -> None:
    """Every element of the buffer a function of its position and the rep."""
    flat = buffer.view(torch.int16).view(-1)
    torch.manual_seed(rep)
    flat.copy_(torch.randint(-16000, 16000, flat.shape, dtype=torch.int16))


def check(buffer: torch.Tensor, rep: int) -> None:
    flat = buffer.view(torch.int16).view(-1)
    torch.manual_seed(rep)
    if not torch.equal(flat, torch.randint(-16000, 16000, flat.shape, dtype=torch.int16)):
        raise RuntimeError("the bytes retrieved are not the bytes stored")


def memcpy_seconds(buffer: torch.Tensor, reps: int) -> list[float]:
    other = torch.empty_like(buffer)
    other.copy_(buffer)
    out = []
    for _ in range(reps):
        started = time.perf_counter()
        other.copy_(buffer)
        out.append(time.perf_counter() - started)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kvtierd", default=None)
    parser.add_argument("--chunk-tokens", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tier-reps", type=int, default=2, help="repetitions' chunks the tiers hold (0: room for all)")
    args = parser.parse_args()
    if args.kvtierd is None:
        candidates = [os.environ.get("KVTIER_PROGRAMS_DIR", ""), str(ROOT / "build/release/bin"), str(ROOT / "build/debug/bin")]
        args.kvtierd = next((str(pathlib.Path(c) / "kvtierd") for c in candidates if c and (pathlib.Path(c) / "kvtierd").exists()), None)
        if args.kvtierd is None:
            parser.error("no kvtierd found: pass --kvtierd")
    torch.set_num_threads(args.threads)
    import lmcache

    tokens = args.chunk_tokens * args.chunks
    buffer = torch.empty((LAYERS, 2, tokens, HEADS, HEAD_DIM), dtype=DTYPE)
    fill(buffer, 0)
    token_sets = [[(rep * tokens + i) % 120000 + 1 for i in range(tokens)] for rep in range(warmups(args) + args.reps)]
    size = chunk_bytes(args.chunk_tokens) * args.chunks
    print(f"machine:  {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, Linux {platform.release()}")
    print(f"config:   {args.chunks} chunks of {args.chunk_tokens} tokens ({chunk_bytes(args.chunk_tokens) >> 20} MiB, "
          f"Llama-8B KV) a rep, {args.reps} reps after {warmups(args)} warm-ups; tiers of {tier_bytes(args) >> 20} MiB ({'full, evicting' if args.tier_reps else 'room for all'}); torch threads {args.threads}; "
          f"LMCache {lmcache.__version__ if hasattr(lmcache, '__version__') else '0.5.6'}; kvtierd {args.kvtierd}")
    results = {}
    # kvtier first, then LMCache (whose engine stays in this process).
    results["kvtier host tier"] = kvtier_host(args, buffer, token_sets)
    fill(buffer, 0)
    results["LMCache in-process CPU"] = lmcache_cpu(args, buffer, token_sets)
    mem = statistics.median(memcpy_seconds(buffer, args.reps))
    print()
    print(f"{'':<24} {'store GB/s':>11} {'retrieve GB/s':>14} {'store+retrieve GB/s':>20}")
    for name, (stores, loads) in results.items():
        s, l = statistics.median(stores), statistics.median(loads)
        print(f"{name:<24} {size / s / 1e9:11.2f} {size / l / 1e9:14.2f} {2 * size / (s + l) / 1e9:20.2f}")
    print(f"{'memcpy (torch copy_)':<24} {size / mem / 1e9:11.2f} {size / mem / 1e9:14.2f} {size / mem / 1e9:20.2f}")
    k, m = results["kvtier host tier"], results["LMCache in-process CPU"]
    ratio = (statistics.median(m[0]) + statistics.median(m[1])) / (statistics.median(k[0]) + statistics.median(k[1]))
    print(f"\nkvtier / LMCache in-process CPU, store+retrieve: {ratio:.2f}x (goal >= 1x at the same thread count)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
