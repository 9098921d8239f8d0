"""PyTorch end to end on a GPU, through CUDA IPC (tools/gpu-check.sh runs it).

One process fills per-layer CUDA KV tensors (vLLM's NHD shape) from a seed
and stores its blocks through a kvtierd on the cuda backend; a second process
registers fresh zeroed tensors, loads the blocks into other block ids, and
compares them with the same seed's bytes on the GPU. Exit status 0 when every
byte matches.

Usage: python3 gpu_e2e.py KVTIERD_PATH   (the kvtier package on sys.path)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

LAYERS, HEADS, HEAD_DIM, BLOCK_TOKENS, NUM_BLOCKS, STORED = 4, 8, 128, 16, 256, 64
SEED = 1234


def tensors(fill: bool):  # type: ignore[no-untyped-def]
    import torch

    shape = (2, NUM_BLOCKS, BLOCK_TOKENS, HEADS, HEAD_DIM)
    out = []
    generator = torch.Generator(device="cuda").manual_seed(SEED)
    for _ in range(LAYERS):
        t = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        if fill:
            t.copy_(torch.randn(shape, generator=generator, device="cuda").to(torch.bfloat16))
        out.append(t)
    torch.cuda.synchronize()
    return out


def engine(mode: str, socket: str) -> int:
    import torch

    import kvtier

    layout = kvtier.Layout("kvtier/gpu-e2e", LAYERS, HEADS, HEAD_DIM, "bf16", BLOCK_TOKENS)
    client = kvtier.Client.connect(socket, name=f"gpu-e2e-{mode}")
    tokens = list(range(1000, 1000 + STORED * BLOCK_TOKENS))
    if mode == "store":
        # Pinned CPU tensors are refused: their pins would stay on the old
        # pages once the memory moved into shared memory.
        shape = (2, NUM_BLOCKS, BLOCK_TOKENS, HEADS, HEAD_DIM)
        pinned = [torch.zeros(shape, dtype=torch.bfloat16).pin_memory() for _ in range(LAYERS)]
        try:
            client.register_tensors(layout, NUM_BLOCKS, pinned, "vllm_nhd")
            print("pinned: registered, which must not be")
            return 1
        except kvtier.InvalidArgumentError as error:
            print(f"pinned: refused ({error})")
        layers = tensors(fill=True)
        cache = client.register_tensors(layout, NUM_BLOCKS, layers, "vllm_nhd")
        assert cache.kind == "cuda", cache
        keys = client.compute_keys(cache, tokens)
        result = client.store(cache, keys, list(range(STORED)))
        print(f"store: {result.blocks} blocks stored, {result.already} already there")
        return 0 if result.blocks + result.already == STORED else 1
    layers = tensors(fill=False)
    cache = client.register_tensors(layout, NUM_BLOCKS, layers, "vllm_nhd")
    keys = client.compute_keys(cache, tokens)
    hit = client.lookup(cache, keys)
    print(f"load: lookup {hit.hits}/{STORED} hits, tiers {sorted(set(hit.tiers))}")
    targets = list(range(NUM_BLOCKS - STORED, NUM_BLOCKS))
    result = client.load(cache, keys, targets)
    torch.cuda.synchronize()
    expected = tensors(fill=True)
    bad = 0
    for layer, (got, want) in enumerate(zip(layers, expected)):
        if not torch.equal(got[:, NUM_BLOCKS - STORED :], want[:, :STORED]):
            bad += 1
            print(f"load: layer {layer} differs")
    block_bytes = layout.block_bytes
    print(f"load: {result.blocks} blocks loaded ({result.blocks * block_bytes >> 20} MiB), {bad} layers differ")
    return 0 if result.blocks == STORED and bad == 0 else 1


# The daemon the end to ends run against: the cuda backend with an hbm tier,
# or (host: the shapes' dry run on a machine without a GPU) the host backend.
DAEMON_SETTINGS = {
    "cuda": ["device.backend=cuda", "tiers.hbm.enabled=true", "tiers.hbm.bytes=512MiB"],
    "host": ["device.backend=host"],
}


def run_with_daemon(kvtierd: str, script: str, modes: list[list[str]], backend: str = "cuda") -> int:
    """Starts kvtierd on a socket of its own, then runs `script` once per
    mode (its arguments, then the socket), each in a process of its own,
    until one fails; prints the daemon's log on failure. The exit status."""
    with tempfile.TemporaryDirectory(prefix="kvtier-gpu-e2e-") as d:
        socket = os.path.join(d, "kvtierd.sock")
        args = [kvtierd, "--foreground"]
        for s in (f"socket.path={socket}", f"state_dir={d}/state", *DAEMON_SETTINGS[backend],
                  "tiers.host.bytes=512MiB", "tiers.disk.enabled=false", "metrics.enabled=false"):
            args += ["--set", s]
        log = open(os.path.join(d, "kvtierd.log"), "wb")
        daemon = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        rc = 1
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(socket):
                if daemon.poll() is not None or time.monotonic() > deadline:
                    print(open(log.name).read())
                    print("kvtierd did not start")
                    return 1
                time.sleep(0.05)
            for mode in modes:
                rc = subprocess.call([sys.executable, script, *mode, socket], timeout=120)
                if rc != 0:
                    break
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
            log.close()
        if rc != 0:
            print(open(log.name).read()[-4000:])
        return rc


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] in ("store", "load"):
        return engine(sys.argv[1], sys.argv[2])
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    rc = run_with_daemon(sys.argv[1], __file__, [["store"], ["load"]])
    print("torch e2e: " + ("PASS (stored by one process, loaded by another through CUDA IPC, byte-exact)"
                           if rc == 0 else "FAIL"))
    return rc


if __name__ == "__main__":
    sys.exit(main())
