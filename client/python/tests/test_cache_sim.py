"""client/python/bench/cache_sim.py, whose figures docs/engines.md quotes:
its table comes back as written there, and its model of vLLM's block pool
keeps what vLLM does (a prompt's blocks reused by the next request with
the same prefix, evicted last block first)."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "bench" / "cache_sim.py"


def _module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("cache_sim", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up)
    spec.loader.exec_module(module)
    return module


def test_the_table_docs_engines_md_quotes_comes_back() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--offload-blocks", "163", "192"], capture_output=True, text=True, check=True)
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()[1:]}
    # vllm-same-memory, duplicates, exclusive, keep-ideal, keep, keep-pending
    assert rows["163"] == ["80.8%", "65.8%", "79.8%", "77.1%", "56.1%", "77.1%"]
    assert rows["192"] == ["83.2%", "77.3%", "82.2%", "79.0%", "65.6%", "79.0%"]
    issue = ["--conversations", "20", "--turns", "4", "--system-tokens", "1536", "--user-tokens", "128"]
    out = subprocess.run([sys.executable, str(SCRIPT), *issue, "--offload-blocks", "163", "192"], capture_output=True, text=True, check=True)
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()[1:]}
    assert rows["163"] == ["77.6%", "0.0%", "39.6%", "65.4%", "65.4%", "65.4%"]
    assert rows["192"] == ["77.6%", "0.0%", "39.6%", "76.9%", "76.9%", "76.9%"]


def test_vllms_block_pool_reuses_a_prefix_and_evicts_a_requests_last_block_first() -> None:
    sim = _module()
    pool = sim.VllmCache(4)
    dropped: list[int] = []
    pool.on_drop = dropped.append
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache(b, 100 + i)
    pool.release(blocks)
    # The same prefix again: its cached blocks, all but a last token's.
    assert pool.hit([100, 101, 102], 3 * sim.BLOCK + 1) == blocks
    pool.release(blocks)
    # Two new blocks: the free one first, then the prefix's last block.
    pool.allocate(2)
    assert dropped == [102]
