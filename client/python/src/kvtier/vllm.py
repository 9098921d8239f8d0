"""kvtier.vllm: a vLLM v1 KV connector (``KVConnectorBase_V1``) over kvtierd.

Tested with vLLM 0.33.0. vLLM loads it with one flag::

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/run/kvtier/kvtierd.sock"}}'

plus ``--prefix-caching-hash-algo sha256_cbor`` and a fixed ``PYTHONHASHSEED``
in every process, so that vLLM's block hashes (the keys here) are the same
across processes, restarts and nodes.

Two instances run, with no state in common:

- ``role=SCHEDULER`` in the engine-core process. It waits on the daemon at
  most ``lookup_wait_ms`` per request: ``get_num_new_matched_tokens`` hands
  the lookup to a thread of its own, waits that long for the answer, and
  answers ``None`` ("ask again") while it is not there. The lookup is a
  prefetch: it counts the leading full blocks cached now and starts moving
  them to the host tier. The step plan (``KvtierMetadata``) says which blocks
  each worker loads and stores.
- ``role=WORKER`` in every model-runner process. It registers vLLM's KV tensors
  with the daemon in place (CPU memory is shared, GPU memory goes through CUDA
  IPC), loads before the forward pass (``start_load_kv``), and starts the
  stores after it (``wait_for_save``). A request whose blocks are being stored
  stays held (``request_finished`` returns True) until ``get_finished`` reports
  its stores done. A failed load is reported through
  ``get_block_ids_with_load_errors`` and vLLM recomputes those blocks.

KV caches: every KV cache group vLLM has (``SupportsHMA``: vLLM keeps its
hybrid manager on), each a namespace of its own: full attention, K and V
or MLA's latent (one vector per token, the same on every tensor-parallel
rank), and sliding-window attention, of which only the windows a hit reads
are stored and loaded. Mamba and other state are refused at start. Each rank's
shard of a block is in a namespace of its own, shared by the ranks that hold
the same bytes (MLA, replicated KV heads), where only the first stores it;
the scheduler's lookups ask every shard's namespace, so a prefix is a hit
only as far as every shard holds it. Lookups, loads and stores of any
length are split to what the daemon takes per request.

A daemon that is down or restarting is a miss, never an exception in vLLM:
lookups answer 0 blocks, loads fail into recomputation, stores are skipped.

Engine hints, per request: an application passes them in vLLM's
``kv_transfer_params`` (``SamplingParams.extra_args["kv_transfer_params"]``,
or the OpenAI server's ``"kv_transfer_params"`` field) as
``{"kvtier": {"priority": 1, "next_use_ms": 30000, "session_over": false}}``
(docs/policy.md says what each does). Stores of the request carry
``priority`` and ``next_use_ms``; once the request is over and its stores
have landed, one hint covers all its blocks (those loaded and those stored).
A hint that is not valid is logged and ignored: the request runs unhinted.

Settings (``kv_connector_extra_config``): ``socket`` (default
``kvtier.default_socket()``: ``$KVTIER_SOCKET``, else where a kvtierd listens
of ``/run/kvtier``, ``$XDG_RUNTIME_DIR/kvtier`` and ``./var/kvtier``, as
kvtierd picks its own; a connector that finds none says where it looked),
``token`` (when the
tenant is identified by a token), ``model_id`` (default: the served model's
name; it and the KV shape name the namespace), ``lookup_timeout_s`` (default
2: a lookup unanswered for that long is a miss; the scheduler's calls to the
daemon wait at most that long, and lookups that waited past it behind a hung
call are dropped, not run late), ``lookup_wait_ms`` (default
2: how long the scheduler's first ask about a request waits for the answer
before vLLM goes on without it; 0 never waits), ``op_timeout_s`` (default
10: how long a worker's call to the daemon, and a step's loads, may take; a
load not done by then is cancelled and its blocks recomputed, a store not
done when its blocks are needed is cancelled; after a call timed out the
worker leaves the daemon alone for a second, doubling to 30 s while it stays
hung, and every transfer meanwhile is a miss. A step so waits at most about
twice op_timeout_s on a hung daemon, once).

Cancelling (``Op.cancel``) needs no answer from the daemon: once it
returns, kvtierd never touches the op's blocks again, so vLLM may reuse or
recompute them at once. Only a daemon stopped in the middle of a copy (a
copy takes microseconds) makes it wait for that copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from ._vllm_common import KvtierMetadata, RequestHint, TransferSpec, _groups, _layout, _Settings, _Shards
from ._vllm_scheduler import _SchedulerSide
from ._vllm_worker import _WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvtierConnector", "KvtierMetadata", "RequestHint", "TransferSpec"]


# --------------------------------------------------------------------------
# The connector vLLM constructs.


def _tp_rank(vllm_config: VllmConfig) -> int:
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector for kvtier; vLLM constructs one per role. It
    takes every KV cache group (SupportsHMA), so vLLM keeps its hybrid KV
    cache manager on for models of sliding-window and full attention."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        settings = _Settings.of(vllm_config)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        groups = _groups(kv_cache_config)
        shards = _Shards.of(vllm_config, groups[0].latent)
        if role == KVConnectorRole.SCHEDULER:
            # A prefix is a hit as far as every group's every distinct
            # shard of it is cached: the lookups ask each one's namespace.
            layouts = [
                [_layout(settings, group, len(groups), shard, shards.count) for shard in range(shards.count)]
                for group in groups
            ]
            self._scheduler = _SchedulerSide(settings, groups, layouts)
        else:
            tp_rank = _tp_rank(vllm_config)
            layouts = [_layout(settings, group, len(groups), shards.of_rank(tp_rank), shards.count) for group in groups]
            ranks = vllm_config.parallel_config.tensor_parallel_size
            self._worker = _WorkerSide(settings, groups, layouts, tp_rank, stores=shards.stores(tp_rank), ranks=ranks)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a store that is dropped is a later miss

    # Scheduler side.

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    # Worker side.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KvtierMetadata):
            self._worker.step_started(connector_metadata)

    def build_connector_worker_meta(self) -> Any:
        return self._worker.step_report() if self._worker is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save(self._meta())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self._worker is not None
        if isinstance(kv_connector_metadata, KvtierMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, received, failed = self._worker.get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=received, failed_recving=failed)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.loads_failed(connector_output.failed_recving)
        self._scheduler.step_reported(getattr(connector_output, "kv_connector_worker_meta", None))

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.shutdown()

    def _meta(self) -> KvtierMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierMetadata)
        return meta
