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

  kvtier host tier        kvtierd's host tier: Client.store, then lookup
                          and load, of the same chunks, the buffer registered
                          in place (the daemon copies);
  LMCache in-process CPU  LMCache's in-process engine with its local CPU
                          backend (LMCacheEngine.store / retrieve; the copies
                          between the buffer and LMCache's memory objects are
                          torch copies, done by the small CPU connector below,
                          as LMCache ships none for CPU);
  kvtier host+disk, disk  kvtierd with a disk tier: stored until durable on
                          disk (flush; records written with O_DIRECT,
                          fdatasynced and indexed), host emptied (untimed),
                          then looked up and loaded from disk;
  LMCache disk (O_DIRECT) LMCache's local disk backend with O_DIRECT and no
                          CPU hot cache, stored until its writes are done,
                          with an fsync added per file (it has none), then
                          retrieved from disk;
  LMCache server (shm)    `lmcache server`, the daemon beside the engine as
                          kvtierd is, driven by LMCache's own bench client in
                          its fastest CPU mode (lmcache_driven: the engine's
                          KV tensors shared over POSIX shared memory).

Both at the same thread count: kvtierd copies with its 2 copy threads, and
torch gets --threads (default 2). Memory tiers hold --tier-reps
repetitions' chunks, and the timed repetitions come after enough warm-ups
to fill them: each store evicts, as in a cache that is full, as caches are
most of their life (LMCache's server gets more room: see server_l1_bytes).
Disk tiers hold every repetition. Medians of --reps repetitions, with
memcpy and an O_DIRECT file of the same bytes as baselines.

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
import socket
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
    """Seconds to store, and to retrieve, each repetition's chunks, with
    LMCache's local CPU backend."""
    from lmcache.v1.config import LMCacheEngineConfig

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=args.chunk_tokens,
        local_cpu=True,
        max_local_cpu_size=tier_bytes(args) / 1e9,
        save_unfull_chunk=False,
    )
    return lmcache_engine(args, buffer, token_sets, config)


def lmcache_disk(args: argparse.Namespace, buffer: torch.Tensor, token_sets: list[list[int]],
                 directory: str) -> tuple[list[float], list[float]]:
    """Seconds to store each repetition's chunks until they are durable on
    disk, and to retrieve them from disk, with LMCache's local disk backend:
    O_DIRECT, no CPU hot cache (its CPU backend only allocates), and an
    fsync of each chunk's file after LMCache's own write, which has none (so
    that its writes are as durable as kvtier's, whose records are fdatasynced
    and indexed before they count). Its disk holds every repetition (its
    remove() does not lower its size count)."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    plain_write = LocalDiskBackend.write_file

    def durable_write(self, buffer, path):
        plain_write(self, buffer, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    LocalDiskBackend.write_file = durable_write
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=args.chunk_tokens,
        local_cpu=False,
        max_local_cpu_size=tier_bytes(args) / 1e9,
        local_disk=f"file://{directory}/",
        max_local_disk_size=2 * all_reps_bytes(args) / 1e9,
        extra_config={"use_odirect": True},
        save_unfull_chunk=False,
    )

    def written(engine) -> None:
        disk = engine.storage_manager.storage_backends["LocalDiskBackend"]
        while True:
            with disk.disk_worker.put_lock:
                if not disk.disk_worker.put_tasks:
                    return
            time.sleep(0.001)

    try:
        return lmcache_engine(args, buffer, token_sets, config, after_store=written)
    finally:
        LocalDiskBackend.write_file = plain_write


def lmcache_engine(args: argparse.Namespace, buffer: torch.Tensor, token_sets: list[list[int]], config,
                   after_store: Callable[[Any], None] = lambda engine: None) -> tuple[list[float], list[float]]:
    """Seconds to store (and `after_store`), and to retrieve, each
    repetition's chunks through an in-process LMCacheEngine of `config`."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
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

    def store(tokens: list[int]) -> None:
        engine.store(torch.tensor(tokens, dtype=torch.long))
        after_store(engine)

    try:
        return timed_reps(args, buffer, token_sets, store, retrieve)
    finally:
        LMCacheEngineBuilder.destroy("kvtier-bench")


# --------------------------------------------------------------------------
# LMCache's multiprocess server (`lmcache server`), driven by its own bench
# client (ServerBenchClient) as `lmcache bench server --mode cpu
# --transfer-mode lmcache_driven` drives it: the engine's KV tensors (vLLM's
# CPU layout, one [2, blocks, 16, heads, head_dim] tensor a layer) shared
# with the server over POSIX shared memory, and the server copying.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_l1_bytes(args: argparse.Namespace) -> int:
    """The server's L1: twice the tiers' bytes. It evicts on a thread that
    looks once a second and then drops --eviction-ratio of its memory once
    above 80% use, and refuses stores that find no room meanwhile (seen
    with the tiers' bytes: "Failed to batched allocate ... no enough
    memory"); so the bench gives it twice the room, evicts half at a time
    (--eviction-ratio 0.5) and pauses 1.2 s (untimed) after each
    repetition."""
    return 2 * tier_bytes(args)


def lmcache_server(args: argparse.Namespace, log_dir: str) -> tuple[list[float], list[float]]:
    """Seconds to store, and to look up and retrieve, each repetition's
    tokens (args.chunks x args.chunk_tokens a request, as in the others)."""
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig

    port, http_port = free_port(), free_port()
    tokens = args.chunk_tokens * args.chunks
    blocks = tokens // args.chunk_tokens
    kv_blocks = 4 * blocks  # the engine's cache: room for a request at a few offsets
    log = open(os.path.join(log_dir, "lmcache-server.log"), "w")
    server = subprocess.Popen(
        [str(pathlib.Path(sys.executable).parent / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--http-port", str(http_port), "--chunk-size", str(args.server_chunk_tokens),
         "--l1-size-gb", f"{server_l1_bytes(args) / 2**30:.3f}", "--no-l1-use-lazy", "--eviction-policy", "LRU",
         "--eviction-ratio", "0.5",
         "--supported-transfer-mode", "lmcache_driven"],
        stdout=log, stderr=subprocess.STDOUT)
    client = None
    try:
        deadline = time.monotonic() + 180
        while True:  # its HTTP port answers once it serves
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lmcache server did not start; see {log.name}")
            try:
                socket.create_connection(("127.0.0.1", http_port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        client = ServerBenchClient(
            BenchConfig(rpc_url=f"tcp://127.0.0.1:{port}", http_url=f"http://127.0.0.1:{http_port}", mode="cpu",
                        transfer_mode="lmcache_driven", tp_size=1, use_mla=False, num_tokens=tokens,
                        kvcache_shape_spec=f"(2,{kv_blocks},{args.chunk_tokens},{HEADS},{HEAD_DIM}):bfloat16:{LAYERS}",
                        num_blocks=kv_blocks, block_size=args.chunk_tokens),
            log=lambda line: None)
        client.start()
        layers = list(client._workers[0].kv_caches.values())
        stores, loads = [], []
        for rep in range(warmups(args) + args.reps):
            request = client.create_request(rep, f"rep-{rep}", "bench")
            if request is None or request.num_full_tokens != tokens:
                raise RuntimeError(f"LMCache's bench client made a request of {request and request.num_full_tokens} tokens, not {tokens}")
            where = slice(request.block_offset, request.block_offset + blocks)
            torch.manual_seed(rep)
            for layer in layers:
                view = layer[:, where].view(torch.int16)
                view.copy_(torch.randint(-16000, 16000, view.shape, dtype=torch.int16))
            expected = [layer[:, where].clone() for layer in layers]
            started = time.perf_counter()
            store = client.store(request, 0, tokens)
            stored = time.perf_counter()
            client.end_session(request)
            if store is None or not store.succeeded:
                raise RuntimeError(f"LMCache's server did not store rep {rep}")
            for layer in layers:
                layer[:, where].zero_()
            warm = client.create_request(rep, f"rep-{rep}-warm", "bench")
            zeroed = time.perf_counter()
            hits = client.lookup(warm).hit_chunks
            retrieve = client.retrieve(warm, 0, hits * warm.chunk_size)
            done = time.perf_counter()
            client.end_session(warm)
            if hits != warm.total_chunks or retrieve is None or not retrieve.succeeded:
                raise RuntimeError(f"LMCache's server found {hits} of {warm.total_chunks} chunks of rep {rep}")
            if not all(torch.equal(layer[:, where].view(torch.int16), e.view(torch.int16)) for layer, e in zip(layers, expected)):
                raise RuntimeError("the bytes LMCache's server retrieved are not the bytes stored")
            if rep >= warmups(args):
                stores.append(stored - started)
                loads.append(done - zeroed)
            time.sleep(1.2)  # untimed: its evictor runs once a second
        return stores, loads
    finally:
        if client is not None:
            client.close()
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


# --------------------------------------------------------------------------
# kvtier.


def kvtier_host(args: argparse.Namespace, buffer: torch.Tensor, token_sets: list[list[int]],
                disk_dir: str | None = None) -> tuple[list[float], list[float]]:
    """Seconds to store, and to look up and load, each repetition's chunks
    through kvtierd's host tier; with `disk_dir`, to store them until they
    are durable on disk (flushed: written, fdatasynced and indexed), and to
    load them from disk (host emptied in between, untimed)."""
    import kvtier

    chunks = args.chunks
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as directory:
        path = os.path.join(directory, "kvtierd.sock")
        disk = ["tiers.disk.enabled=false"]
        if disk_dir is not None:
            disk = ["tiers.disk.enabled=true", f"tiers.disk.paths=[{disk_dir}]",
                    f"tiers.disk.bytes={2 * all_reps_bytes(args) + (256 << 20)}"]
        daemon = subprocess.Popen(
            [args.kvtierd, "--foreground", "--set", f"socket.path={path}", "--set", f"state_dir={directory}/state",
             "--set", "metrics.enabled=false", "--set", "log.level=warn",
             "--set", f"tiers.host.bytes={tier_bytes(args)}"] + [a for d in disk for a in ("--set", d)],
        )
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(path):
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("kvtierd did not start")
                time.sleep(0.02)
            with kvtier.Client.connect(path, name="bench") as client:
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

                def on_disk() -> tuple[int, int]:
                    stats = client.stats()
                    return stats["tiers"][2]["blocks"], stats["counters"]["disk_writes_pending"]

                def store(tokens: list[int]) -> None:
                    before = on_disk()[0] if disk_dir else 0
                    if (n := client.store(cache, client.compute_keys(cache, tokens), ids).blocks) != chunks:
                        raise RuntimeError(f"kvtier stored {n} of {chunks} chunks")
                    if disk_dir:
                        client.flush()
                        while (state := on_disk()) != (before + chunks, 0):
                            if state[0] > before + chunks:
                                raise RuntimeError(f"kvtier's disk holds {state[0]} blocks, not {before + chunks}")
                            time.sleep(0.001)

                def between(tokens: list[int]) -> None:
                    if disk_dir:
                        client.evict(tier="host")

                def load(tokens: list[int]) -> None:
                    keys = client.compute_keys(cache, tokens)
                    if (hits := client.lookup(cache, keys).hits) != chunks:
                        raise RuntimeError(f"kvtier found {hits} of {chunks} chunks")
                    if (n := client.load(cache, keys, ids).blocks) != chunks:
                        raise RuntimeError(f"kvtier loaded {n} of {chunks} chunks")

                result = timed_reps(args, buffer, token_sets, store, load, between)
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
    between: Callable[[list[int]], None] = lambda tokens: None,
) -> tuple[list[float], list[float]]:
    """Seconds of each timed repetition's store, and of its retrieve: the
    buffer holds the repetition's data, is stored, zeroed (and `between`
    runs, untimed), retrieved into and checked."""
    stores, loads = [], []
    for rep, tokens in enumerate(token_sets):
        started = time.perf_counter()
        store(tokens)
        stored = time.perf_counter()
        between(tokens)
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
    """What the memory tiers (kvtier's host tier, the other cache's CPU
    cache) hold: --tier-reps repetitions' chunks, so that both are full and
    evicting once the warm-ups are over, as a cache is most of its life; with
    --tier-reps 0, room for every repetition (nothing is evicted; first
    stores into memory never touched before)."""
    reps = args.tier_reps or warmups(args) + args.reps
    return chunk_bytes(args.chunk_tokens) * args.chunks * reps + (64 << 20)


def all_reps_bytes(args: argparse.Namespace) -> int:
    return chunk_bytes(args.chunk_tokens) * args.chunks * (warmups(args) + args.reps)


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


def direct_io_seconds(directory: str, size: int, piece: int, reps: int) -> tuple[list[float], list[float]]:
    """The disk's own pace, the baseline of the disk rows: `size` bytes
    written to a fresh file with O_DIRECT in `piece`-byte writes, then
    fdatasync; and read back with O_DIRECT."""
    import mmap

    buffer = mmap.mmap(-1, piece)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(piece))
    writes, reads = [], []
    for rep in range(reps):
        path = os.path.join(directory, f"baseline-{rep}")
        started = time.perf_counter()
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        try:
            for _ in range(size // piece):
                os.write(fd, buffer)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        written = time.perf_counter()
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            for _ in range(size // piece):
                os.readv(fd, [buffer])
        finally:
            os.close(fd)
        writes.append(written - started)
        reads.append(time.perf_counter() - written)
        os.unlink(path)
    return writes, reads


def find_kvtierd() -> str | None:
    """$KVTIER_PROGRAMS_DIR's kvtierd, else the Release build's, else the Debug build's."""
    candidates = [os.environ.get("KVTIER_PROGRAMS_DIR", ""), str(ROOT / "build/release/bin"), str(ROOT / "build/debug/bin")]
    return next((str(pathlib.Path(c) / "kvtierd") for c in candidates if c and (pathlib.Path(c) / "kvtierd").exists()), None)


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, Linux {platform.release()}"


def print_table(results: dict[str, tuple[list[float], list[float]]], size: int, memcpy: list[float]) -> None:
    """The median GB/s of each row's stores and retrieves of `size` bytes,
    with memcpy's (seconds of `memcpy`) as the baseline."""
    mem = statistics.median(memcpy)
    print()
    print(f"{'':<24} {'store GB/s':>11} {'retrieve GB/s':>14} {'store+retrieve GB/s':>20}")
    for name, (stores, loads) in results.items():
        s, l = statistics.median(stores), statistics.median(loads)
        print(f"{name:<24} {size / s / 1e9:11.2f} {size / l / 1e9:14.2f} {2 * size / (s + l) / 1e9:20.2f}")
    print(f"{'memcpy (torch copy_)':<24} {size / mem / 1e9:11.2f} {size / mem / 1e9:14.2f} {size / mem / 1e9:20.2f}")
    print()


def print_ratios(results: dict[str, tuple[list[float], list[float]]], pairs: list[tuple[str, str, str]]) -> None:
    """For each (mine, other, goal) whose rows ran: other's median
    store+retrieve seconds over mine's."""
    for mine, name, goal in pairs:
        if mine in results and name in results:
            k = statistics.median(results[mine][0]) + statistics.median(results[mine][1])
            other = statistics.median(results[name][0]) + statistics.median(results[name][1])
            print(f"{mine} / {name}, store+retrieve: {other / k:.2f}x (goal {goal})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every comparison takes (this one and aibrix_compare.py)."""
    parser.add_argument("--kvtierd", default=None)
    parser.add_argument("--chunk-tokens", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tier-reps", type=int, default=2, help="repetitions' chunks the tiers hold (0: room for all)")
    parser.add_argument("--no-disk", action="store_true", help="leave the disk tiers out")
    parser.add_argument("--disk-dir", default=str(ROOT / "build"), help="where the disk tiers go (O_DIRECT: not tmpfs)")


def prepare(parser: argparse.ArgumentParser, args: argparse.Namespace,
            peer: str) -> tuple[torch.Tensor, list[list[int]], int]:
    """Finds kvtierd, sets torch's threads, makes the engine's KV buffer and
    every repetition's tokens, and prints the machine and the config (`peer`:
    the other cache and its version). Returns the buffer, the token sets and
    a repetition's bytes."""
    args.kvtierd = args.kvtierd or find_kvtierd()
    if args.kvtierd is None:
        parser.error("no kvtierd found: pass --kvtierd")
    torch.set_num_threads(args.threads)
    tokens = args.chunk_tokens * args.chunks
    buffer = torch.empty((LAYERS, 2, tokens, HEADS, HEAD_DIM), dtype=DTYPE)
    fill(buffer, 0)
    token_sets = [[(rep * tokens + i) % 120000 + 1 for i in range(tokens)] for rep in range(warmups(args) + args.reps)]
    print(f"machine:  {machine()}")
    print(f"config:   {args.chunks} chunks of {args.chunk_tokens} tokens ({chunk_bytes(args.chunk_tokens) >> 20} MiB, "
          f"Llama-8B KV) a rep, {args.reps} reps after {warmups(args)} warm-ups; tiers of {tier_bytes(args) >> 20} MiB "
          f"({'full, evicting' if args.tier_reps else 'room for all'}); torch threads {args.threads}; "
          f"{peer}; kvtierd {args.kvtierd}")
    return buffer, token_sets, chunk_bytes(args.chunk_tokens) * args.chunks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--server-chunk-tokens", type=int, default=256, help="lmcache server's --chunk-size (its default)")
    parser.add_argument("--no-server", action="store_true", help="leave LMCache's server out")
    parser.add_argument("--log-dir", default=tempfile.gettempdir(), help="where lmcache-server.log goes")
    args = parser.parse_args()
    import lmcache

    buffer, token_sets, size = prepare(
        parser, args, f"LMCache {lmcache.__version__ if hasattr(lmcache, '__version__') else '0.5.6'}")
    results = {}
    # kvtier first, then LMCache (whose engine stays in this process).
    results["kvtier host tier"] = kvtier_host(args, buffer, token_sets)
    fill(buffer, 0)
    results["LMCache in-process CPU"] = lmcache_cpu(args, buffer, token_sets)
    if not args.no_disk:
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-disk-", dir=args.disk_dir) as directory:
            fill(buffer, 0)
            results["kvtier host+disk, disk"] = kvtier_host(args, buffer, token_sets, disk_dir=directory)
        with tempfile.TemporaryDirectory(prefix="lmcache-bench-disk-", dir=args.disk_dir) as directory:
            fill(buffer, 0)
            results["LMCache disk (O_DIRECT)"] = lmcache_disk(args, buffer, token_sets, directory)
            results["O_DIRECT file, 2 MiB I/O"] = direct_io_seconds(directory, size, chunk_bytes(args.chunk_tokens), args.reps)
    if not args.no_server:
        results["LMCache server (shm)"] = lmcache_server(args, args.log_dir)
    print_table(results, size, memcpy_seconds(buffer, args.reps))
    print_ratios(results, [("kvtier host tier", "LMCache in-process CPU", ">= 1x at the same thread count"),
                           ("kvtier host tier", "LMCache server (shm)", ">= 3x"),
                           ("kvtier host+disk, disk", "LMCache disk (O_DIRECT)", ">= 1x, writes as durable")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
