"""SGLang HiCache storage backend over kvtierd: ``kvtier.sglang:KvtierStore``.

SGLang's hierarchical cache keeps KV pages on the GPU (L1) and in a host pool
(L2); a storage backend is its third level. KvtierStore makes the node's
kvtierd that level: pages go from SGLang's host pool to the daemon and back,
keyed by SGLang's own page hashes, shared by the tenant's engines on the node.

Configuration (SGLang 0.5.23)::

    python -m sglang.launch_server --model-path ... --page-size 64 \\
        --enable-hierarchical-cache --hicache-mem-layout page_first \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
            "module_path": "kvtier.sglang", "class_name": "KvtierStore",
            "interface_v1": 1, "kvtier_socket": "/run/kvtier/kvtierd.sock"}'

- ``backend_name``, ``module_path``, ``class_name``: SGLang's
  ``StorageBackendFactory`` imports the class, checks that it subclasses
  ``HiCacheStorage`` and builds it as ``KvtierStore(storage_config, kwargs)``.
- ``"interface_v1": 1`` is required: without it SGLang's cache controller
  takes its tensor-copying path (``batch_get``/``batch_set``), which this
  backend does not serve, so the constructor refuses such a config.
- ``kvtier_socket``: the daemon's socket (default ``kvtier.default_socket()``:
  ``$KVTIER_SOCKET``, else where a kvtierd listens of ``/run/kvtier``,
  ``$XDG_RUNTIME_DIR/kvtier`` and ``./var/kvtier``, as kvtierd picks its own); ``kvtier_token``: the tenant's token where
  the daemon names tenants by token (default ``$KVTIER_TOKEN``);
  ``kvtier_model_id``: the namespace's model name (default SGLang's model
  name); ``kvtier_bounce_bytes``: see Memory (default 64 MiB);
  ``kvtier_timeout_s``: the longest a call waits on the daemon (default 10).
- MHA and MLA models, host layouts ``page_first`` (SGLang's default),
  ``page_first_direct`` and ``layer_first``. An MLA pool (one latent per
  token, the same on every TP rank) is one namespace at any TP size: SGLang
  has its first rank alone store it, and every rank loads it. Not the extra
  host pools of hybrid models (Mamba, SWA, indexer, draft): attachment fails
  with NotImplementedError naming what is missing.

Who calls what: SGLang's cache controller (``managers/cache_controller.py``)
builds the backend through the factory and calls
``register_mem_pool_host(host_pool)`` once. Its prefetch thread asks
``batch_exists(keys)`` how many leading pages are stored, its prefetch I/O
thread loads them with ``batch_get_v1(keys, host_indices)``, and its backup
thread stores pages with ``batch_set_v1(keys, host_indices)``; batches of at
most 128 pages. A key is a page's hex SHA-256 chain hash; ``host_indices``
holds the pool's token slots, ``page_size`` per key. Each key becomes a kvtier
key through ``Client.key_from_engine_hash`` in a namespace of the model name,
the pool's geometry and dtype, and the TP (and PP, context-parallel) rank.

Memory: the daemon copies pages straight into and out of the host pool when
kvtier can share the pool's memory in place (``Client.register_tensors``:
anonymous private memory that is not pinned). SGLang's pool is usually
neither: its allocator maps it shared, and on a GPU it is pinned with
``cudaHostRegister`` (moving pinned pages would leave the GPU copying to the
old ones). Then pages pass through a bounce buffer kvtier allocates
(``kvtier.CpuKvCache``, ``kvtier_bounce_bytes`` for loads and as much for
stores): one extra host memcpy per page. ``mode`` says which.

Failures: the calls never raise for the daemon's sake. While kvtierd is
down (or refuses a store for lack of room) pages are misses: ``batch_exists``
counts 0, ``batch_get_v1``/``batch_set_v1`` report False; logged once until
it answers again. A page is True only when the daemon said it loaded (or
stored) it; a load stops at the first miss and leaves later pages alone.
Malformed input (lengths, indices that are not whole pages) raises
ValueError or TypeError.

A daemon that hangs costs one call ``kvtier_timeout_s``: the call cancels
its copies without the daemon (a fence both share: once cancelled, the
daemon never writes those pages), reports its pages missed, and later calls
are misses at once for 1 s, doubling to 30 s while it stays hung. Only a
daemon stopped in the middle of a copy (microseconds) makes the cancel wait
for that copy, up to the timeout once more; past it the call fails the same
way and the pages may still be written once the daemon continues.

Thread-safe: the controller's threads call in concurrently. Every call that
waits on the daemon releases the GIL.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Union

import torch
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

import kvtier

from . import _TORCH_DTYPES
from ._hung import HungPause

logger = logging.getLogger(__name__)

DEFAULT_BOUNCE_BYTES = 64 << 20
# The longest a call waits on kvtierd (kvtier_timeout_s): then its copies are
# cancelled, its pages are misses, and the daemon is left alone a while.
DEFAULT_TIMEOUT_S = 10.0
# Keys per load or store, at most: fewer where the daemon takes fewer per
# request (its max_keys_per_request).
_MAX_KEYS_PER_CALL = 1024
# Seconds between attempts to connect while the daemon has never answered
# (once connected, the client reconnects by itself).
_CONNECT_RETRY_S = 1.0

_NO_TENSOR_API = (
    "kvtier.sglang.KvtierStore moves pages only through SGLang's zero-copy "
    'interface (batch_exists, batch_get_v1, batch_set_v1; "interface_v1": 1 in '
    "--hicache-storage-backend-extra-config), not through tensor get/set"
)
_NO_HYBRID = (
    "kvtier.sglang.KvtierStore stores the KV pool of MHA and MLA models only; the extra host "
    "pools of hybrid models (Mamba, SWA, indexer, draft) are not supported"
)

# Moves pages between the host pool and the daemon: (client, cache, keys,
# pages, parent key) -> how many leading pages moved; kvtier.Error if refused.
_Move = Callable[[kvtier.Client, kvtier.KvCache, List[bytes], List[int], Optional[bytes]], int]



def _engine_hash(key: Union[str, bytes]) -> bytes:
    """One SGLang page key (a hex SHA-256 str) as the bytes key_from_engine_hash takes."""
    if not isinstance(key, (str, bytes, bytearray)):
        raise TypeError(f"a HiCache key is a str (hex page hash), not {type(key).__name__}")
    return kvtier.engine_hash_bytes(key)

@dataclass(frozen=True)
class _HostPool:
    """SGLang's host pool (``pool_host/mha.py``, ``pool_host/mla.py``): its
    kv_buffer, checked.

    MHA kv_buffer shapes, for P pages of T tokens, L layers, H heads, D dims:
    page_first [2, P*T, L, H, D], layer_first [2, L, P*T, H, D],
    page_first_direct [2, P, L, T, H, D]; index 0 is K, 1 is V. MLA (one
    latent of D = kv_lora_rank + qk_rope_head_dim per token, the same on
    every TP rank): page_first [P*T, L, 1, D], layer_first [L, P*T, 1, D],
    page_first_direct [P, L, T, 1, D].
    """

    buffer: torch.Tensor
    layout: str
    num_pages: int
    page_tokens: int
    num_layers: int
    num_heads: int
    head_dim: int
    latent: bool

    @classmethod
    def of(cls, host: Any) -> _HostPool:
        """Raises NotImplementedError for a pool kind or layout kvtier does
        not store, ValueError for a kv_buffer that is not the pool's shape."""
        buffer = getattr(host, "kv_buffer", None)
        if not isinstance(buffer, torch.Tensor):
            raise NotImplementedError(
                f"{_NO_HYBRID}: the host pool {type(host).__name__} has no single kv_buffer tensor"
            )
        layout = getattr(host, "layout", None)
        if layout not in ("page_first", "page_first_direct", "layer_first"):
            raise NotImplementedError(
                f"kvtier.sglang.KvtierStore does not support --hicache-mem-layout {layout}; "
                "use page_first (the default), page_first_direct or layer_first"
            )
        latent = hasattr(host, "kv_lora_rank")
        t, n_layers = host.page_size, host.layer_num
        if latent:
            heads, dim = 1, host.kv_lora_rank + host.qk_rope_head_dim
        else:
            heads, dim = host.head_num, host.head_dim
            if getattr(host, "v_head_dim", dim) != dim:
                raise NotImplementedError(
                    f"kvtier.sglang.KvtierStore needs V heads as wide as K heads ({host.v_head_dim} != {dim})"
                )
        kv = () if latent else (2,)  # MHA's K/V dimension leads
        if buffer.dim() != len(kv) + (5 if layout == "page_first_direct" else 4):
            raise ValueError(f"the {layout} host pool's kv_buffer has shape {tuple(buffer.shape)}")
        if layout == "page_first":
            pages = buffer.shape[len(kv)] // t
            shape = (*kv, pages * t, n_layers, heads, dim)
        elif layout == "layer_first":
            pages = buffer.shape[len(kv) + 1] // t
            shape = (*kv, n_layers, pages * t, heads, dim)
        else:
            pages = buffer.shape[len(kv)]
            shape = (*kv, pages, n_layers, t, heads, dim)
        if tuple(buffer.shape) != shape or pages == 0:
            raise ValueError(
                f"the {layout} host pool's kv_buffer has shape {tuple(buffer.shape)}, not {shape}"
            )
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("the host pool's kv_buffer must be a contiguous CPU tensor")
        return cls(buffer, layout, pages, t, n_layers, heads, dim, latent)

    def page(self, p: int) -> torch.Tensor:
        """Page p as a [2, layers, tokens, heads, head_dim] view of kv_buffer
        (MLA: [layers, tokens, head_dim])."""
        t = self.page_tokens
        if self.latent:
            if self.layout == "page_first":
                return self.buffer[p * t : (p + 1) * t, :, 0].transpose(0, 1)
            if self.layout == "layer_first":
                return self.buffer[:, p * t : (p + 1) * t, 0]
            return self.buffer[p, :, :, 0]
        if self.layout == "page_first":
            return self.buffer[:, p * t : (p + 1) * t].transpose(1, 2)
        if self.layout == "layer_first":
            return self.buffer[:, :, p * t : (p + 1) * t]
        return self.buffer[:, p]

    def registration(self) -> tuple[list[torch.Tensor], Union[str, list[kvtier.Placement]]]:
        """The tensors and placements that register kv_buffer in place,
        engine block b being page b."""
        item = self.buffer.element_size()
        if self.latent:
            # One piece per layer: page p's token j of layer i.
            row = self.head_dim * item
            t, n = self.page_tokens, self.num_layers
            block, token, layer = {
                "page_first": (t * n * row, n * row, row),
                "layer_first": (t * row, row, self.num_pages * t * row),
                "page_first_direct": (n * t * row, row, t * row),
            }[self.layout]
            return [self.buffer], [kvtier.Placement(0, i * layer, block, token, row) for i in range(n)]
        if self.layout == "page_first":
            return [self.buffer], "sglang_page_first"
        if self.layout == "layer_first":
            # kvtier's sglang_layer_first: K of layer i is region 2i, V 2i+1.
            return [self.buffer[kv, i] for i in range(self.num_layers) for kv in (0, 1)], "sglang_layer_first"
        # page_first_direct; pieces layer by layer, K then V.
        row = self.num_heads * self.head_dim * item
        piece = self.page_tokens * row  # one layer's K (or V) of one page
        page = self.num_layers * piece
        placements = [
            kvtier.Placement(0, kv * self.num_pages * page + i * piece, page, row, self.head_dim * item)
            for i in range(self.num_layers)
            for kv in (0, 1)
        ]
        return [self.buffer], placements


class _Bounce:
    """Shared memory kvtier allocates, in blocks of the canonical order
    [layers, K/V, tokens, heads, head_dim]: blocks 0 .. pages-1 for loads,
    pages .. 2*pages-1 for stores, each half used under its own lock."""

    def __init__(self, layout: kvtier.Layout, pool: _HostPool, budget_bytes: int) -> None:
        self.pages = max(1, min(STORAGE_BATCH_SIZE, budget_bytes // layout.block_bytes))
        self.memory = kvtier.CpuKvCache(layout, 2 * self.pages)
        raw = torch.frombuffer(self.memory, dtype=torch.uint8).view(pool.buffer.dtype)
        self._latent = pool.latent
        if pool.latent:
            self._blocks = raw.view(2 * self.pages, pool.num_layers, pool.page_tokens, pool.head_dim)
        else:
            self._blocks = raw.view(
                2 * self.pages, pool.num_layers, 2, pool.page_tokens, pool.num_heads, pool.head_dim
            )
        self.load_lock = threading.Lock()
        self.store_lock = threading.Lock()

    def block(self, b: int) -> torch.Tensor:
        """Block b as a [2, layers, tokens, heads, head_dim] view (MLA:
        [layers, tokens, head_dim]), as _HostPool.page."""
        return self._blocks[b] if self._latent else self._blocks[b].transpose(0, 1)


def _is_pinned(host: Any, buffer: torch.Tensor) -> bool:
    """Whether the pool is (or will be) page-locked for the GPU."""
    if getattr(host, "pin_memory", False) or getattr(buffer, "_sglang_cuda_host_registered_ranges", None):
        return True
    try:
        return bool(buffer.is_pinned())
    except RuntimeError:  # no accelerator runtime to ask
        return False


class KvtierStore(HiCacheStorage):
    """SGLang HiCache storage backed by the node's kvtierd (module docs)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        """Connects to kvtierd (or retries later, if it is down).

        Raises ValueError for an extra config without ``interface_v1`` or
        with a bad ``kvtier_bounce_bytes``.
        kwargs: what the factory passes along; unused.
        """
        extra = dict(storage_config.extra_config or {})
        if not extra.get("interface_v1"):
            raise ValueError(
                "kvtier.sglang.KvtierStore serves only SGLang's zero-copy page interface: add "
                '"interface_v1": 1 to --hicache-storage-backend-extra-config'
            )
        bounce_bytes = int(extra.get("kvtier_bounce_bytes", DEFAULT_BOUNCE_BYTES))
        if bounce_bytes <= 0:
            raise ValueError(f"kvtier_bounce_bytes must be positive, not {bounce_bytes}")
        timeout_s = float(extra.get("kvtier_timeout_s", DEFAULT_TIMEOUT_S))
        if not timeout_s > 0:
            raise ValueError(f"kvtier_timeout_s must be positive, not {timeout_s}")
        # Load or recompute (docs/policy.md): HiCache tells a storage backend
        # nothing of the engine's prefill rate, so an operator may give it.
        prefill = float(extra.get("kvtier_prefill_tokens_per_s", 0))
        if not prefill >= 0 or prefill == float("inf"):
            raise ValueError(f"kvtier_prefill_tokens_per_s must be 0 (every hit) or a positive rate, not {prefill}")
        self._prefill_tokens_per_s = prefill
        self._config = storage_config
        # Unnamed: kvtier.default_socket() ($KVTIER_SOCKET, else where a
        # kvtierd listens), resolved again at each attempt to connect.
        self._named_socket: Optional[str] = str(extra["kvtier_socket"]) if extra.get("kvtier_socket") else None
        self._socket = self._named_socket or kvtier.default_socket()
        self._token: Optional[str] = extra.get("kvtier_token") or os.environ.get("KVTIER_TOKEN") or None
        self._bounce_bytes = bounce_bytes
        self._timeout_s = timeout_s
        self._model_id = str(extra.get("kvtier_model_id") or storage_config.model_name or "sglang")
        self._lock = threading.Lock()  # connecting and registering
        self._client: Optional[kvtier.Client] = None
        self._next_connect = 0.0
        self._closed = False
        self._pool: Optional[_HostPool] = None
        self._bounce: Optional[_Bounce] = None
        self._cache: Optional[kvtier.KvCache] = None
        self._failing: set[str] = set()  # status codes logged since the last success
        self._hung = HungPause()  # misses for a while after a call timed out
        self._hung_lock = threading.Lock()  # _hung's (taken under _lock too)
        with self._lock:
            self._connect()

    @property
    def mode(self) -> Optional[str]:
        """Where pages go: "in_place" (the daemon copies to and from the host
        pool), "bounce" (through kvtier's shared memory), or None before
        register_mem_pool_host."""
        if self._pool is None:
            return None
        return "bounce" if self._bounce is not None else "in_place"

    def model_id(self) -> str:
        """The kvtier Layout's model id: the model name, and the PP and
        context-parallel shard when there are several."""
        config, model_id = self._config, self._model_id
        if config.pp_size > 1:
            model_id += f"/pp{config.pp_rank}-of-{config.pp_size}"
        if config.attn_cp_size > 1:
            model_id += f"/cp{config.attn_cp_rank}-of-{config.attn_cp_size}"
        return model_id

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Registers SGLang's host pool with kvtierd: in place when kvtier
        can share its memory, else through a bounce buffer. Blocks for a
        round trip. Raises NotImplementedError or ValueError for a pool this
        backend does not store; a daemon that is down only defers it."""
        super().register_mem_pool_host(mem_pool_host)
        pool = _HostPool.of(mem_pool_host)
        dtype = _TORCH_DTYPES.get(str(pool.buffer.dtype).removeprefix("torch."))
        if dtype is None:
            raise NotImplementedError(f"kvtier does not store KV caches of {pool.buffer.dtype}")
        # An MLA pool is the same bytes on every TP rank: one namespace,
        # which SGLang's first rank alone writes (is_storage_writer) and
        # every rank reads.
        layout = kvtier.Layout(
            self.model_id(),
            pool.num_layers,
            pool.num_heads,
            pool.head_dim,
            dtype,
            pool.page_tokens,
            kv_kind="latent" if pool.latent else "kv",
            tp_rank=0 if pool.latent else self._config.tp_rank,
            tp_size=1 if pool.latent else self._config.tp_size,
        )
        with self._lock:
            if _is_pinned(mem_pool_host, pool.buffer):
                logger.info("kvtier: pages go through a bounce buffer: the host pool is pinned")
            elif (client := self._connect()) is not None:
                tensors, placements = pool.registration()
                try:
                    self._cache = client.register_tensors(layout, pool.num_pages, tensors, placements)
                    self._pool = pool
                    logger.info("kvtier: the daemon shares SGLang's host pool in place (%s)", pool.layout)
                    return
                except kvtier.InvalidArgumentError as error:  # memory kvtier cannot share in place
                    logger.info("kvtier: pages go through a bounce buffer: %s", error)
                except kvtier.UnavailableError as error:
                    self._report(error)
            self._bounce = _Bounce(layout, pool, self._bounce_bytes)
            self._pool = pool
            self._register_bounce()

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """The number of leading keys stored (0 while the daemon is down).
        Blocks for a round trip."""
        hashes = [_engine_hash(k) for k in keys]
        ready = self._ready()
        if not hashes or ready is None:
            return 0
        client, cache = ready
        try:
            # The client splits a long lookup into requests the daemon takes.
            keys = [client.key_from_engine_hash(cache, h) for h in hashes]
            hits = client.lookup(cache, keys, prefill_tokens_per_s=self._prefill_tokens_per_s).hits
        except kvtier.Error as error:
            self._report(error)
            return 0
        self._recovered()
        return hits

    def exists(self, key: str) -> bool:
        """Whether one page is stored (False while the daemon is down)."""
        return self.batch_exists([key]) == 1

    def batch_get_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        """Loads the pages of ``keys`` into the host pool slots
        ``host_indices`` (page_size per key). Returns, per key, whether its
        page was loaded: a leading run of True (the load stops at the first
        miss, later pages untouched). Blocks until the daemon has copied.
        Raises ValueError for indices that are not distinct whole pages."""
        pages = self._pages(keys, host_indices, distinct=True)
        loaded = self._by_chunks([_engine_hash(k) for k in keys], pages, self._load)
        return [i < loaded for i in range(len(keys))]

    def batch_set_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        """Stores the host pool pages at ``host_indices`` (page_size per key)
        under ``keys``. Returns, per key, whether its page is stored now (new
        or already there); False for the rest once the daemon refuses or is
        down. Blocks until the daemon has copied. Raises ValueError for
        indices that are not whole pages."""
        pages = self._pages(keys, host_indices, distinct=False)
        prefix = extra_info.prefix_keys if extra_info is not None else None
        parent = _engine_hash(prefix[-1]) if prefix else None  # for kvtier's prefix-aware eviction
        stored = self._by_chunks([_engine_hash(k) for k in keys], pages, self._store, parent)
        return [i < stored for i in range(len(keys))]

    # Not supported: the tensor-copying interface, and the v2 one of hybrid pools.

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError(_NO_TENSOR_API)

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError(_NO_TENSOR_API)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError(_NO_TENSOR_API)

    def batch_set(
        self, keys: List[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        raise NotImplementedError(_NO_TENSOR_API)

    def batch_exists_v2(
        self,
        keys: List[str],
        pool_transfers: Optional[List[PoolTransfer]] = None,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> PoolTransferResult:
        raise NotImplementedError(_NO_HYBRID)

    def batch_get_v2(
        self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> dict[str, List[bool]]:
        raise NotImplementedError(_NO_HYBRID)

    def batch_set_v2(
        self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> dict[str, List[bool]]:
        raise NotImplementedError(_NO_HYBRID)

    def on_host_pools_registered(self) -> None:
        """Fails SGLang's attach (NotImplementedError) when the model has host
        pools besides its KV pool: their pages could not be stored."""
        pools = getattr(self, "registered_pools", {})
        others = sorted(str(name) for name in pools if name != PoolName.KV)
        if others:
            raise NotImplementedError(f"{_NO_HYBRID}; this model also has {', '.join(others)}")

    def clear(self) -> None:
        """Does nothing: kvtierd's blocks belong to the tenant, and other
        engines may share them (``kvtierctl evict`` drops them)."""
        logger.warning("kvtier: clearing HiCache storage is not supported; use kvtierctl evict")

    def close(self) -> None:
        """Closes the connection; later calls report misses."""
        with self._lock:
            self._closed = True
            client, self._client, self._cache = self._client, None, None
        if client is not None:
            client.close()

    # Internals.

    def _connect(self) -> Optional[kvtier.Client]:
        """The client, connecting when due; None while the daemon has never
        answered. REQUIRES: self._lock held."""
        if self._client is not None or self._closed or time.monotonic() < self._next_connect:
            return self._client
        self._next_connect = time.monotonic() + _CONNECT_RETRY_S
        config = self._config
        self._socket = self._named_socket or kvtier.default_socket()
        try:
            self._client = kvtier.Client.connect(
                self._socket,
                token=self._token,
                name=f"sglang tp{config.tp_rank}/{config.tp_size}",
                call_timeout=self._timeout_s,
            )
        except kvtier.UnavailableError as error:
            self._report(error)
        return self._client

    def _register_bounce(self) -> None:
        """Registers the bounce buffer if connected. REQUIRES: self._lock held."""
        client = self._connect()
        if client is None or self._bounce is None:
            return
        try:
            self._cache = client.register_cpu_cache(self._bounce.memory)
        except kvtier.UnavailableError as error:
            self._report(error)

    def _ready(self) -> Optional[tuple[kvtier.Client, kvtier.KvCache]]:
        """The client and the registered cache, registering when due; None
        while the daemon is unreachable or after close()."""
        with self._hung_lock:
            if self._hung.active():
                return None
        client, cache = self._client, self._cache
        if client is not None and cache is not None:
            return client, cache
        if self._pool is None:
            raise RuntimeError("kvtier.sglang.KvtierStore: register_mem_pool_host comes first")
        with self._lock:
            if self._cache is None:
                self._register_bounce()  # in place registers only in register_mem_pool_host
            client, cache = self._client, self._cache
        return (client, cache) if client is not None and cache is not None else None

    def _pages(self, keys: Sequence[str], host_indices: Any, distinct: bool) -> list[int]:
        """The host pool page of each key: host_indices[i * page_size] //
        page_size. Raises ValueError unless host_indices are whole pages of
        the pool, page_size per key (and distinct pages when asked)."""
        pool = self._pool
        if pool is None:
            raise RuntimeError("kvtier.sglang.KvtierStore: register_mem_pool_host comes first")
        t = pool.page_tokens
        slots = torch.as_tensor(host_indices).reshape(-1)
        if slots.numel() != len(keys) * t:
            raise ValueError(
                f"host_indices holds {slots.numel()} slots; "
                f"{len(keys)} keys need {len(keys) * t} ({t} per page)"
            )
        if not keys:
            return []
        slots = slots.to("cpu", torch.int64).view(len(keys), t)
        first = slots[:, :1]
        whole = torch.equal(slots - first, torch.arange(t).expand_as(slots)) and not bool((first % t).any())
        if not whole:
            raise ValueError(f"host_indices must be whole pages: {t} consecutive slots from a multiple of {t}")
        pages = (first[:, 0] // t).tolist()
        if min(pages) < 0 or max(pages) >= pool.num_pages:
            raise ValueError(f"host_indices name pages outside the host pool's {pool.num_pages}")
        if distinct and len(set(pages)) != len(pages):
            raise ValueError("host_indices name one page twice")
        return pages

    def _by_chunks(
        self, hashes: list[bytes], pages: list[int], move: _Move, parent: Optional[bytes] = None
    ) -> int:
        """Moves pages chunk by chunk (a whole batch in place, a bounce half
        otherwise) while each chunk moves whole; the number of leading pages
        moved. A daemon error ends it, logged once; 0 while it is unreachable.
        parent: the engine hash of the page before the first, if known."""
        ready = self._ready()
        if not pages or ready is None:
            return 0
        client, cache = ready
        step = min(self._bounce.pages if self._bounce is not None else _MAX_KEYS_PER_CALL, client.max_keys_per_request)
        moved = 0
        try:
            parent_key = None if parent is None else client.key_from_engine_hash(cache, parent)
            for start in range(0, len(pages), step):
                part = pages[start : start + step]
                keys = [client.key_from_engine_hash(cache, h) for h in hashes[start : start + len(part)]]
                done = move(client, cache, keys, part, parent_key)
                moved += done
                if done < len(part):
                    break
                parent_key = keys[-1]
        except kvtier.Error as error:
            self._report(error)
        else:
            self._recovered()
        return moved

    def _load(
        self, client: kvtier.Client, cache: kvtier.KvCache, keys: list[bytes], pages: list[int], _: Any
    ) -> int:
        """Loads keys into pool pages; the number loaded (a leading run)."""
        bounce, pool = self._bounce, self._pool
        assert pool is not None
        if bounce is None:
            return client.load(cache, keys, pages).blocks
        with bounce.load_lock:
            loaded = client.load(cache, keys, list(range(len(pages)))).blocks
            for b in range(loaded):
                pool.page(pages[b]).copy_(bounce.block(b))
        return loaded

    def _store(
        self,
        client: kvtier.Client,
        cache: kvtier.KvCache,
        keys: list[bytes],
        pages: list[int],
        parent: Optional[bytes],
    ) -> int:
        """Stores pool pages under keys; all of them, or kvtier.Error."""
        bounce, pool = self._bounce, self._pool
        assert pool is not None
        if bounce is None:
            client.store(cache, keys, pages, parent)
            return len(pages)
        with bounce.store_lock:
            blocks = [bounce.pages + b for b in range(len(pages))]
            for block, page in zip(blocks, pages):
                bounce.block(block).copy_(pool.page(page))
            client.store(cache, keys, blocks, parent)
        return len(pages)

    def _report(self, error: kvtier.Error) -> None:
        """Logs a daemon error once until the next success. A call that timed
        out (its connection dropped, its copies cancelled) starts a pause of
        misses (HungPause): a hung daemon costs each later call nothing."""
        client = self._client
        with self._hung_lock:
            pause = self._hung.note(error, client is None or client.connected)
        if pause is not None:
            logger.warning(
                "kvtier: kvtierd (%s) did not answer in %.1f s, storage misses for %.0f s: %s",
                self._socket, self._timeout_s, pause, error,
            )
        if error.code in self._failing:
            return
        self._failing.add(error.code)
        if isinstance(error, kvtier.UnavailableError):
            logger.warning("kvtier: kvtierd (%s) is unavailable, storage misses: %s", self._socket, error)
        else:  # e.g. ResourceExhausted: no room for a store
            logger.warning("kvtier: kvtierd refused a HiCache storage call; its pages miss: %s", error)

    def _recovered(self) -> None:
        with self._hung_lock:
            self._hung.note(None, True)
        if self._failing:
            self._failing.clear()
            logger.info("kvtier: kvtierd (%s) answers again", self._socket)
