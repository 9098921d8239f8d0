"""KV events from a real kvtierd, read by real consumers: a subscriber of its
own (pyzmq and msgpack) that applies every batch in sequence and recovers
gaps through the replay socket, and vLLM's own event classes
(vllm.distributed.kv_events) decoding every batch. After each scenario the
blocks the consumer holds, per medium, are what kvtierd's Stats say it holds.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import time
from typing import Any, Iterator

import msgpack
import msgspec
import pytest
import zmq
from vllm.distributed import kv_events as vllm_events

import kvtier
from conftest import Daemon, small_layout

BLOCK_TOKENS = 16
END_SEQ = b"\xff" * 8


class LegacyBlockStored(vllm_events.BlockStored, array_like=True, tag="BlockStored"):
    """vLLM's BlockStored as vLLM encoded it before #42892: positional."""


class LegacyBlockRemoved(vllm_events.BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class LegacyAllBlocksCleared(vllm_events.AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class LegacyBatch(vllm_events.EventBatch):
    events: list[LegacyBlockStored | LegacyBlockRemoved | LegacyAllBlocksCleared]


class Consumer:
    """What a KV-aware router keeps of one node: hashes per medium, applied
    in sequence order; a gap is filled from the replay socket first."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str, rcvhwm: int = 100000) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.ctx = ctx
        self.last_seq = -1
        self.held: dict[str, set[int | bytes]] = {}
        self.topics: set[bytes] = set()
        self.events: list[Any] = []  # every event applied, in order
        self.gaps = 0
        self.replayed = 0
        self.restarts = 0

    def close(self) -> None:
        self.sub.close(linger=0)

    def replay_from(self, start: int) -> list[tuple[int, bytes, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        while True:
            assert poller.poll(5000), "the replay socket did not answer"
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            if frames[2] == END_SEQ:
                break
            topic, seq, payload = frames[1], int.from_bytes(frames[2], "big"), frames[3]
            out.append((seq, topic, payload))
        dealer.close(linger=0)
        return out

    def apply(self, seq: int, topic: bytes, payload: bytes, live: bool = False) -> None:
        if live and seq < self.last_seq:
            # A lower sequence on the live stream: kvtierd started again
            # (docs/kv-events.md); its stream starts over here.
            self.restarts += 1
            self.last_seq = seq - 1
        if seq <= self.last_seq:
            return  # seen already (a replay overlapping the stream)
        if seq > self.last_seq + 1:
            self.gaps += 1
            for rseq, rtopic, rpayload in self.replay_from(self.last_seq + 1):
                if rseq < seq:
                    self.replayed += 1
                    self.apply(rseq, rtopic, rpayload)
            assert self.last_seq == seq - 1, f"replay did not fill the gap before {seq} (at {self.last_seq})"
        self.last_seq = seq
        self.topics.add(topic)
        ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and ts > 1.6e9
        for e in events:
            kind = e["type"] if isinstance(e, dict) else e[0]
            self.events.append(e)
            if kind == "AllBlocksCleared":
                self.held.clear()
            elif kind == "BlockStored":
                for h in e["block_hashes"]:
                    self.held.setdefault(e["medium"], set()).add(h)
            elif kind == "BlockRemoved":
                for h in e["block_hashes"]:
                    assert h in self.held.get(e["medium"], set()), f"{h} removed from {e['medium']} unseen"
                    self.held[e["medium"]].discard(h)
            else:
                raise AssertionError(f"unknown event {e!r}")

    def drain(self, quiet: float = 0.15, limit: float = 10.0) -> None:
        """Applies what arrives until nothing has for `quiet` seconds; then
        asks the replay socket for anything newer (a lost tail shows no gap
        until the next batch, so a router asks when the stream is quiet)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if not self.sub.poll(int(quiet * 1000)):
                break
            topic, seq, payload = self.sub.recv_multipart()
            self.apply(int.from_bytes(seq, "big"), topic, payload, live=True)
        for seq, topic, payload in self.replay_from(self.last_seq + 1):
            self.replayed += 1
            self.apply(seq, topic, payload)

    def counts(self) -> dict[str, int]:
        return {m: len(h) for m, h in self.held.items() if h}


class Node:
    """A kvtierd with KV events on (in a directory of its own), with a
    subscriber and a client; `restart` stops it (SIGTERM) and starts it
    again with new ones."""

    def __init__(self, directory: str, extra: list[str], rcvhwm: int) -> None:
        settings = [
            f"tenants=[{{name: local, uid: {os.getuid()}, admin: true, publish_events: true, model: m1}}]",
            "events.enabled=true",
            f"events.endpoint=ipc://{directory}/events",
            f"events.replay_endpoint=ipc://{directory}/replay",
            "events.node=node-a",
            "events.cadence_ms=2",
            "tiers.hbm.enabled=true",  # a CPU arena on the host backend: 32 blocks of 16 KiB
            "tiers.hbm.bytes=512KiB",
            "tiers.host.bytes=2MiB",  # 128 blocks
            "tiers.disk.enabled=true",
            "tiers.disk.bytes=16MiB",
            "tiers.disk.region_bytes=1MiB",
            "policy.disk_promotion_min_hits=0",  # a block read from disk stays in host
            *extra,
        ]
        self.daemon = Daemon(directory, settings)
        self.rcvhwm = rcvhwm
        self.ctx = zmq.Context()
        self.daemon.start()
        self._open()

    def _open(self) -> None:
        d = self.daemon.directory
        self.consumer = Consumer(self.ctx, f"ipc://{d}/events", f"ipc://{d}/replay", self.rcvhwm)
        self.client = kvtier.Client.connect(self.daemon.socket, name="events")
        time.sleep(0.2)  # the subscription reaches the publisher

    def _close(self) -> None:
        self.client.close()
        self.consumer.close()

    def catch_up(self) -> None:
        """What went out before the subscriber joined (the start's clear
        marker, a restart's snapshot), from the replay socket."""
        for seq, topic, payload in self.consumer.replay_from(0):
            self.consumer.apply(seq, topic, payload)

    def restart(self) -> None:
        self._close()
        self.daemon.stop()
        self.daemon.start()
        self._open()

    def stop(self) -> None:
        self._close()
        self.daemon.stop()
        self.ctx.term()


@contextlib.contextmanager
def running(extra: list[str] = (), rcvhwm: int = 100000) -> Iterator[Node]:
    with tempfile.TemporaryDirectory(prefix="kvtier-events-") as directory:
        n = Node(directory, list(extra), rcvhwm)
        try:
            yield n
        finally:
            n.stop()


@pytest.fixture
def node() -> Iterator[Node]:
    with running() as n:
        yield n


def tier_blocks(client: kvtier.Client) -> dict[str, int]:
    """Blocks per medium, as kvtierd counts them: present where they can be
    served from (a block in memory that keeps its disk record is in both).
    The tiers' own counts (a block counted where it lives) must agree."""
    stats = client.stats()
    c = stats["counters"]
    present = {"GPU": c["blocks_present_hbm"], "CPU": c["blocks_present_host"], "DISK": c["blocks_present_disk"],
               "EXTERNAL": c["blocks_present_remote"]}
    tiers = {t["tier"]: t["blocks"] for t in stats["tiers"]}
    assert (present["GPU"], present["CPU"]) == (tiers.get("hbm", 0), tiers.get("host", 0))
    assert tiers.get("disk", 0) <= present["DISK"] <= sum(tiers.values())
    return {m: n for m, n in present.items() if n}


def settle(node: Node, limit: float = 20.0) -> None:
    """Waits for kvtierd's background work to end (writes to disk, evicts),
    then for the consumer to have every event; asserts that it holds what
    kvtierd holds, per medium."""
    client, consumer = node.client, node.consumer
    deadline = time.monotonic() + limit
    while True:
        stats = client.stats()
        s = stats["counters"]
        if s.get("disk_writes_pending", 0) == 0 and s.get("evicts_pending", 0) == 0 and stats["inflight_ops"] == 0:
            consumer.drain()
            if consumer.counts() == tier_blocks(client):
                return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert consumer.counts() == tier_blocks(client), "the events do not add up to what kvtierd holds"


class Prompts:
    """Prompts stored with the engine's view of each block: its hash (a
    64-bit int, as vLLM sends them), parent, tokens."""

    def __init__(self, client: kvtier.Client, cache: Any, seed: int) -> None:
        self.client, self.cache = client, cache
        self.rng = random.Random(seed)
        self.engine_hash: dict[bytes, int] = {}  # key -> engine hash
        self.tokens: dict[int, list[int]] = {}   # engine hash -> its tokens

    def make(self, blocks: int) -> tuple[list[bytes], list[int], list[int]]:
        tokens = [self.rng.randrange(0, 128000) for _ in range(blocks * BLOCK_TOKENS)]
        keys = self.client.compute_keys(self.cache, tokens)
        hashes = [self.rng.getrandbits(64) for _ in keys]
        for i, (k, h) in enumerate(zip(keys, hashes)):
            self.engine_hash[k] = h
            self.tokens[h] = tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
        return keys, hashes, tokens

    def store(self, keys: list[bytes], hashes: list[int], tokens: list[int], slots: list[int]) -> int:
        return self.client.store(
            self.cache, keys, slots, engine_hashes=hashes, token_ids=tokens, block_size=BLOCK_TOKENS
        ).blocks


def test_a_subscriber_sees_every_tier_change_in_order(node: Node) -> None:
    client, consumer = node.client, node.consumer
    node.catch_up()
    assert consumer.events and consumer.events[0] == {"type": "AllBlocksCleared"}
    assert consumer.topics == {b"kv@node-a@m1"}

    cache = client.register_cpu_cache(kvtier.CpuKvCache(small_layout(), 64))
    prompts = Prompts(client, cache, seed=1)
    keys, hashes, tokens = prompts.make(8)
    assert prompts.store(keys, hashes, tokens, list(range(8))) == 8
    settle(node)
    stored = [e for e in consumer.events if e["type"] == "BlockStored"]
    assert [e["block_hashes"] for e in stored] == [[h] for h in hashes]
    assert [e["parent_block_hash"] for e in stored] == [None] + hashes[:-1]
    assert [e["token_ids"] for e in stored] == [prompts.tokens[h] for h in hashes]
    # hbm (GPU) first: a CPU arena stands in on the host backend.
    assert {(e["medium"], e["block_size"], e["lora_name"]) for e in stored} == {("GPU", BLOCK_TOKENS, None)}

    # Past host's 128 blocks: the oldest go to disk (a removal from CPU, a
    # store in DISK).
    for _ in range(12):  # in steps the disk writes keep up with
        more, more_hashes, more_tokens = prompts.make(16)
        assert prompts.store(more, more_hashes, more_tokens, list(range(16, 32))) == 16
        settle(node)
    assert set(hashes) <= consumer.held["DISK"], (consumer.counts(), client.stats()["counters"])
    removed_cpu = {h for e in consumer.events if e["type"] == "BlockRemoved" and e["medium"] == "CPU"
                   for h in e["block_hashes"]}
    assert set(hashes) <= removed_cpu

    # A load reads them back up: in memory again (and still on disk).
    assert client.load(cache, keys, list(range(8))).blocks == 8
    settle(node)
    in_memory = consumer.held.get("CPU", set()) | consumer.held.get("GPU", set())
    assert set(hashes) <= in_memory and set(hashes) <= consumer.held["DISK"]

    # A flush writes what host holds to disk as well.
    client.flush()
    settle(node)
    assert consumer.held["CPU"] <= consumer.held["DISK"]

    # Evict everything: each block's removal, then the clear marker.
    client.evict()
    settle(node)
    assert consumer.counts() == {} and tier_blocks(client) == {}
    assert consumer.events[-1] == {"type": "AllBlocksCleared"}
    counters = client.stats()["counters"]
    assert counters["events_dropped"] == 0
    assert counters["events_published"] == len(consumer.events)
    assert counters["events_blocks_tracked"] == 0 and counters["events_metadata_bytes"] == 0
    assert consumer.gaps == 0 and consumer.replayed == 0


def test_a_gap_is_recovered_through_the_replay_socket() -> None:
    # A subscriber that reads late with a queue of 2 messages: ZMQ drops what
    # does not fit, so its sequence has gaps.
    with running(["events.send_hwm=2", "events.max_batch_events=4"], rcvhwm=2) as n:
        n.catch_up()
        cache = n.client.register_cpu_cache(kvtier.CpuKvCache(small_layout(), 64))
        prompts = Prompts(n.client, cache, seed=2)
        for _ in range(6):
            keys, hashes, tokens = prompts.make(32)
            prompts.store(keys, hashes, tokens, list(range(32)))
        time.sleep(0.5)  # not reading: the queues overflow
        settle(n)
        assert n.consumer.gaps > 0 and n.consumer.replayed > 0, "no gap was made: the test proves nothing"
        assert n.client.stats()["counters"]["events_replays_served"] >= n.consumer.gaps


def test_a_restart_ends_in_a_consistent_snapshot() -> None:
    # No hbm tier: a stop writes host blocks to disk, not hbm's. A queue of
    # 16 events: the snapshot of 40 blocks waits for room, it drops nothing.
    with running(["tiers.hbm.enabled=false", "events.max_queued_events=16"]) as n:
        cache = n.client.register_cpu_cache(kvtier.CpuKvCache(small_layout(), 64))
        prompts = Prompts(n.client, cache, seed=3)
        keys, hashes, tokens = prompts.make(40)
        prompts.store(keys, hashes, tokens, list(range(40)))
        n.restart()  # SIGTERM: a clean stop; host blocks are written to disk and come back
        n.catch_up()
        assert n.consumer.events[0] == {"type": "AllBlocksCleared"}, "a restart starts with the clear marker"
        settle(n)
        assert n.consumer.held == {"DISK": set(hashes)}
        # What routers need came back from the disk records.
        by_hash = {e["block_hashes"][0]: e for e in n.consumer.events if e["type"] == "BlockStored"}
        for i, h in enumerate(hashes):
            assert by_hash[h]["token_ids"] == prompts.tokens[h]
            assert by_hash[h]["parent_block_hash"] == (hashes[i - 1] if i else None)
        counters = n.client.stats()["counters"]
        assert counters["events_blocks_tracked"] == len(hashes) and counters["events_dropped"] == 0


def test_a_subscriber_connected_across_a_restart_gets_it_live() -> None:
    # The subscriber stays connected through a restart (ZMQ reconnects it).
    # kvtierd's first batches wait until it is back, so the clear marker and
    # the snapshot reach it on the live stream, with nothing asked and
    # nothing else happening on the node. Before, they went out before it
    # was back, and an idle node never told it.
    with running(["tiers.hbm.enabled=false"]) as n:
        cache = n.client.register_cpu_cache(kvtier.CpuKvCache(small_layout(), 64))
        prompts = Prompts(n.client, cache, seed=5)
        keys, hashes, tokens = prompts.make(20)
        prompts.store(keys, hashes, tokens, list(range(20)))
        settle(n)
        n.client.close()
        n.daemon.stop()  # SIGTERM: host blocks are written to disk and come back
        n.daemon.start()
        n.client = kvtier.Client.connect(n.daemon.socket, name="events")
        consumer = n.consumer
        deadline = time.monotonic() + 10
        # (The old kvtierd's last batch, its blocks written to disk at the
        # stop, may come first.)
        while time.monotonic() < deadline and (consumer.restarts == 0 or consumer.held != {"DISK": set(hashes)}):
            if consumer.sub.poll(200):
                topic, seq, payload = consumer.sub.recv_multipart()
                consumer.apply(int.from_bytes(seq, "big"), topic, payload, live=True)
        assert consumer.restarts == 1, "the sequence started over"
        assert consumer.gaps == 0, "nothing was missed: the first batches waited for the subscriber"
        assert consumer.held == {"DISK": set(hashes)}


@pytest.mark.parametrize("encoding,hash_kind", [("map", "u64"), ("positional", "bytes")])
def test_vllm_decodes_every_batch(encoding: str, hash_kind: str) -> None:
    with running([f"events.encoding={encoding}", f"events.hash={hash_kind}"]) as n:
        cache = n.client.register_cpu_cache(kvtier.CpuKvCache(small_layout(), 64))
        rng = random.Random(4)
        tokens = [rng.randrange(0, 128000) for _ in range(8 * BLOCK_TOKENS)]
        keys = n.client.compute_keys(cache, tokens)
        digests = [rng.randbytes(32) for _ in keys]  # sha256-sized engine hashes
        parent = rng.randbytes(32)
        n.client.store(cache, keys, list(range(8)), engine_hashes=digests, parent_hash=parent,
                       token_ids=tokens, block_size=BLOCK_TOKENS, lora_name="adapter-1")
        n.client.evict()
        decoder = msgspec.msgpack.Decoder(vllm_events.KVEventBatch if encoding == "map" else LegacyBatch)
        # The events go out at the publisher's cadence: replay until the
        # evict's are there (a loaded machine may take a while).
        deadline = time.monotonic() + 10
        while True:
            batches = n.consumer.replay_from(0)
            decoded = [e for _, _, payload in batches for e in decoder.decode(payload).events]
            stored = [e for e in decoded if type(e).__name__.endswith("BlockStored")]
            removed = [e for e in decoded if type(e).__name__.endswith("BlockRemoved")]
            cleared = [e for e in decoded if type(e).__name__.endswith("AllBlocksCleared")]
            if len(removed) >= 8 and len(cleared) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(batches) >= 2
        assert len(stored) == 8 and len(removed) == 8 and len(cleared) == 2  # the start's, the evict's
        expect = [int.from_bytes(h[-8:], "big") for h in digests] if hash_kind == "u64" else digests
        expect_parent = int.from_bytes(parent[-8:], "big") if hash_kind == "u64" else parent
        assert [e.block_hashes for e in stored] == [[h] for h in expect]
        assert [e.parent_block_hash for e in stored] == [expect_parent] + expect[:-1]
        assert [e.token_ids for e in stored] == [tokens[i * 16 : (i + 1) * 16] for i in range(8)]
        # hbm (GPU): a CPU arena stands in on the host backend.
        assert {(e.block_size, e.medium, e.lora_name, e.lora_id) for e in stored} == {
            (BLOCK_TOKENS, "GPU", "adapter-1", None)}
        assert sorted(e.block_hashes[0] for e in removed) == sorted(expect)


def test_a_long_mixed_run_adds_up(node: Node) -> None:
    client, consumer = node.client, node.consumer
    node.catch_up()
    cache = client.register_cpu_cache(kvtier.CpuKvCache(small_layout(), 64))
    prompts = Prompts(client, cache, seed=5)
    rng = random.Random(6)
    stored: list[tuple[list[bytes], list[int], list[int]]] = []
    sizes: list[int] = []  # blocks held at each check
    for step in range(2000):
        op = rng.random()
        if op < 0.55 or not stored:
            p = prompts.make(rng.randrange(1, 9))
            try:
                prompts.store(*p, list(range(len(p[0]))))
            except kvtier.ResourceExhaustedError:
                pass  # host full of blocks being written (a flush): an engine goes on without caching
            stored.append(p)
        elif op < 0.85:
            keys = rng.choice(stored)[0]
            client.load(cache, keys, list(range(32, 32 + len(keys))))
        elif op < 0.95:
            client.flush()
        else:
            client.evict(tier=rng.choice(["host", "disk"]))
        if step % 200 == 199:
            settle(node)
            sizes.append(sum(consumer.counts().values()))
    settle(node)
    counters = client.stats()["counters"]
    assert counters["events_dropped"] == 0 and consumer.gaps == 0 and consumer.replayed == 0
    assert max(sizes) > 100, sizes
    kinds = {(e["type"], e.get("medium")) for e in consumer.events}
    assert {("BlockStored", "GPU"), ("BlockStored", "CPU"), ("BlockStored", "DISK"), ("BlockRemoved", "GPU"),
            ("BlockRemoved", "CPU"), ("BlockRemoved", "DISK")} <= kinds, kinds


def test_bad_event_metadata_is_a_clear_error(node: Node) -> None:
    client = node.client
    cache = client.register_cpu_cache(kvtier.CpuKvCache(small_layout(), 8))
    tokens = list(range(2 * BLOCK_TOKENS))
    keys = client.compute_keys(cache, tokens)
    with pytest.raises(kvtier.InvalidArgumentError, match="engine hashes"):
        client.store(cache, keys, [0, 1], engine_hashes=[1], block_size=BLOCK_TOKENS)
    with pytest.raises(kvtier.InvalidArgumentError, match="token ids"):
        client.store(cache, keys, [0, 1], engine_hashes=[1, 2], token_ids=tokens[:5], block_size=BLOCK_TOKENS)
    with pytest.raises(kvtier.InvalidArgumentError, match="mixed"):
        client.store(cache, keys, [0, 1], engine_hashes=[1, b"\x01\x02"], block_size=BLOCK_TOKENS)
    with pytest.raises(kvtier.InvalidArgumentError, match="go with engine_hashes"):
        client.store(cache, keys, [0, 1], token_ids=tokens, block_size=BLOCK_TOKENS)
    assert client.lookup(cache, keys).hits == 0, "a refused store stored nothing"
    assert client.store(cache, keys, [0, 1], engine_hashes=[1, 2], token_ids=tokens,
                        block_size=BLOCK_TOKENS).blocks == 2


def test_blocks_put_to_the_remote_tier_are_external() -> None:
    from redis_cluster import RedisCluster

    cluster = RedisCluster(masters=3, replicas=0)
    try:
        # No hbm or disk: `write: store` puts what reaches host.
        with running(["tiers.remote.enabled=true", f"tiers.remote.seeds=[{','.join(cluster.seeds)}]",
                      "tiers.remote.write=store", "tiers.disk.enabled=false", "tiers.hbm.enabled=false"]) as n:
            n.catch_up()
            cache = n.client.register_cpu_cache(kvtier.CpuKvCache(small_layout(), 64))
            prompts = Prompts(n.client, cache, seed=7)
            keys, hashes, tokens = prompts.make(8)
            prompts.store(keys, hashes, tokens, list(range(8)))
            deadline = time.monotonic() + 20
            while n.client.stats()["counters"].get("remote_writes", 0) < 8 and time.monotonic() < deadline:
                time.sleep(0.05)
            settle(n)
            assert n.consumer.held == {"CPU": set(hashes), "EXTERNAL": set(hashes)}
            # This node forgets them: the cluster's copies are no longer its to announce.
            n.client.evict()
            settle(n)
            assert n.consumer.counts() == {}
    finally:
        cluster.stop()
