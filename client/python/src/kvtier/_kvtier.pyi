"""Stubs of kvtier._kvtier, the binding of libkvtier (python/src/module.cc)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy.typing as npt

Tokens = Sequence[int] | npt.NDArray[Any]
BlockIds = Sequence[int] | npt.NDArray[Any]
PlacementsArg = str | Sequence[Placement]

__version__: str

class Layout:
    """The shape of one engine's KV cache block; its fingerprint names a namespace."""

    def __init__(
        self,
        model_id: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
        block_tokens: int,
        kv_kind: str = "kv",
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None: ...
    @property
    def model_id(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def kv_kind(self) -> str: ...
    @property
    def block_tokens(self) -> int: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def tensor_bytes(self) -> int: ...
    @property
    def fingerprint(self) -> str: ...

class Placement:
    """Where one (layer, K/V) piece of engine block b lives."""

    region: int
    offset_bytes: int
    block_stride_bytes: int
    token_stride_bytes: int
    head_stride_bytes: int
    def __init__(
        self,
        region: int,
        offset_bytes: int,
        block_stride_bytes: int,
        token_stride_bytes: int,
        head_stride_bytes: int,
    ) -> None: ...

def default_socket() -> str: ...
def default_socket_candidates() -> list[str]: ...
def placements(layout: Layout, num_blocks: int, scheme: str) -> list[Placement]:
    """contiguous, vllm_nhd, vllm_hnd, sglang_layer_first or sglang_page_first."""

class CpuKvCache:
    """Shared memory kvtier allocates; a (num_blocks, block_bytes) uint8 buffer."""

    def __init__(self, layout: Layout, num_blocks: int) -> None: ...
    @property
    def layout(self) -> Layout: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

class KvCache:
    """A KV cache registered with a Client."""

    @property
    def id(self) -> int: ...
    @property
    def layout(self) -> Layout: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def kind(self) -> str: ...

class LookupResult:
    @property
    def hits(self) -> int: ...
    @property
    def tiers(self) -> list[str]: ...
    @property
    def recompute(self) -> int: ...

class OpResult:
    @property
    def blocks(self) -> int: ...
    @property
    def already(self) -> int: ...

class Op:
    """An async load or store: wait() for its result once."""

    def wait(self, timeout: float | None = None) -> OpResult: ...
    def cancel(self, timeout: float | None = None) -> None: ...
    def wait_layers(self, layers: int, timeout: float | None = None) -> bool: ...
    def stream_wait_layers(self, layers: int, stream: int) -> None: ...
    def layers_written(self, layers: int) -> None: ...
    @property
    def done(self) -> bool: ...

class Client:
    """A connection to kvtierd; UnavailableError while the daemon is down is a miss."""

    @staticmethod
    def connect(
        socket_path: str,
        token: str | None = None,
        name: str = "",
        reconnect_interval: float = 0.2,
        call_timeout: float | None = None,
    ) -> Client: ...
    def close(self) -> None: ...
    def __enter__(self) -> Client: ...
    def __exit__(self, *exc: object) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def tenant(self) -> str: ...
    @property
    def daemon_release(self) -> str: ...
    @property
    def connected(self) -> bool: ...
    @property
    def max_keys_per_request(self) -> int: ...
    def register_cpu_cache(self, cache: CpuKvCache) -> KvCache: ...
    def register_host_memory(
        self,
        layout: Layout,
        num_blocks: int,
        regions: Sequence[tuple[int, int]],
        placements: PlacementsArg,
        *,
        codec: str = "none",
        fp8_group: int = 0,
        same_memory_as: KvCache | None = None,
    ) -> KvCache: ...
    def register_cuda_memory(
        self, layout: Layout, num_blocks: int, regions: Sequence[tuple[int, int]], placements: PlacementsArg
    ) -> KvCache: ...
    def register_tensors(
        self, layout: Layout, num_blocks: int, tensors: Sequence[Any], placements: PlacementsArg
    ) -> KvCache: ...
    def compute_keys(self, cache: KvCache, tokens: Tokens, parent: bytes | None = None) -> list[bytes]: ...
    def key_from_engine_hash(self, cache: KvCache, hash: bytes) -> bytes: ...
    def lookup(self, cache: KvCache, keys: Sequence[bytes], *, prefill_tokens_per_s: float = 0.0) -> LookupResult: ...
    def prefetch(self, cache: KvCache, keys: Sequence[bytes], *, prefill_tokens_per_s: float = 0.0) -> int: ...
    def load(self, cache: KvCache, keys: Sequence[bytes], block_ids: BlockIds, *, engine_holds: bool = False) -> OpResult: ...
    def store(
        self,
        cache: KvCache,
        keys: Sequence[bytes],
        block_ids: BlockIds,
        parent: bytes | None = None,
        *,
        engine_hashes: Sequence[bytes | int] | None = None,
        parent_hash: bytes | int | None = None,
        token_ids: Sequence[int] | None = None,
        block_size: int = 0,
        lora_name: str | None = None,
        priority: int = 0,
        next_use_ms: int = 0,
        last_partial: bool = False,
        engine_holds: bool = False,
    ) -> OpResult: ...
    def hint(
        self,
        cache: KvCache,
        keys: Sequence[bytes],
        *,
        priority: int = 0,
        next_use_ms: int = 0,
        session_over: bool = False,
        engine_dropped: bool = False,
    ) -> dict[str, int]: ...
    def load_async(
        self, cache: KvCache, keys: Sequence[bytes], block_ids: BlockIds, *, by_layer: bool = False, engine_holds: bool = False
    ) -> Op: ...
    def store_async(
        self,
        cache: KvCache,
        keys: Sequence[bytes],
        block_ids: BlockIds,
        parent: bytes | None = None,
        *,
        engine_hashes: Sequence[bytes | int] | None = None,
        parent_hash: bytes | int | None = None,
        token_ids: Sequence[int] | None = None,
        block_size: int = 0,
        lora_name: str | None = None,
        priority: int = 0,
        next_use_ms: int = 0,
        last_partial: bool = False,
        by_layer: bool = False,
        engine_holds: bool = False,
    ) -> Op: ...
    def stats(self) -> dict[str, Any]: ...
    def evict(self, tenant: str = "", tier: str | None = None) -> int: ...
    def flush(self) -> int: ...
