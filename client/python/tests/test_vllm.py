"""kvtier.vllm.KvtierConnector driven through vLLM 0.33.0's real classes on the CPU.

The scheduler side runs inside vLLM's own ``Scheduler`` (built from a
``VllmConfig``, with the connector loaded by vLLM's ``KVConnectorFactory`` from
``kv_connector_module_path``). The worker side gets KV tensors allocated by
vLLM's own ``create_kv_cache_views`` (what ``allocate_kv_cache`` does) over
page-aligned memory, from a ``KVCacheConfig`` that vLLM's planner
made, in each of vLLM's KV cache layouts. What stands in for the model runner
is the loop below (``Engine.step``): it calls the connector in the order
vLLM's ``KVConnectorModelRunnerMixin`` does, writes each computed token's K
and V (a deterministic function of the token prefix, so that any byte served
from the wrong block or position shows), and reports back to the scheduler
in vLLM's ``ModelRunnerOutput`` / ``KVConnectorOutput``. vLLM's model
executor needs its compiled ops, which its CPU-less wheel does not carry
here; the model itself is tested end to end in test_model_e2e.py.
"""

from __future__ import annotations

import json
import mmap
import os
import pathlib
import signal
import time
from typing import Any, Iterator

import pytest
import torch
from conftest import Daemon
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import kvtier
from kvtier.vllm import KvtierConnector, KvtierMetadata, TransferSpec
from kvtier._vllm_common import StepReport

BLOCK = 16
LAYERS = 2
KV_HEADS = 2
HEAD = 32
NUM_BLOCKS = 64
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def attention_waits(worker: Any) -> None:
    """What vLLM's attention layers call in a forward pass before each
    layer's attention (maybe_transfer_kv_layer): loads by layer are in
    place layer by layer."""
    for name in LAYER_NAMES:
        worker.wait_for_layer_load(name)

init_none_hash(sha256_cbor)


def vllm_config(model_dir: pathlib.Path, socket: str, layout: str = "LBNHC", **extra: object) -> VllmConfig:
    model = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), skip_tokenizer_init=True, dtype="float32", seed=0)
    scheduler = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=2048,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.kv_cache_layout = layout
    transfer = KVTransferConfig(
        kv_connector="KvtierConnector",
        kv_connector_module_path="kvtier.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"socket": socket, **extra},
    )
    return VllmConfig(
        model_config=model,
        scheduler_config=scheduler,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(config: VllmConfig) -> KVCacheConfig:
    """vLLM's own plan of the KV allocation for the configured layout."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32)
    groups = [KVCacheGroupSpec(LAYER_NAMES, spec)]
    plan = get_kv_cache_config_from_groups(config, groups, NUM_BLOCKS * LAYERS * spec.page_size_bytes)
    config.cache_config.num_gpu_blocks = plan.num_blocks
    return plan


class PrivatePages:
    """Anonymous private memory of its own pages, as the engine's KV
    allocation is in a real vLLM (GiBs: glibc maps them). Several engines
    live in this one test process, and small allocations from the heap would
    share their first and last pages with their neighbours, which kvtier
    refuses to register into a second live KV cache."""

    def __init__(self, size: int) -> None:
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self._map, dtype=torch.int8)

    def release(self) -> None:
        del self.tensor
        self._map.close()


def kv_views(plan: KVCacheConfig, raw: torch.Tensor, layout: KVCacheLayout) -> dict[str, torch.Tensor]:
    """vLLM's per-layer views of its KV allocation (allocate_kv_cache's,
    over `raw`)."""
    (tensor,) = plan.kv_cache_tensors
    views = create_kv_cache_views(raw, plan.kv_cache_groups[0].kv_cache_spec, plan.num_blocks, layout, tensor)
    return dict(zip(tensor.layers, views))


@pytest.fixture
def model_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A Llama config vLLM's ModelConfig reads (no weights are needed)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": KV_HEADS * 2 * HEAD,
        "intermediate_size": 256,
        "num_attention_heads": KV_HEADS * 2,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": LAYERS,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    }
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    return tmp_path / "model"


def expected_kv(tokens: list[int], position: int, layer: int) -> torch.Tensor:
    """What the stand-in model computes for a token: [heads, 2 * head] (K then
    V), a function of every token up to and including `position`."""
    seed = hash((tuple(tokens[: position + 1]), layer)) & 0x7FFFFFFF
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(KV_HEADS, 2 * HEAD, generator=generator)


class Engine:
    """vLLM's Scheduler with the connector in both roles, and a stand-in model
    runner (one per "process": two Engines share nothing but the daemon)."""

    def __init__(self, model_dir: pathlib.Path, socket: str, layout: str = "LBNHC", **extra: object) -> None:
        self.config = vllm_config(model_dir, socket, layout, **extra)
        plan = kv_cache_config(self.config)
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=plan,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BLOCK,
            log_stats=True,
        )
        assert isinstance(self.scheduler.connector, KvtierConnector)
        self.worker = KvtierConnector(self.config, KVConnectorRole.WORKER, plan)
        self.buffer = PrivatePages(plan.kv_cache_tensors[0].size)
        self.kv = kv_views(plan, self.buffer.tensor, KVCacheLayout[layout])
        self.worker.register_kv_caches(self.kv)
        self.block_ids: dict[str, list[int]] = {}
        self.invalid_reported: set[int] = set()

    def add(self, request_id: str, tokens: list[int]) -> Request:
        params = SamplingParams(max_tokens=1)
        params.update_from_generation_config({}, 999)
        request = Request(
            request_id=request_id,
            prompt_token_ids=tokens,
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256_cbor),
        )
        self.scheduler.add_request(request)
        return request

    def step(self, between: object = None, scheduled: object = None) -> object:
        """One engine step; `between` runs after scheduling, before the
        worker; `scheduled`: the step's scheduler output, when the caller
        already scheduled it."""
        out = scheduled if scheduled is not None else self.scheduler.schedule()
        if between is not None:
            between()  # type: ignore[operator]
        self.scheduler.update_from_output(out, self.execute(out))
        return out

    def execute(self, out: Any) -> ModelRunnerOutput:
        """The workers' part of a step scheduled as `out`: its loads, its
        forward pass (stand-in KV) and its stores; returns what vLLM's model
        runner would."""
        meta = out.kv_connector_metadata
        assert isinstance(meta, KvtierMetadata)
        worker = self.worker
        worker.bind_connector_metadata(meta)
        worker.handle_preemptions(meta)
        worker.start_load_kv(None)  # type: ignore[arg-type]
        sampled: dict[str, list[int]] = {}
        computed: dict[str, int] = {}  # before this step
        for new in out.scheduled_new_reqs:
            self.block_ids[new.req_id] = list(new.block_ids[0])
            computed[new.req_id] = new.num_computed_tokens
        for i, req_id in enumerate(out.scheduled_cached_reqs.req_ids):
            computed[req_id] = out.scheduled_cached_reqs.num_computed_tokens[i]
            new_ids = out.scheduled_cached_reqs.new_block_ids[i]
            if req_id in out.scheduled_cached_reqs.resumed_req_ids:
                self.block_ids[req_id] = list(new_ids[0]) if new_ids else []
            elif new_ids:
                self.block_ids[req_id].extend(new_ids[0])
        # The forward pass, layer after layer as vLLM's attention layers run
        # (maybe_transfer_kv_layer): each waits for its loads, writes its
        # KV, then hands it over to stores by layer.
        for layer, name in enumerate(LAYER_NAMES):
            worker.wait_for_layer_load(name)
            for req_id, count in out.num_scheduled_tokens.items():
                tokens = list(self.scheduler.requests[req_id].all_token_ids)
                for position in range(computed[req_id], computed[req_id] + count):
                    self.write(self.block_ids[req_id], tokens, position, layer)
            worker.save_kv_layer(name, self.kv[name], None)
        for req_id, count in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            sampled[req_id] = [7] if computed[req_id] + count >= request.num_tokens else []
        worker.wait_for_save()
        sending, receiving = worker.get_finished(out.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        self.invalid_reported |= invalid
        worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending,
                finished_recving=receiving,
                invalid_block_ids=invalid,
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
            ),
        )

    def write(self, block_ids: list[int], tokens: list[int], position: int, layer: int) -> None:
        block, slot = block_ids[position // BLOCK], position % BLOCK
        self.kv[LAYER_NAMES[layer]][block, :, slot, :] = expected_kv(tokens, position, layer)

    def holds(self, block_id: int, tokens: list[int], block_index: int) -> bool:
        """Whether engine block `block_id` holds block `block_index` of `tokens`."""
        for layer, name in enumerate(LAYER_NAMES):
            for slot in range(BLOCK):
                position = block_index * BLOCK + slot
                if not torch.equal(self.kv[name][block_id, :, slot, :], expected_kv(tokens, position, layer)):
                    return False
        return True

    def run_until_idle(self, max_steps: int = 400) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
            time.sleep(0.005)  # lookups and stores run in the background
        raise AssertionError("the engine did not finish its requests")

    def close(self) -> None:
        self.scheduler.connector.shutdown()
        self.worker.shutdown()
        self.kv.clear()
        self.buffer.release()


@pytest.fixture
def engines(model_dir: pathlib.Path, daemon: Daemon) -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def schedule_when_answered(engine: Engine, req_id: str, max_steps: int = 200) -> object:
    """Steps until `req_id` is scheduled: the first steps skip it while its
    lookup is in flight (get_num_new_matched_tokens answers None)."""
    for _ in range(max_steps):
        out = engine.step()
        for new in out.scheduled_new_reqs:  # type: ignore[attr-defined]
            if new.req_id == req_id:
                return new
        time.sleep(0.005)
    raise AssertionError(f"{req_id} was never scheduled")


PREFIX = [(i * 37 + 11) % 1000 for i in range(6 * BLOCK)]  # 6 full blocks


def test_the_connector_is_a_real_vllm_connector(model_dir: pathlib.Path, daemon: Daemon) -> None:
    assert issubclass(KvtierConnector, KVConnectorBase_V1)
    engine = Engine(model_dir, daemon.socket)
    try:
        assert type(engine.scheduler.connector).__module__ == "kvtier.vllm"  # loaded by vLLM's factory
        assert engine.scheduler.connector.requires_kv_delivery is False
    finally:
        engine.close()


def daemon_counters(daemon: Daemon) -> dict[str, int]:
    with kvtier.Client.connect(daemon.socket, name="pytest-stats") as client:
        return dict(client.stats()["counters"])


def stores_by_layer(daemon: Daemon) -> int:
    return daemon_counters(daemon)["stores_by_layer"]


@pytest.mark.parametrize("exclusive", [True, False], ids=["exclusive", "duplicates"])
def test_kvtierd_learns_which_blocks_vllms_own_cache_holds_and_lets_go_of(
    model_dir: pathlib.Path, daemon: Daemon, engines: list[Engine], exclusive: bool
) -> None:
    # 12 prompts of 6 full blocks each, one after the other, through a cache
    # of 64 blocks: vLLM reuses the blocks of the first prompts for the
    # last ones, letting go of what it held there.
    engine = Engine(model_dir, daemon.socket, exclusive_caching=exclusive)
    engines.append(engine)
    for p in range(12):
        engine.add(f"p{p}", [3 + (31 * p + t) % 450 for t in range(6 * BLOCK + 1)])
        engine.run_until_idle()
    stored = 12 * 6
    deadline = time.monotonic() + 30
    while (c := daemon_counters(daemon))["stores"] < stored or (exclusive and c["engine_dropped"] == 0):
        assert time.monotonic() < deadline, c
        engine.step()  # the hints go out with the steps' metadata
        time.sleep(0.05)
    # Every block stored while vLLM held it; those of the blocks vLLM gave
    # to later prompts let go of: some, never more than were stored, and
    # not the last prompt's (still in vLLM's cache).
    assert c["engine_held"] == (stored if exclusive else 0)
    assert (0 < c["engine_dropped"] <= stored - 6) if exclusive else c["engine_dropped"] == 0


@pytest.mark.parametrize("layerwise_store", [True, False], ids=["stores-by-layer", "whole-stores"])
def test_a_second_request_with_the_same_prefix_is_loaded_from_kvtier(
    model_dir: pathlib.Path, daemon: Daemon, engines: list[Engine], layerwise_store: bool
) -> None:
    # The first engine's forward pass writes each layer's KV only in that
    # layer's turn: a store by layer that copied a layer before its
    # save_kv_layer would store nothing of it, and the second engine's
    # blocks would differ.
    first = Engine(model_dir, daemon.socket, layerwise_store=layerwise_store)
    engines.append(first)
    prompt_a = PREFIX + [1, 2, 3, 4]
    first.add("a", prompt_a)
    new = schedule_when_answered(first, "a")
    assert new.num_computed_tokens == 0  # an empty cache: nothing to load
    first.run_until_idle()  # a's blocks stay held until its stores are done
    assert "a" not in first.scheduler.requests
    assert (stores_by_layer(daemon) > 0) == layerwise_store

    # Another engine (another process, or node): only kvtier has the prefix.
    # Its scheduler never waits for an answer (lookup_wait_ms 0), so the
    # first step always finds the lookup in flight.
    second = Engine(model_dir, daemon.socket, lookup_wait_ms=0)
    engines.append(second)
    prompt_b = PREFIX + [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12]
    second.add("b", prompt_b)
    out = second.scheduler.schedule()  # the lookup is in flight: b waits
    assert not out.scheduled_new_reqs
    second.scheduler.update_from_output(out, ModelRunnerOutput(req_ids=[], req_id_to_index={}))
    new = schedule_when_answered(second, "b")
    assert new.num_computed_tokens == 6 * BLOCK  # every full block of the prefix came from kvtier
    assert second.invalid_reported == set()
    for index in range(6):
        assert second.holds(new.block_ids[0][index], prompt_b, index), f"block {index} differs"
    second.run_until_idle()

    # The whole prompt cached: one token is still left to compute.
    third = Engine(model_dir, daemon.socket)
    engines.append(third)
    third.add("c", PREFIX)
    new = schedule_when_answered(third, "c")
    assert new.num_computed_tokens == 5 * BLOCK


def test_a_failed_load_becomes_invalid_blocks_that_vllm_recomputes(
    model_dir: pathlib.Path, daemon: Daemon, engines: list[Engine]
) -> None:
    first = Engine(model_dir, daemon.socket)
    engines.append(first)
    first.add("a", PREFIX + [1])
    first.run_until_idle()

    second = Engine(model_dir, daemon.socket)
    engines.append(second)
    prompt = PREFIX + [5, 6, 7]
    second.add("b", prompt)
    admin = kvtier.Client.connect(daemon.socket)

    def evict_everything() -> None:
        # Between the lookup (hit) and the load: the blocks are gone.
        assert admin.evict() > 0

    for _ in range(200):
        scheduled = second.scheduler.schedule()
        if scheduled.scheduled_new_reqs:
            break
        second.scheduler.update_from_output(scheduled, ModelRunnerOutput(req_ids=[], req_id_to_index={}))
        time.sleep(0.005)
    # Put it back and step it through the worker with the eviction in between.
    # (schedule() already ran: replay the step by hand.)
    out = scheduled
    assert out.scheduled_new_reqs[0].num_computed_tokens == 6 * BLOCK
    meta = out.kv_connector_metadata
    assert [len(load.block_ids) for load in meta.loads] == [6]
    evict_everything()
    worker = second.worker
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)  # type: ignore[arg-type]
    attention_waits(worker)
    worker.wait_for_save()
    invalid = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    assert invalid == set(meta.loads[0].block_ids)
    runner = ModelRunnerOutput(
        req_ids=["b"],
        req_id_to_index={"b": 0},
        sampled_token_ids=[[]],
        kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid),
    )
    second.block_ids["b"] = list(out.scheduled_new_reqs[0].block_ids[0])
    second.scheduler.update_from_output(out, runner)
    request = second.scheduler.requests["b"]
    assert request.num_computed_tokens == 0  # truncated to the first failed block: recomputed
    # The next steps recompute the prompt, and the engine ends with the right KV.
    second.run_until_idle()
    for index in range(6):
        assert second.holds(second.block_ids["b"][index], prompt, index)
    admin.close()


def schedule_answered(engine: Engine, req_id: str) -> object:
    """Schedules until the step that takes `req_id` (its lookup answered),
    and returns that step's output, not yet run."""
    for _ in range(200):
        out = engine.scheduler.schedule()
        if any(new.req_id == req_id for new in out.scheduled_new_reqs):  # type: ignore[attr-defined]
            return out
        engine.scheduler.update_from_output(out, ModelRunnerOutput(req_ids=[], req_id_to_index={}))
        time.sleep(0.005)
    raise AssertionError(f"{req_id} was never scheduled")


def loading_the_prefix(
    model_dir: pathlib.Path, daemon: Daemon, engines: list[Engine], prompt: list[int], layerwise: bool, ranks: int = 1
) -> tuple[Engine, Any, KvtierMetadata]:
    """A first engine stores PREFIX; a second (as rank 0 of `ranks`)
    schedules `prompt`, request b, whose step loads PREFIX's 6 blocks.
    Returns the second engine, and b's step scheduled, not yet run."""
    first = Engine(model_dir, daemon.socket)
    engines.append(first)
    first.add("a", PREFIX + [1])
    first.run_until_idle()
    second = Engine(model_dir, daemon.socket, layerwise_load=layerwise, layerwise_store=layerwise)
    engines.append(second)
    second.worker._worker._ranks = ranks
    second.add("b", prompt)
    out = schedule_answered(second, "b")
    meta = out.kv_connector_metadata
    assert [len(load.block_ids) for load in meta.loads] == [6]
    return second, out, meta


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "scheduled-ahead"])
@pytest.mark.parametrize("layerwise", [True, False], ids=["by-layer", "whole"])
def test_nothing_computed_after_a_load_that_fell_short_is_stored(
    model_dir: pathlib.Path, daemon: Daemon, engines: list[Engine], layerwise: bool, ahead: bool
) -> None:
    # b's first step loads 6 blocks and computes 16 more from them (its
    # budget is 256 tokens); its next step computes the last 14. The load
    # finds nothing (evicted after the lookup): on a real model every block
    # computed after it attends to blocks that never arrived, until vLLM,
    # told of the failure, computes them again. With vLLM's asynchronous
    # scheduling (ahead) that next step is scheduled before vLLM is told.
    # None of those stores may land in kvtierd, where they would be served
    # under their prompt's keys.
    prompt = PREFIX + [(7 * i + 3) % 1000 for i in range(30 * BLOCK + 1)]
    second, out, meta = loading_the_prefix(model_dir, daemon, engines, prompt, layerwise)
    assert [len(store.block_ids) for store in meta.stores] == [16]  # 256 tokens: its budget
    admin = kvtier.Client.connect(daemon.socket)
    assert admin.evict() > 0
    admin.close()
    before = daemon_counters(daemon)["stores"]
    if ahead:
        failed = second.execute(out)
        nxt = second.scheduler.schedule()
        assert nxt.num_scheduled_tokens.get("b", 0) > 0  # type: ignore[attr-defined]
        assert [len(store.block_ids) for store in nxt.kv_connector_metadata.stores] == [14]  # type: ignore[attr-defined]
        then = second.execute(nxt)
        second.scheduler.update_from_output(out, failed)
        second.scheduler.update_from_output(nxt, then)
    else:
        second.step(scheduled=out)
    assert second.invalid_reported == set(meta.loads[0].block_ids)
    second.run_until_idle()
    assert daemon_counters(daemon)["stores"] == before, "nothing of b computed after its failed load was stored"
    if not ahead:  # (vLLM's plain scheduler, stepped ahead by hand, is not told which step failed)
        for index in range(len(prompt) // BLOCK):
            assert second.holds(second.block_ids["b"][index], prompt, index)


@pytest.mark.parametrize("layerwise", [True, False], ids=["by-layer", "whole"])
@pytest.mark.parametrize("other_rank", ["whole", "short"])
def test_with_several_ranks_a_loading_requests_stores_land_on_every_ranks_word(
    model_dir: pathlib.Path, daemon: Daemon, engines: list[Engine], other_rank: str, layerwise: bool
) -> None:
    # A rank knows only its own loads; another rank's may fall short, and
    # then what this rank computed attends to blocks that never arrived
    # there (the ranks' hidden states are one). So this rank holds b's
    # stores back until the scheduler, having aggregated every rank's
    # StepReport, says: all whole (they land), or some short (cancelled,
    # and b stores nothing more). The other rank is its report, as vLLM
    # aggregates it.
    prompt = PREFIX + [(5 * i + 9) % 1000 for i in range(2 * BLOCK + 1)]
    second, out, meta = loading_the_prefix(model_dir, daemon, engines, prompt, layerwise, ranks=2)
    assert [len(store.block_ids) for store in meta.stores] == [2]
    before = daemon_counters(daemon)["stores"]
    runner = second.execute(out)
    report = runner.kv_connector_output.kv_connector_worker_meta
    assert isinstance(report, StepReport) and report.loads_whole == {"b"}
    other = StepReport(loads_whole=frozenset({"b"})) if other_rank == "whole" else StepReport(loads_short=frozenset({"b"}))
    runner.kv_connector_output.kv_connector_worker_meta = report.aggregate(other)
    time.sleep(0.2)
    assert daemon_counters(daemon)["stores"] == before, "held back until every rank's word"
    second.scheduler.update_from_output(out, runner)
    nxt = second.step()
    assert nxt.kv_connector_metadata.confirmed == ({"b"} if other_rank == "whole" else set())  # type: ignore[attr-defined]
    assert nxt.kv_connector_metadata.voided == ({"b"} if other_rank == "short" else set())  # type: ignore[attr-defined]
    second.run_until_idle()
    assert daemon_counters(daemon)["stores"] == before + (2 if other_rank == "whole" else 0)
    worker = second.worker._worker
    assert not worker._awaiting and not worker._unconfirmed and not worker._deferred


def test_blocks_vllm_lets_go_of_are_copied_to_kvtierd_where_it_lacks_them(
    model_dir: pathlib.Path, daemon: Daemon, engines: list[Engine]
) -> None:
    # p0's 6 blocks are stored, then kvtierd is emptied: vLLM's own cache is
    # their only place. Prompts after it make vLLM reuse p0's blocks, and
    # each is copied to kvtierd in the step that reuses it, before the step
    # writes it. A second engine then loads p0 whole, bytes as computed.
    first = Engine(model_dir, daemon.socket)
    engines.append(first)
    prompts = [[3 + (31 * p + t) % 450 for t in range(6 * BLOCK + 1)] for p in range(12)]
    first.add("p0", prompts[0])
    first.run_until_idle()
    admin = kvtier.Client.connect(daemon.socket)
    assert admin.evict() > 0
    for p in range(1, 12):
        first.add(f"p{p}", prompts[p])
        first.run_until_idle()
    assert first.worker._worker.kept_blocks >= 6
    second = Engine(model_dir, daemon.socket)
    engines.append(second)
    held = daemon_counters(daemon)["engine_held"]
    second.add("again", prompts[0])
    new = schedule_when_answered(second, "again")
    assert new.num_computed_tokens == 6 * BLOCK  # type: ignore[attr-defined]
    second.run_until_idle()
    assert second.invalid_reported == set()
    for index in range(6):
        assert second.holds(new.block_ids[0][index], prompts[0], index), f"block {index} differs"  # type: ignore[attr-defined]
    # The engine keeps what it loaded: kvtierd's copies are evicted first.
    assert daemon_counters(daemon)["engine_held"] - held >= 6
    # Without keep_dropped, nothing brings them back.
    admin.evict()
    third = Engine(model_dir, daemon.socket, keep_dropped=False)
    engines.append(third)
    third.add("q0", prompts[0])
    third.run_until_idle()
    admin.evict()
    for p in range(1, 12):
        third.add(f"q{p}", prompts[p])
        third.run_until_idle()
    assert third.worker._worker.kept_blocks == 0
    fourth = Engine(model_dir, daemon.socket)
    engines.append(fourth)
    fourth.add("again", prompts[0])
    assert schedule_when_answered(fourth, "again").num_computed_tokens == 0  # type: ignore[attr-defined]
    admin.close()


def test_a_prefix_vllm_lets_go_of_in_the_step_that_wants_it_is_loaded_from_the_copy(
    model_dir: pathlib.Path, daemon: Daemon, engines: list[Engine]
) -> None:
    # vLLM schedules a step's requests in turn. Here a's new blocks are the
    # blocks that held p's prefix (the oldest in vLLM's free queue), and b,
    # scheduled after a in the same step, wants that prefix: vLLM's own
    # cache has let go of it, kvtierd never had it. The connector copies
    # the blocks in that step before anything writes them, and b's lookup,
    # answered after a took them, counts them: b loads them, bytes as p
    # computed them.
    engine = Engine(model_dir, daemon.socket, lookup_wait_ms=5000)
    engines.append(engine)
    p = [(11 * t + 7) % 1000 for t in range(6 * BLOCK + 1)]
    engine.add("p", p)
    engine.run_until_idle()
    for f in range(9):  # every block vLLM never used goes, after p's
        engine.add(f"f{f}", [(13 * t + 101 * f + 5) % 1000 for t in range(6 * BLOCK + 1)])
        engine.run_until_idle()
    admin = kvtier.Client.connect(daemon.socket)
    admin.evict()
    admin.close()
    engine.add("a", [(17 * t + 3) % 1000 for t in range(6 * BLOCK + 1)])
    b = p[: 6 * BLOCK] + [(19 * t + 1) % 1000 for t in range(2 * BLOCK + 1)]
    engine.add("b", b)
    out = engine.scheduler.schedule()
    new = {n.req_id: n for n in out.scheduled_new_reqs}  # type: ignore[attr-defined]
    assert set(new) == {"a", "b"}
    meta = out.kv_connector_metadata  # type: ignore[attr-defined]
    assert sum(len(spec.block_ids) for spec in meta.dropped) >= 6
    assert new["b"].num_computed_tokens == 6 * BLOCK, "b's prefix counted: its copies land before its loads"
    engine.step(scheduled=out)
    assert engine.invalid_reported == set()
    for index in range(6):
        assert engine.holds(new["b"].block_ids[0][index], b, index), f"block {index} differs"
    engine.run_until_idle()


def test_blocks_let_go_of_in_a_step_are_copied_as_chains_each_after_its_parent() -> None:
    from kvtier._vllm_scheduler import _chains

    dropped = [(0, b"s3", 13, b"s2"), (0, b"s2", 12, b"s1"), (0, b"x", 20, None), (0, b"s1", 11, b"s0"),
               (0, b"t", 30, b"s1"), (0, b"s4", 14, b"s3"), (1, b"s2", 40, b"s1"), (0, b"u", 31, b"q")]
    got = [(c.group, c.parent, c.block_hashes, c.block_ids) for c in _chains(dropped)]
    assert sorted(got, key=repr) == sorted([
        (0, None, [b"x"], [20]),
        (0, b"s0", [b"s1", b"s2", b"s3", b"s4"], [11, 12, 13, 14]),
        (0, b"s1", [b"t"], [30]),  # a branch off s1: its own chain
        (1, b"s1", [b"s2"], [40]),  # another group's s1 was not let go of
        (0, b"q", [b"u"], [31]),
    ], key=repr)


@pytest.mark.parametrize("layout", [layout.name for layout in KVCacheLayout])
def test_the_worker_moves_bytes_exactly_for_every_vllm_layout(
    model_dir: pathlib.Path, daemon: Daemon, engines: list[Engine], layout: str
) -> None:
    # Stored from one layout, loaded into another: kvtier keeps blocks in its
    # own order, so engines of different layouts share them.
    source = Engine(model_dir, daemon.socket, layout)
    engines.append(source)
    target = Engine(model_dir, daemon.socket, "BLHNC" if layout != "BLHNC" else "LBNHC")
    engines.append(target)
    generator = torch.Generator().manual_seed(5)
    for tensor in source.kv.values():
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    hashes = [bytes([i]) * 32 for i in range(1, 4)]
    source.worker.bind_connector_metadata(KvtierMetadata(stores=[TransferSpec("s", hashes, [3, 5, 7])]))
    source.worker.wait_for_save()
    source.worker.clear_connector_metadata()
    for _ in range(100):
        sending, _ = source.worker.get_finished({"s"})
        if sending == {"s"}:
            break
        time.sleep(0.01)
    else:
        raise AssertionError("the store never finished")

    target.worker.bind_connector_metadata(KvtierMetadata(loads=[TransferSpec("t", hashes, [1, 2, 9])]))
    target.worker.start_load_kv(None)  # type: ignore[arg-type]
    attention_waits(target.worker)
    target.worker.clear_connector_metadata()
    assert target.worker.get_block_ids_with_load_errors() == set()
    for name in LAYER_NAMES:
        for src, dst in ((3, 1), (5, 2), (7, 9)):
            assert torch.equal(source.kv[name][src], target.kv[name][dst]), (name, src, dst)
        assert not target.kv[name][0].any()  # nothing else written


def test_loads_by_layer_are_in_place_at_each_layers_wait_and_a_skipped_wait_means_recompute(
    model_dir: pathlib.Path, daemon: Daemon, engines: list[Engine]
) -> None:
    """Each layer's blocks are in place when its attention's wait returns.
    A forward pass that skips a layer's wait (a layer without vLLM's hooks)
    may have read a layer not in place yet: the step's loaded blocks are
    reported for recompute, and loads are whole from then on. With
    layerwise_load off, start_load_kv loads every block before the pass."""
    source = Engine(model_dir, daemon.socket)
    engines.append(source)
    generator = torch.Generator().manual_seed(9)
    for tensor in source.kv.values():
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    hashes = [bytes([i]) * 32 for i in range(40, 44)]
    source.worker.bind_connector_metadata(KvtierMetadata(stores=[TransferSpec("s", hashes, [3, 4, 5, 6])]))
    source.worker.wait_for_save()
    source.worker.clear_connector_metadata()
    for _ in range(100):
        if source.worker.get_finished({"s"})[0] == {"s"}:
            break
        time.sleep(0.01)
    else:
        raise AssertionError("the store never finished")

    def load(engine: Engine, waits: bool) -> set[int]:
        for tensor in engine.kv.values():
            tensor.zero_()
        engine.worker.bind_connector_metadata(KvtierMetadata(loads=[TransferSpec("t", hashes, [1, 2, 8, 9])]))
        engine.worker.start_load_kv(None)  # type: ignore[arg-type]
        if waits:
            for name in LAYER_NAMES:
                engine.worker.wait_for_layer_load(name)
                for src, dst in ((3, 1), (4, 2), (5, 8), (6, 9)):
                    assert torch.equal(source.kv[name][src], engine.kv[name][dst]), (name, src, dst)
        engine.worker.wait_for_save()
        engine.worker.clear_connector_metadata()
        return engine.worker.get_block_ids_with_load_errors()

    target = Engine(model_dir, daemon.socket)
    engines.append(target)
    assert load(target, waits=True) == set()
    assert load(target, waits=False) == {1, 2, 8, 9}, "a layer not waited for: every loaded block recomputed"
    # Whole loads from now on: in place when start_load_kv returns.
    target.worker.bind_connector_metadata(KvtierMetadata(loads=[TransferSpec("t", hashes, [1, 2, 8, 9])]))
    target.worker.start_load_kv(None)  # type: ignore[arg-type]
    for name in LAYER_NAMES:
        assert torch.equal(source.kv[name][4], target.kv[name][2]), name
    target.worker.wait_for_save()
    target.worker.clear_connector_metadata()
    assert target.worker.get_block_ids_with_load_errors() == set()

    whole = Engine(model_dir, daemon.socket, layerwise_load=False)
    engines.append(whole)
    assert load(whole, waits=False) == set()
    for name in LAYER_NAMES:
        assert torch.equal(source.kv[name][6], whole.kv[name][9]), name


def test_the_scheduler_learns_the_prefill_rate_from_the_workers_timed_forward_passes(
    model_dir: pathlib.Path, daemon: Daemon, engines: list[Engine]
) -> None:
    """Each forward pass of at least 128 tokens is timed by the worker (its
    waits for loads left out) and reaches the scheduler through vLLM's
    worker metadata; lookups give kvtierd the rate (load or recompute)."""
    engine = Engine(model_dir, daemon.socket)
    engines.append(engine)
    prefill = engine.scheduler.connector._scheduler._prefill
    assert prefill.tokens_per_s == 0
    engine.add("long", [(i * 7) % 100 + 1 for i in range(20 * BLOCK)])
    engine.run_until_idle()
    assert prefill.tokens_per_s > 0, "a prefill of 20 blocks was timed"
    assert engine.scheduler.connector._scheduler._lookups._prefill is prefill  # what its prefetches give
    off = Engine(model_dir, daemon.socket, load_or_recompute=False)
    engines.append(off)
    assert off.scheduler.connector._scheduler._lookups._prefill is None


def test_a_lookup_answered_in_time_is_used_in_the_step_it_was_asked(model_dir: pathlib.Path, daemon: Daemon) -> None:
    # The first ask waits for the answer (lookup_wait_ms; generous here, so a
    # busy machine cannot make the round trip late): no step goes by.
    engine = Engine(model_dir, daemon.socket, lookup_wait_ms=5000)
    try:
        request = engine.add("a", PREFIX + [1])
        assert engine.scheduler.connector.get_num_new_matched_tokens(request, 0) == (0, False)
    finally:
        engine.close()


def test_the_scheduler_never_waits_on_a_hung_daemon(model_dir: pathlib.Path, daemon: Daemon) -> None:
    engine = Engine(model_dir, daemon.socket, lookup_timeout_s=0.5)
    request = engine.add("a", PREFIX + [1])
    connector = engine.scheduler.connector
    assert daemon.process is not None
    watch = kvtier.Client.connect(daemon.socket, name="watch")
    before = watch.stats()["counters"]["lookups"]
    daemon.process.send_signal(signal.SIGSTOP)
    try:
        answers = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            started = time.monotonic()
            answer = connector.get_num_new_matched_tokens(request, 0)
            assert time.monotonic() - started < 0.05
            answers.append(answer)
            if answer[0] is not None:
                break
            time.sleep(0.02)
        assert answers[0] == (None, False)
        assert answers[-1] == (0, False)  # unanswered past lookup_timeout_s: a miss
        # More requests while it hangs: misses too, and their lookups are
        # dropped, not run once it answers again.
        for name in ("b", "c", "d"):
            later = engine.add(name, PREFIX + [2])
            deadline = time.monotonic() + 5
            while connector.get_num_new_matched_tokens(later, 0)[0] is None and time.monotonic() < deadline:
                time.sleep(0.02)
            assert connector.get_num_new_matched_tokens(later, 0) == (0, False)
        daemon.process.send_signal(signal.SIGCONT)
        # Back: a new request is answered at once, not behind a backlog (the
        # scheduler's calls waited at most lookup_timeout_s, then its
        # connection was dropped and made again).
        fresh = engine.add("e", PREFIX + [3])
        started = time.monotonic()
        while connector.get_num_new_matched_tokens(fresh, 0)[0] is None:
            assert time.monotonic() - started < 3, "the lookup after the hang waited behind stale ones"
            time.sleep(0.02)
        time.sleep(0.5)  # anything stale would have run by now
        # The fresh lookup, and the one asked as the daemon hung (its request
        # was sent): never the ones that waited behind it.
        assert watch.stats()["counters"]["lookups"] - before <= 2
    finally:
        daemon.process.send_signal(signal.SIGCONT)
        watch.close()
        engine.close()


def test_a_daemon_that_is_down_or_restarting_means_misses_never_errors(
    model_dir: pathlib.Path, daemon: Daemon, engines: list[Engine]
) -> None:
    daemon.stop()
    engine = Engine(model_dir, daemon.socket)  # the worker registers once it reaches the daemon
    engines.append(engine)
    engine.add("a", PREFIX + [1])
    new = schedule_when_answered(engine, "a")
    assert new.num_computed_tokens == 0
    engine.run_until_idle()

    daemon.start()
    time.sleep(1.1)  # past the connector's reconnect interval
    engine.add("b", PREFIX + [2])
    engine.run_until_idle()  # stored this time
    other = Engine(model_dir, daemon.socket)
    engines.append(other)
    other.add("c", PREFIX + [3])
    assert schedule_when_answered(other, "c").num_computed_tokens == 6 * BLOCK

    daemon.stop(signal.SIGKILL)  # host blocks die with it
    daemon.start()
    other.add("d", PREFIX + [4])
    for _ in range(300):  # every answer a miss until the client is back
        out = other.step()
        if any(n.req_id == "d" for n in out.scheduled_new_reqs):
            break
        time.sleep(0.01)
    other.run_until_idle()
    assert os.path.exists(daemon.socket)


def test_a_preempted_requests_stores_end_before_its_blocks_are_reused(
    model_dir: pathlib.Path, daemon: Daemon, engines: list[Engine]
) -> None:
    source = Engine(model_dir, daemon.socket)
    engines.append(source)
    generator = torch.Generator().manual_seed(9)
    for tensor in source.kv.values():
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    original = {name: tensor[[4, 6]].clone() for name, tensor in source.kv.items()}
    hashes = [bytes([40 + i]) * 32 for i in range(2)]
    source.worker.bind_connector_metadata(KvtierMetadata(stores=[TransferSpec("p", hashes, [4, 6])]))
    source.worker.wait_for_save()
    source.worker.clear_connector_metadata()
    # The next step's plan names "p" preempted: its stores are over once
    # handle_preemptions returns, and vLLM may hand its blocks to others.
    source.worker.handle_preemptions(KvtierMetadata(preempted={"p"}))
    for tensor in source.kv.values():
        tensor[[4, 6]] = 0.0
    target = Engine(model_dir, daemon.socket)
    engines.append(target)
    target.worker.bind_connector_metadata(KvtierMetadata(loads=[TransferSpec("q", hashes, [10, 11])]))
    target.worker.start_load_kv(None)  # type: ignore[arg-type]
    attention_waits(target.worker)
    target.worker.clear_connector_metadata()
    assert target.worker.get_block_ids_with_load_errors() == set()
    for name, tensor in target.kv.items():
        assert torch.equal(tensor[[10, 11]], original[name])
    # The preempted request still ends through get_finished once it finishes.
    sending, _ = source.worker.get_finished({"p"})
    assert sending == {"p"}


def test_request_hints_are_read_from_kv_transfer_params_and_bad_ones_ignored() -> None:
    from types import SimpleNamespace

    from kvtier.vllm import RequestHint

    def of(params: object) -> RequestHint | None:
        return RequestHint.of(SimpleNamespace(request_id="r", kv_transfer_params=params))  # type: ignore[arg-type]

    assert of(None) is None
    assert of(["not", "a", "dict"]) is None
    assert of({"other_connector": 1}) is None
    assert of({"kvtier": {"priority": 1, "next_use_ms": 30000}}) == RequestHint(1, 30000, False)
    assert of({"kvtier": {"session_over": True}}) == RequestHint(0, 0, True)
    assert of({"kvtier": {"priority": 0}}) is None  # no hint at all
    for bad in (
        {"priority": 7},
        {"priority": True},
        {"priority": "1"},
        {"next_use_ms": -1},
        {"next_use_ms": 3_600_001},
        {"next_use_ms": 1.5},
        {"session_over": "yes"},
        {"keep": True},
        "keep",
    ):
        assert of({"kvtier": bad}) is None, bad


def test_a_kv_cache_group_of_state_is_refused_at_start_by_name(model_dir: pathlib.Path, daemon: Daemon) -> None:
    """A Mamba group (a state per request, not KV per token) stops the
    connector at start with a message naming its kind and layers."""
    from vllm.v1.kv_cache_interface import MambaSpec

    config = vllm_config(model_dir, daemon.socket)
    full = KVCacheGroupSpec(LAYER_NAMES[:1], FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32))
    mamba = KVCacheGroupSpec(["model.layers.1.mixer"], MambaSpec(block_size=BLOCK, shapes=((4, 64),), dtypes=(torch.float32,)))
    plan = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[full, mamba])
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(NotImplementedError, match=r"MambaSpec KV caches \(group 1: model\.layers\.1\.mixer\)"):
            KvtierConnector(config, role, plan)


def test_a_lookup_hits_only_as_far_as_every_sliding_window_before_the_end_is_cached(daemon: Daemon) -> None:
    """Groups of vLLM's hybrid manager: a full-attention one holds 10 blocks,
    a sliding-window one (2 blocks a hit reads) the windows before blocks 4
    and 8 only. The hit ends at 8: the window before 10 lacks block 8, the
    one before 8 is whole. With the window before 4 only, the hit ends at 4;
    with no window, there is none."""
    from kvtier._vllm_common import _Group, _Settings
    from kvtier._vllm_scheduler import _Lookups

    settings = _Settings(socket=daemon.socket, token=None, model_id="m", lookup_timeout_s=30, lookup_wait_s=30, op_timeout_s=10)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32)
    groups = [_Group(0, ("full",), spec, None), _Group(1, ("sliding",), spec, 2)]
    layouts = [kvtier.Layout(f"m|kv-group={g}/2", 1, KV_HEADS, HEAD, "fp32", BLOCK) for g in range(2)]
    hashes = [bytes([i]) * 32 for i in range(10)]
    others = [bytes([100 + i]) * 32 for i in range(10)]
    with kvtier.Client.connect(daemon.socket, name="pytest") as client:
        cpus = [kvtier.CpuKvCache(layout, 16) for layout in layouts]
        caches = [client.register_cpu_cache(cpu) for cpu in cpus]

        def store(group: int, chain: list[bytes], blocks: list[int]) -> None:
            keys = [client.key_from_engine_hash(caches[group], chain[b]) for b in blocks]
            assert client.store(caches[group], keys, blocks).blocks == len(blocks)

        def hits(req_id: str, chain: list[bytes]) -> int | None:
            lookups = _Lookups(settings, groups, [[layout] for layout in layouts])
            try:
                return lookups.result(req_id, chain)
            finally:
                lookups.close()

        store(0, hashes, list(range(10)))
        store(1, hashes, [2, 3])
        assert hits("a", hashes) == 4
        store(1, hashes, [6, 7])
        assert hits("b", hashes) == 8
        store(0, others, list(range(10)))
        assert hits("c", others) == 0
