"""The kvtier package against a real kvtierd: round trips through CPU caches
kvtier allocates and caches the engine allocated itself (torch and NumPy),
async ops, errors as exceptions, the GIL released while waiting, and daemon
restarts seen as misses."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import kvtier
from conftest import Daemon, small_layout


def prompt(seed: int, blocks: int, block_tokens: int = 16) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 128000, blocks * block_tokens)]


def test_cpu_cache_round_trip_is_byte_exact_and_seen_without_copies(client: kvtier.Client) -> None:
    layout = small_layout()
    cpu = kvtier.CpuKvCache(layout, 32)
    view = np.asarray(cpu)
    assert view.shape == (32, layout.block_bytes) and view.dtype == np.uint8
    tensor = torch.frombuffer(cpu, dtype=torch.uint8).view(32, layout.block_bytes)
    tensor[3, :8] = 7  # one memory: torch's write is numpy's
    assert view[3, :8].tolist() == [7] * 8
    assert view.ctypes.data == tensor.data_ptr()

    cache = client.register_cpu_cache(cpu)
    tokens = prompt(1, 8)
    keys = client.compute_keys(cache, tokens)
    assert len(keys) == 8 and all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert client.compute_keys(cache, np.array(tokens, dtype=np.int64)) == keys
    assert client.compute_keys(cache, np.array(tokens, dtype=np.uint32)) == keys
    assert client.compute_keys(cache, tokens + [1, 2, 3]) == keys  # a partial block has no key
    # Chained: the tail continues from its parent's key.
    assert client.compute_keys(cache, tokens[64:], parent=keys[3]) == keys[4:]

    rng = np.random.default_rng(2)
    view[0:8] = rng.integers(0, 256, (8, layout.block_bytes), dtype=np.uint8)
    expected = view[0:8].copy()
    assert client.lookup(cache, keys).hits == 0
    stored = client.store(cache, keys, list(range(8)))
    assert (stored.blocks, stored.already) == (8, 0)
    assert client.store(cache, keys, list(range(8))).already == 8
    hit = client.lookup(cache, keys)
    assert hit.hits == 8 and set(hit.tiers) <= {"hbm", "host"}

    view[16:24] = 0
    loaded = client.load(cache, keys, np.arange(16, 24))
    assert loaded.blocks == 8
    assert np.array_equal(view[16:24], expected)
    assert client.prefetch(cache, keys) == 8


def test_numpy_is_optional_lists_and_memoryviews_do_without_it(daemon: Daemon) -> None:
    # The wheel declares no dependency: a Python with no NumPy (here, one
    # where importing it fails) computes keys from a list, and stores and
    # loads blocks written through a memoryview.
    script = """
import sys
sys.modules["numpy"] = None  # `import numpy` raises ImportError from here on
import kvtier
client = kvtier.Client.connect(sys.argv[1])
cpu = kvtier.CpuKvCache(kvtier.Layout("kvtier/no-numpy", num_layers=1, num_kv_heads=1, head_dim=8,
                                      dtype="bf16", block_tokens=16), 4)
pages = memoryview(cpu).cast("B")
pages[: len(pages) // 2] = bytes(range(256)) * (len(pages) // 512)
cache = client.register_cpu_cache(cpu)
keys = client.compute_keys(cache, list(range(7, 7 + 32)))
assert client.store(cache, keys, [0, 1]).blocks == 2
assert client.load(cache, keys, (2, 3)).blocks == 2
assert pages[len(pages) // 2 :] == pages[: len(pages) // 2]
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script, daemon.socket], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_an_engine_allocated_torch_cache_is_shared_in_place(client: kvtier.Client) -> None:
    # vLLM's CPU KV cache: one torch.zeros tensor per layer, [2, blocks,
    # block_tokens, heads, head_dim] (NHD). Registering keeps the tensors'
    # addresses and bytes; the daemon then copies into and out of them.
    layout = small_layout()
    num_blocks = 64
    shape = (2, num_blocks, layout.block_tokens, layout.num_kv_heads, layout.head_dim)
    layers = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(layout.num_layers)]
    generator = torch.Generator().manual_seed(3)
    for t in layers:
        t.copy_(torch.randn(shape, generator=generator).to(torch.bfloat16))
    before = [t.clone() for t in layers]
    pointers = [t.data_ptr() for t in layers]

    cache = client.register_tensors(layout, num_blocks, layers, "vllm_nhd")
    assert cache.kind == "host" and cache.num_blocks == num_blocks
    assert [t.data_ptr() for t in layers] == pointers
    assert all(torch.equal(a, b) for a, b in zip(layers, before)), "registering changed the engine's bytes"

    keys = client.compute_keys(cache, prompt(4, 6))
    assert client.store(cache, keys, [0, 1, 2, 3, 4, 5]).blocks == 6
    for t in layers:
        t[:, 40:46] = 0
    assert client.load(cache, keys, [40, 41, 42, 43, 44, 45]).blocks == 6
    for t, b in zip(layers, before):
        assert torch.equal(t[:, 40:46], b[:, 0:6]), "a loaded block differs from the stored one"


def test_views_of_one_storage_that_share_pages_are_registered_together(client: kvtier.Client) -> None:
    # Two layers carved out of one allocation at an odd offset: the first
    # layer's last page is the second's first.
    layout = small_layout()
    num_blocks = 16
    shape = (2, num_blocks, layout.block_tokens, layout.num_kv_heads, layout.head_dim)
    numel = 2 * num_blocks * layout.block_tokens * layout.num_kv_heads * layout.head_dim
    storage = torch.zeros(2 * numel + 100, dtype=torch.bfloat16)
    layers = [storage[50 : 50 + numel].view(shape), storage[50 + numel : 50 + 2 * numel].view(shape)]
    layers[0][:, 0] = 1.5
    layers[1][:, 0] = -2.0
    cache = client.register_tensors(layout, num_blocks, layers, "vllm_nhd")
    keys = client.compute_keys(cache, prompt(11, 1))
    assert client.store(cache, keys, [0]).blocks == 1
    assert client.load(cache, keys, [9]).blocks == 1
    assert bool((layers[0][:, 9] == 1.5).all()) and bool((layers[1][:, 9] == -2.0).all())
    with pytest.raises(kvtier.InvalidArgumentError, match="registered with kvtier already"):
        client.register_tensors(layout, num_blocks, layers, "vllm_nhd")
    # Released (the engine is done with that cache), the memory may be registered anew.
    del cache
    again = client.register_tensors(layout, num_blocks, layers, "vllm_nhd")
    assert client.load(again, keys, [7]).blocks == 1
    assert bool((layers[0][:, 7] == 1.5).all()) and bool((layers[1][:, 7] == -2.0).all())


def test_an_engine_allocated_numpy_cache_in_the_canonical_layout(client: kvtier.Client) -> None:
    layout = kvtier.Layout("kvtier/python-fp16", 2, 2, 64, "fp16", 16)
    array = np.zeros((48, layout.block_bytes // 2), dtype=np.float16)
    array[:4] = np.random.default_rng(5).standard_normal((4, array.shape[1])).astype(np.float16)
    expected = array[:4].copy()
    cache = client.register_tensors(layout, 48, [array], "contiguous")
    keys = client.compute_keys(cache, prompt(6, 4))
    assert client.store(cache, keys, [0, 1, 2, 3]).blocks == 4
    assert client.load(cache, keys, [10, 11, 12, 13]).blocks == 4
    assert np.array_equal(array[10:14], expected)


def test_async_ops_are_waited_for_once(client: kvtier.Client) -> None:
    cpu = kvtier.CpuKvCache(small_layout(), 16)
    cache = client.register_cpu_cache(cpu)
    keys = client.compute_keys(cache, prompt(7, 4))
    np.asarray(cpu)[:4] = 9
    op = client.store_async(cache, keys, [0, 1, 2, 3])
    assert op.wait(timeout=10).blocks == 4
    assert op.done
    with pytest.raises(kvtier.FailedPreconditionError):
        op.wait()
    load = client.load_async(cache, keys, [8, 9, 10, 11])
    assert load.wait().blocks == 4
    assert (np.asarray(cpu)[8:12] == 9).all()
    load.cancel()  # over already: nothing to do
    # A cancelled op is over too: its result is never read.
    again = client.load_async(cache, keys, [12, 13, 14, 15])
    again.cancel(timeout=10)
    assert again.done
    with pytest.raises(kvtier.FailedPreconditionError):
        again.wait()
    with pytest.raises(kvtier.InvalidArgumentError, match="timeout"):
        client.load_async(cache, keys, [12, 13, 14, 15]).cancel(timeout=-1)


def test_a_load_by_layer_is_waited_for_layer_by_layer(client: kvtier.Client) -> None:
    layout = kvtier.Layout("test/by-layer", 6, 2, 16, "fp16", 4)
    cpu = kvtier.CpuKvCache(layout, 16)
    cache = client.register_cpu_cache(cpu)
    keys = client.compute_keys(cache, prompt(23, 4))[:4]
    blocks = np.asarray(cpu)
    rng = np.random.default_rng(3)
    blocks[:4] = rng.integers(0, 255, size=blocks[:4].shape, dtype=np.uint8)
    assert client.store(cache, keys, [0, 1, 2, 3]).blocks == 4
    op = client.load_async(cache, keys, [8, 9, 10, 11], by_layer=True)
    layer_bytes = blocks.shape[1] // 6  # the canonical layout: a block's layers in order
    for layers in range(1, 7):
        assert op.wait_layers(layers, timeout=30) is True
        assert np.array_equal(blocks[8:12, : layers * layer_bytes], blocks[0:4, : layers * layer_bytes]), layers
    assert op.wait(timeout=10).blocks == 4
    assert np.array_equal(blocks[8:12], blocks[0:4])
    assert op.wait_layers(1) is False  # its result was taken: over
    whole = client.load_async(cache, keys, [12, 13, 14, 15])
    with pytest.raises(kvtier.InvalidArgumentError, match="LoadLayersAsync"):
        whole.wait_layers(1)
    assert whole.wait(timeout=10).blocks == 4


def test_a_store_by_layer_copies_each_layer_once_written(client: kvtier.Client) -> None:
    layout = kvtier.Layout("test/store-by-layer", 6, 2, 16, "fp16", 4)
    cpu = kvtier.CpuKvCache(layout, 16)
    cache = client.register_cpu_cache(cpu)
    keys = client.compute_keys(cache, prompt(24, 4))[:4]
    blocks = np.asarray(cpu)
    rng = np.random.default_rng(4)
    written = rng.integers(0, 255, size=blocks[:4].shape, dtype=np.uint8)
    blocks[:4] = 0x5A  # nonsense until each layer is written
    op = client.store_async(cache, keys, [0, 1, 2, 3], by_layer=True)
    layer_bytes = blocks.shape[1] // 6
    for layer in range(6):
        span = slice(layer * layer_bytes, (layer + 1) * layer_bytes)
        blocks[:4, span] = written[:, span]
        op.layers_written(layer + 1)
    assert op.wait(timeout=10).blocks == 4
    op.layers_written(6)  # over: nothing to do
    assert client.load(cache, keys, [8, 9, 10, 11]).blocks == 4
    assert np.array_equal(blocks[8:12], written)
    assert client.stats()["counters"]["stores_by_layer"] >= 1
    whole = client.store_async(cache, keys, [0, 1, 2, 3])
    with pytest.raises(kvtier.InvalidArgumentError, match="StoreLayersAsync"):
        whole.layers_written(1)
    assert whole.wait(timeout=10).already == 4


def test_timeouts_must_be_finite_and_two_threads_may_wait_on_one_op(daemon: Daemon, client: kvtier.Client) -> None:
    cpu = kvtier.CpuKvCache(small_layout(), 16)
    cache = client.register_cpu_cache(cpu)
    keys = client.compute_keys(cache, prompt(17, 4))
    op = client.store_async(cache, keys, [0, 1, 2, 3])
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(kvtier.InvalidArgumentError, match="finite"):
            op.wait(timeout=bad)
        with pytest.raises(kvtier.InvalidArgumentError, match="finite"):
            op.cancel(timeout=bad)
        with pytest.raises(kvtier.InvalidArgumentError, match="call_timeout"):
            kvtier.Client.connect(daemon.socket, call_timeout=bad)
    assert op.wait(timeout=10).blocks == 4  # the refused calls changed nothing
    # Two threads wait on each op: one gets its result, the other an error
    # saying it is over; nothing crashes, whatever the interleaving.
    for attempt in range(50):
        load = client.load_async(cache, keys, [4, 5, 6, 7])
        results: list[object] = []

        def wait() -> None:
            try:
                results.append(load.wait(timeout=10).blocks)
            except kvtier.Error as error:
                results.append(type(error))

        threads = [threading.Thread(target=wait) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results.count(4) == 1, (attempt, results)
        assert all(r == 4 or issubclass(r, (kvtier.FailedPreconditionError, kvtier.NotFoundError)) for r in results), results


def test_bad_input_is_a_clear_exception(daemon: Daemon, client: kvtier.Client) -> None:
    layout = small_layout()
    cpu = kvtier.CpuKvCache(layout, 8)
    cache = client.register_cpu_cache(cpu)
    keys = client.compute_keys(cache, prompt(8, 2))

    with pytest.raises(kvtier.InvalidArgumentError, match="differ in length"):
        client.store(cache, keys, [0])
    with pytest.raises(kvtier.InvalidArgumentError, match="out of range"):
        client.load(cache, keys, [0, 8])
    with pytest.raises(kvtier.InvalidArgumentError, match="16"):
        client.lookup(cache, [b"short"])
    with pytest.raises(TypeError):
        client.lookup(cache, ["not bytes"])
    with pytest.raises(kvtier.InvalidArgumentError, match="out of range"):
        client.compute_keys(cache, [-1] * 16)
    with pytest.raises(kvtier.InvalidArgumentError, match="integer array"):
        client.compute_keys(cache, np.zeros(16, dtype=np.float32))
    with pytest.raises(TypeError):
        client.compute_keys(cache, [1.5] * 16)
    with pytest.raises(kvtier.InvalidArgumentError):
        kvtier.Layout("m", 0, 2, 64, "bf16", 16)
    with pytest.raises(kvtier.InvalidArgumentError):
        kvtier.Layout("m", 2, 2, 64, "int4", 16)
    with pytest.raises(kvtier.InvalidArgumentError, match="unknown scheme"):
        kvtier.placements(layout, 8, "nope")
    assert isinstance(kvtier.InvalidArgumentError("x"), ValueError)

    shape = (2, 8, 16, 2, 64)
    with pytest.raises(kvtier.InvalidArgumentError, match="holds float32"):
        client.register_tensors(layout, 8, [torch.zeros(shape), torch.zeros(shape)], "vllm_nhd")
    strided = torch.zeros((2, 8, 16, 64, 2), dtype=torch.bfloat16).transpose(3, 4)
    with pytest.raises(kvtier.InvalidArgumentError, match="not contiguous"):
        client.register_tensors(layout, 8, [strided, strided], "vllm_nhd")
    with pytest.raises(kvtier.InvalidArgumentError, match="region"):
        # Tensors too small for the placements: the daemon's checks say so.
        client.register_tensors(layout, 8, [torch.zeros(16, dtype=torch.bfloat16)] * 1, "vllm_nhd")

    other = kvtier.Client.connect(daemon.socket)
    with pytest.raises(kvtier.InvalidArgumentError, match="another client"):
        other.lookup(cache, keys)
    other.close()

    client.close()
    assert client.closed
    with pytest.raises(kvtier.FailedPreconditionError, match="closed"):
        client.lookup(cache, keys)
    client.close()  # twice is fine


def test_a_codec_is_asked_for_at_registration_and_the_tenant_must_allow_it(client: kvtier.Client) -> None:
    layout = small_layout()
    cpu = kvtier.CpuKvCache(layout, 8)
    # The default tenant allows none and lossless; fp8 (lossy) only where listed.
    lossless = client.register_cpu_cache(cpu, codec="lossless")
    keys = client.compute_keys(lossless, prompt(9, 2))
    np.asarray(cpu)[0:2] = 5
    assert client.store(lossless, keys, [0, 1]).blocks == 2
    with pytest.raises(kvtier.PermissionDeniedError, match="tenants"):
        client.register_cpu_cache(cpu, codec="fp8")
    with pytest.raises(kvtier.InvalidArgumentError, match="unknown codec"):
        client.register_cpu_cache(cpu, codec="zip")
    with pytest.raises(kvtier.InvalidArgumentError, match="fp8 only"):
        client.register_cpu_cache(cpu, codec="lossless", fp8_group=32)
    # A cache without a codec shares the lossless blocks: they are exact.
    plain = client.register_cpu_cache(cpu)
    assert client.lookup(plain, keys).hits == 2


def test_blocking_waits_release_the_gil(daemon: Daemon, client: kvtier.Client) -> None:
    cpu = kvtier.CpuKvCache(small_layout(), 8)
    cache = client.register_cpu_cache(cpu)
    keys = client.compute_keys(cache, prompt(9, 2))
    assert daemon.process is not None
    os.kill(daemon.process.pid, signal.SIGSTOP)  # every call now waits
    try:
        done = threading.Event()

        def blocked_lookup() -> None:
            try:
                client.lookup(cache, keys)
            except kvtier.Error:
                pass
            done.set()

        thread = threading.Thread(target=blocked_lookup)
        thread.start()
        # While that thread waits on the daemon, this one runs Python.
        counted = 0
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            counted += 1
        assert not done.is_set(), "the lookup did not wait on the stopped daemon"
        assert counted > 10000, "the waiting call held the GIL"
    finally:
        os.kill(daemon.process.pid, signal.SIGCONT)
    thread.join(timeout=30)
    assert done.is_set()


def test_a_daemon_restart_is_a_miss_then_the_client_reconnects(daemon: Daemon, client: kvtier.Client) -> None:
    cpu = kvtier.CpuKvCache(small_layout(), 8)
    cache = client.register_cpu_cache(cpu)
    keys = client.compute_keys(cache, prompt(10, 2))
    assert client.store(cache, keys, [0, 1]).blocks == 2
    daemon.stop(signal.SIGKILL)
    with pytest.raises(kvtier.UnavailableError) as error:
        client.lookup(cache, keys)
    assert isinstance(error.value, ConnectionError) and error.value.code == "Unavailable"
    daemon.start()
    deadline = time.monotonic() + 10
    while True:
        try:
            hit = client.lookup(cache, keys)  # the same handle, re-registered by the client
            break
        except kvtier.UnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert hit.hits == 0  # host memory did not survive the kill
    assert client.store(cache, keys, [0, 1]).blocks == 2


def test_lookups_prefetches_and_hints_of_any_length_split_to_what_the_daemon_takes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = Daemon(str(tmp_path), ["limits.max_keys_per_request=16"])
    d.start()
    try:
        with kvtier.Client.connect(d.socket, name="pytest") as c:
            assert c.max_keys_per_request == 16
            layout = small_layout()
            cache = c.register_cpu_cache(kvtier.CpuKvCache(layout, 64))
            keys = c.compute_keys(cache, list(range(50 * layout.block_tokens)))
            assert c.lookup(cache, keys).hits == 0
            for start in range(0, 40, 16):  # the first 40 blocks, in ops of 16
                c.store(cache, keys[start : min(start + 16, 40)], list(range(start, min(start + 16, 40))))
            result = c.lookup(cache, keys)
            assert result.hits == 40 and result.tiers == ["host"] * 40
            assert c.prefetch(cache, keys) == 40
            assert c.hint(cache, keys, priority=1) == {"hinted": 40, "refused": 0}
            with pytest.raises(kvtier.InvalidArgumentError, match="max_keys_per_request"):
                c.load(cache, keys[:17], list(range(17)))
    finally:
        d.stop()


def test_stats_and_engine_hashes(client: kvtier.Client) -> None:
    cpu = kvtier.CpuKvCache(small_layout(), 8)
    cache = client.register_cpu_cache(cpu)
    stats = client.stats()
    assert {t["tier"] for t in stats["tiers"]} >= {"host"}
    assert "counters" in stats and stats["sessions"] >= 1
    # One version string: the package's, libkvtier's and the daemon's.
    assert re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+", kvtier.__version__)
    assert client.daemon_release == kvtier.__version__
    assert stats["release"] == kvtier.__version__

    sha = bytes(range(32))
    key = client.key_from_engine_hash(cache, sha)
    assert len(key) == 16 and client.key_from_engine_hash(cache, sha) == key
    assert client.key_from_engine_hash(cache, kvtier.engine_hash_bytes(12345)) != key
    assert kvtier.engine_hash_bytes(1) == (1).to_bytes(16, "little")
    assert kvtier.engine_hash_bytes("ab" * 32) == b"\xab" * 32  # SGLang's hex page hashes
    assert kvtier.engine_hash_bytes(b"x" * 8) == hashlib.sha256(b"x" * 8).digest()  # other lengths: hashed
    with pytest.raises(TypeError):
        kvtier.engine_hash_bytes(1.5)  # type: ignore[arg-type]
    with pytest.raises(kvtier.InvalidArgumentError):
        client.key_from_engine_hash(cache, b"\x00" * 7)


def test_cuda_memory_without_a_usable_gpu_is_a_clear_error(client: kvtier.Client) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tools/gpu-check.sh runs the CUDA path")
    with pytest.raises(kvtier.Error) as error:
        client.register_cuda_memory(small_layout(), 8, [(0x7F0000000000, 1 << 20)], "contiguous")
    # No CUDA in the build (Unimplemented), no driver (Unavailable), or a
    # pointer that is no device memory (InvalidArgument): never a crash.
    assert error.value.code in ("Unimplemented", "Unavailable", "InvalidArgument"), error.value


def test_the_wheel_runs_the_programs_it_carries() -> None:
    import kvtier.daemon

    with pytest.raises(ValueError, match="no program 'sh'"):
        kvtier.daemon.program("sh")
    try:
        kvtier.daemon.program("kvtierd")
    except FileNotFoundError as e:  # a build tree's package (PYTHONPATH=build/python)
        pytest.skip(str(e))
    assert kvtier.daemon.example_config().is_file()
    assert kvtier.daemon.library().name.startswith("libkvtier.so.")
    daemon = subprocess.run([sys.executable, "-m", "kvtier.daemon", "--version"], capture_output=True, text=True,
                            timeout=30)
    assert daemon.returncode == 0 and daemon.stdout.startswith(f"kvtierd {kvtier.__version__} "), daemon
    # kvtierctl with no daemon at its socket: its own version, and exit 3.
    ctl = subprocess.run([sys.executable, "-c", "import kvtier.daemon; kvtier.daemon.kvtierctl()", "--socket",
                          "/nonexistent/kvtierd.sock", "version"], capture_output=True, text=True, timeout=30)
    assert ctl.returncode == 3 and f"kvtierctl {kvtier.__version__}" in ctl.stdout + ctl.stderr, ctl
