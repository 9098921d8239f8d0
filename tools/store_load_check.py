"""Stores blocks through a kvtierd and loads them back, byte-exact: the
packaging checks' client (tools/wheel-bare-root.sh in a bare root, with the
wheel; tools/wheel-check.sh in a fresh venv of each wheel's Python;
tools/image-check.sh outside the image's container).

Usage: python store_load_check.py SOCKET NAME   (the kvtier package importable;
NAME names the layout's model). Blocks 0-7 of a CpuKvCache, a pattern each,
are stored, found by lookup, loaded into blocks 8-15 and compared. Exit
status 0 when every byte matches.
"""

import sys

import kvtier

socket, name = sys.argv[1], sys.argv[2]
client = kvtier.Client.connect(socket, name=name)
assert client.daemon_release == kvtier.__version__, (client.daemon_release, kvtier.__version__)
layout = kvtier.Layout(f"kvtier/{name}", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", block_tokens=16)
cpu = kvtier.CpuKvCache(layout, 16)
pages = memoryview(cpu).cast("B")
block = layout.block_bytes
for i in range(8):  # blocks 0-7: a pattern of their own each
    pages[i * block : (i + 1) * block] = bytes((i * 31 + j) % 251 for j in range(block))
cache = client.register_cpu_cache(cpu)
keys = client.compute_keys(cache, list(range(1000, 1000 + 8 * 16)))
assert client.lookup(cache, keys).hits == 0
assert client.store(cache, keys, list(range(8))).blocks == 8
assert client.lookup(cache, keys).hits == 8
assert client.load(cache, keys, list(range(8, 16))).blocks == 8
assert pages[8 * block :] == pages[: 8 * block], "the blocks loaded differ from those stored"
print(f"{name}: stored and loaded 8 blocks of {block} bytes through kvtierd {client.daemon_release}")
