"""The vLLM connector's shared part (kvtier/vllm.py is its entry): settings, the
layout and keys both sides derive alike, the connection to kvtierd, request
hints and the metadata the scheduler hands the workers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # a vLLM whose workers send its connector nothing back
    KVConnectorWorkerMetadata = object  # type: ignore[misc,assignment]
from vllm.logger import init_logger

import kvtier

from . import _TORCH_DTYPES
from ._hung import HungPause

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# A child of vLLM's "vllm" logger, so that vLLM's logging settings (its handler and
# format, VLLM_LOGGING_LEVEL, VLLM_CONFIGURE_LOGGING, VLLM_LOGGING_CONFIG_PATH)
# apply to the connector's lines as to its own: a logger of another name has
# no handler inside vLLM, and its INFO lines were lost.
logger = init_logger("vllm.kvtier")

# How long a process waits between attempts to reach a daemon that was down.
_RECONNECT_INTERVAL_S = 1.0


# --------------------------------------------------------------------------
# What both sides derive alike: settings, the layout, keys.


@dataclass(frozen=True)
class _Settings:
    socket: str | None  # None: kvtier.default_socket(), resolved at each attempt to connect
    token: str | None
    model_id: str
    lookup_timeout_s: float
    lookup_wait_s: float
    op_timeout_s: float
    # Loads copied layer by layer, each layer's attention waiting for its
    # own layer only (wait_for_layer_load): CPU caches.
    layerwise_load: bool = True
    # Stores handed over layer by layer, each layer as soon as its attention
    # wrote it (save_kv_layer): CPU caches.
    layerwise_store: bool = True
    # Lookups give kvtierd the engine's prefill rate, as its forward passes
    # take: hits slower to load than to compute are left to compute.
    load_or_recompute: bool = True
    # Exclusive caching: stores say vLLM keeps a copy (kvtier evicts those
    # first), and the scheduler tells kvtierd which blocks vLLM's own cache
    # let go of since (kvtier's copy the only one then).
    exclusive_caching: bool = True
    # With exclusive caching, on CPU caches: kvtier takes a copy of each
    # block vLLM lets go of that it lacks, in the step that reuses the block
    # and before anything writes it (handle_preemptions); loads say vLLM
    # keeps what it loaded (kvtier's copy then goes first, as a store's);
    # and a lookup counts the blocks vLLM let go of earlier in the same
    # scheduling pass (their copies land before the step's loads).
    keep_dropped: bool = True

    @staticmethod
    def of(vllm_config: VllmConfig) -> _Settings:
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        return _Settings(
            socket=str(extra["socket"]) if extra.get("socket") else None,
            token=extra.get("token"),
            model_id=str(extra.get("model_id") or vllm_config.model_config.model),
            lookup_timeout_s=float(extra.get("lookup_timeout_s", 2.0)),
            lookup_wait_s=float(extra.get("lookup_wait_ms", 2.0)) / 1000,
            op_timeout_s=float(extra.get("op_timeout_s", 10.0)),
            layerwise_load=_flag(extra.get("layerwise_load", True)),
            layerwise_store=_flag(extra.get("layerwise_store", True)),
            load_or_recompute=_flag(extra.get("load_or_recompute", True)),
            exclusive_caching=_flag(extra.get("exclusive_caching", True)),
            keep_dropped=_flag(extra.get("keep_dropped", True)),
        )


def _flag(value: Any) -> bool:
    """A boolean setting, also from JSON strings ("false", "0")."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "no", "off")
    return bool(value)


@dataclass(frozen=True)
class _Shards:
    """How the tensor-parallel ranks' KV caches map onto kvtier namespaces.

    A rank's KV cache is one shard of each block. Ranks whose shards are
    the same bytes share one namespace, and only the first of them stores
    it: every rank of an MLA cache (one latent per token, the same on every
    rank), and the ranks that replicate a KV head (fewer KV heads than
    ranks). So a block is stored once per distinct shard, and an MLA
    cache's blocks are the same namespace at any TP size."""

    count: int  # distinct shards of a block: namespaces the lookups ask
    replicas: int  # ranks holding each shard

    @staticmethod
    def of(vllm_config: VllmConfig, latent: bool) -> _Shards:
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        if latent:
            return _Shards(1, tp_size)
        total_heads = vllm_config.model_config.get_total_num_kv_heads()
        replicas = max(1, tp_size // max(total_heads, 1))
        return _Shards(tp_size // replicas, replicas)

    def of_rank(self, tp_rank: int) -> int:
        return tp_rank // self.replicas

    def stores(self, tp_rank: int) -> bool:
        """Whether this rank stores its shard (the first of its replicas)."""
        return tp_rank % self.replicas == 0


@dataclass(frozen=True)
class _Group:
    """One of vLLM's KV cache groups: layers of one kind of attention that
    share block ids (with its hybrid manager on, a model of sliding-window
    and full-attention layers has several; otherwise there is one)."""

    index: int
    layer_names: tuple[str, ...]
    spec: Any  # the group's AttentionSpec
    # Sliding window: the blocks before a hit's end that its attention
    # reads (vLLM's own prefix cache needs as many); None: every block.
    window_blocks: int | None

    @property
    def latent(self) -> bool:
        """Whether the group's cache is MLA's: one latent vector per token."""
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        return type(self.spec) is MLAAttentionSpec


def _groups(kv_cache_config: KVCacheConfig) -> list[_Group]:
    """vLLM's KV cache groups, each of full attention (K and V, or MLA's
    latent) or of sliding-window attention. Any other kind (Mamba or linear
    attention state, chunked local attention, ...) is refused here, at the
    connector's start, with a message that names it: kvtier keeps blocks of
    per-token KV, never a state that stands for a whole prefix."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    groups: list[_Group] = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = type(spec)
        if kind not in (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec):
            raise NotImplementedError(
                f"KvtierConnector does not take {kind.__name__} KV caches (group {index}: "
                f"{', '.join(group.layer_names[:3])}{', ...' if len(group.layer_names) > 3 else ''}); "
                "it takes full attention, MLA and sliding-window attention"
            )
        window = None
        if kind is SlidingWindowSpec:
            window = -(-(spec.sliding_window - 1) // spec.block_size)  # vLLM's SlidingWindowManager
        groups.append(_Group(index, tuple(group.layer_names), spec, window))
    if not groups:
        raise NotImplementedError("KvtierConnector found no KV cache group")
    if len({g.spec.block_size for g in groups}) != 1:
        raise NotImplementedError(
            f"KvtierConnector takes KV cache groups of one block size, not {sorted({g.spec.block_size for g in groups})}"
        )
    if len({g.latent for g in groups}) != 1:
        raise NotImplementedError("KvtierConnector does not take MLA groups beside other attention yet")
    return groups


def _layout(settings: _Settings, group: _Group, groups: int, shard: int, shards: int) -> kvtier.Layout:
    """The kvtier layout of one shard (`_Shards`) of one KV cache group:
    its layers, K and V or (MLA) one latent. With several groups, each is
    a namespace of its own (the model id names the group: two groups of as
    many layers have the same shape).

    Both roles derive it from the same KVCacheConfig, so the scheduler's
    lookups and the workers' loads and stores name one namespace."""
    spec = group.spec
    if group.latent and getattr(spec, "cache_dtype_str", None) not in (None, "auto"):
        raise NotImplementedError(f"KvtierConnector does not take MLA caches of {spec.cache_dtype_str} yet")
    dtype = _TORCH_DTYPES.get(str(spec.dtype).removeprefix("torch."))
    if dtype is None:
        raise NotImplementedError(f"KvtierConnector does not take {spec.dtype} KV caches")
    model_id = settings.model_id if groups == 1 else f"{settings.model_id}|kv-group={group.index}/{groups}"
    return kvtier.Layout(
        model_id,
        num_layers=len(group.layer_names),
        num_kv_heads=1 if group.latent else spec.num_kv_heads,
        head_dim=spec.head_size,
        dtype=dtype,
        block_tokens=spec.block_size,
        kv_kind="latent" if group.latent else "kv",
        tp_rank=shard,
        tp_size=shards,
    )


def _keys(client: kvtier.Client, cache: kvtier.KvCache, hashes: list[bytes]) -> list[bytes]:
    return [client.key_from_engine_hash(cache, h) for h in hashes]


def _pieces(count: int, client: kvtier.Client) -> list[slice]:
    """`count` keys as consecutive slices the daemon takes in one request
    each (its Welcome's max_keys_per_request): loads and stores of a long
    prompt's blocks are split; lookups, prefetches and hints the client
    splits itself."""
    step = client.max_keys_per_request  # at least 1
    return [slice(start, min(start + step, count)) for start in range(0, count, step)]


class _Refusals:
    """Logs what the daemon refused: at WARNING the first time a kind of
    refusal the connector cannot recover from shows (a bad request, a limit,
    a permission), at debug after that and for the daemon being away or
    slow (UnavailableError, DeadlineExceededError: misses until it is back,
    which other lines say). Owned by one thread."""

    _TRANSIENT = (kvtier.UnavailableError, kvtier.DeadlineExceededError)

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def note(self, error: kvtier.Error, what: str) -> None:
        kind = type(error).__name__
        if isinstance(error, self._TRANSIENT) or kind in self._seen:
            logger.debug("kvtier: %s failed (%s); a miss", what, error)
            return
        self._seen.add(kind)
        logger.warning("kvtier: kvtierd refused %s (%s); each such call is a miss (logged once)", what, error)


class _Connection:
    """A client of the daemon, connected on first use and again after a
    failed attempt at most once per _RECONNECT_INTERVAL_S. `register` makes the
    caller's KV cache once connected. Once connected, the client itself
    reconnects after a daemon restart and registers the cache again.
    Owned by one thread at a time."""

    def __init__(self, settings: _Settings, name: str, call_timeout_s: float | None = None) -> None:
        self._settings = settings
        self._name = name
        self._call_timeout_s = call_timeout_s
        self._client: kvtier.Client | None = None
        self._socket = settings.socket or ""  # the one connected to
        self._next_attempt = 0.0
        self._warned = False
        self._hung = HungPause()

    def client(self) -> kvtier.Client | None:
        now = time.monotonic()
        if self._hung.active():
            return None
        if self._client is not None:
            return self._client
        if now < self._next_attempt:
            return None
        socket = self._settings.socket or kvtier.default_socket()
        try:
            self._client = kvtier.Client.connect(
                socket, token=self._settings.token, name=self._name, call_timeout=self._call_timeout_s
            )
            self._socket = socket
            logger.info("kvtier: connected to %s as tenant %s", socket, self._client.tenant)
            self._warned = False
        except kvtier.Error as error:
            self._next_attempt = now + _RECONNECT_INTERVAL_S
            if not self._warned:
                looked = "" if self._settings.socket else (
                    f" (no socket named: looked at {', '.join(kvtier.default_socket_candidates())}; "
                    'set kv_connector_extra_config {"socket": ...} or KVTIER_SOCKET)'
                )
                logger.warning("kvtier: %s unreachable (%s)%s; every lookup is a miss until it is back", socket, error, looked)
                self._warned = True
        return self._client

    def note(self, error: kvtier.Error | None) -> None:
        """What a call to the daemon ended with (None: it answered). After a
        call that timed out, client() is None for a while (HungPause): a hung
        daemon costs each step nothing more, not a call_timeout per step."""
        connected = self._client is None or self._client.connected
        if (pause := self._hung.note(error, connected)) is not None:
            logger.warning("kvtier: %s did not answer in time (%s); transfers are misses for %.0f s", self._socket, error, pause)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


# --------------------------------------------------------------------------
# The step plan, scheduler to workers.

# The most next_use_ms the daemon takes (an hour; ipc::kMaxNextUseMs).
_MAX_NEXT_USE_MS = 3_600_000


@dataclass(frozen=True)
class RequestHint:
    """A request's retention hint (docs/policy.md), from its kv_transfer_params."""

    priority: int = 0
    next_use_ms: int = 0
    session_over: bool = False

    @staticmethod
    def of(request: Request) -> RequestHint | None:
        """The hint in ``request.kv_transfer_params["kvtier"]``; None when it has
        none, or one that is not valid (logged: the request runs unhinted)."""
        params = getattr(request, "kv_transfer_params", None)
        raw = params.get("kvtier") if isinstance(params, dict) else None
        if raw is None:
            return None
        try:
            if not isinstance(raw, dict) or set(raw) - {"priority", "next_use_ms", "session_over"}:
                raise ValueError("an object with priority, next_use_ms and session_over is wanted")
            priority, next_use_ms = raw.get("priority", 0), raw.get("next_use_ms", 0)
            session_over = raw.get("session_over", False)
            if type(priority) is not int or priority not in (-1, 0, 1):
                raise ValueError(f"priority {priority!r}: -1 (evict first), 0 (no hint) or 1 (keep)")
            if type(next_use_ms) is not int or not 0 <= next_use_ms <= _MAX_NEXT_USE_MS:
                raise ValueError(f"next_use_ms {next_use_ms!r}: an integer from 0 to {_MAX_NEXT_USE_MS}")
            if not isinstance(session_over, bool):
                raise ValueError(f"session_over {session_over!r}: true or false")
        except ValueError as error:
            logger.warning("kvtier: request %s: kv_transfer_params.kvtier ignored (%s)", request.request_id, error)
            return None
        hint = RequestHint(priority, next_use_ms, session_over)
        return hint if hint != RequestHint() else None


@dataclass
class TransferSpec:
    """Blocks of one request and one KV cache group (`_Group.index`) to
    move: vLLM block hashes and block ids, alike in length, and the
    request's hint (stores carry it)."""

    req_id: str
    block_hashes: list[bytes]
    block_ids: list[int]
    hint: RequestHint | None = None
    group: int = 0
    parent: bytes | None = None  # the hash of the block before the first, where known (a chain's)


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    """One step's plan: loads before the forward pass, stores after it, the
    requests preempted (their blocks may be reused once this step ends), and
    the hints of hinted requests that are over (block_ids empty: every block
    of the request, sent once its stores have landed)."""

    loads: list[TransferSpec] = field(default_factory=list)
    stores: list[TransferSpec] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    hints: list[TransferSpec] = field(default_factory=list)
    scheduled_tokens: int = 0  # tokens this step computes, all requests together
    # With several ranks: requests whose loads every rank has reported whole
    # since their last word (their stores held back since then may land),
    # and those whose loads fell short on some rank (theirs are cancelled).
    confirmed: set[str] = field(default_factory=set)
    voided: set[str] = field(default_factory=set)
    # Blocks vLLM gives to other content this step, by group, with the hash
    # each held (keep_dropped): copied to kvtierd before anything writes them.
    dropped: list[TransferSpec] = field(default_factory=list)


@dataclass
class StepReport(KVConnectorWorkerMetadata):
    """What a worker reports of a step. Its forward pass as it timed it:
    `tokens` computed in `seconds`, its waits for loads left out, for the
    scheduler's prefill rate (load or recompute); the ranks of a step take
    as long as the slowest. With several ranks, the requests whose loads of
    the step ended whole and short on this rank: whole on every rank, or
    short on any, once vLLM has aggregated the ranks' reports."""

    tokens: int = 0
    seconds: float = 0.0
    loads_whole: frozenset[str] = frozenset()
    loads_short: frozenset[str] = frozenset()

    def aggregate(self, other: Any) -> StepReport:
        if not isinstance(other, StepReport):
            return self
        return StepReport(
            max(self.tokens, other.tokens),
            max(self.seconds, other.seconds),
            self.loads_whole & other.loads_whole,
            self.loads_short | other.loads_short,
        )
