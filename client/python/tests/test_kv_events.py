"""KV events from a real kvtierd, read by real consumers: a subscriber of its
own (pyzmq and msgpack) that applies every batch in sequence and recovers
gaps through the replay socket, and vLLM's own event classes
(vllm.distributed.kv_events) decoding every batch. After each scenario the
blocks the consumer holds, per medium, are what kvtierd's Stats say it holds.
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import time
from typing import Any, Iterator

import msgpack
import msgspec
import numpy as np
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

    def apply(self, seq: int, topic: bytes, payload: bytes) -> None:
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
            self.apply(int.from_bytes(seq, "big"), topic, payload)
        for seq, topic, payload in self.replay_from(self.last_seq + 1):
            self.replayed += 1
            self.apply(seq, topic, payload)

    def counts(self) -> dict[str, int]:
        return {m: len(h) for m, h in self.held.items() if h}


def uid() -> int:
    return os.getuid()


def events_daemon(directory: str, extra: list[str] = ()) -> Daemon:
    settings = [
        f"tenants=[{{name: local, uid: {uid()}, admin: true, publish_events: true, model: m1}}]",
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
    return Daemon(directory, settings)


@pytest.fixture
def node() -> Iterator[tuple[Daemon, zmq.Context]]:
    with tempfile.TemporaryDirectory(prefix="kvtier-events-") as directory:
        d = events_daemon(directory)
        d.start()
        ctx = zmq.Context()
        try:
            yield d, ctx
        finally:
            d.stop()
            ctx.term()


def endpoints(d: Daemon) -> tuple[str, str]:
    return f"ipc://{d.directory}/events", f"ipc://{d.directory}/replay"


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


def settle(client: kvtier.Client, consumer: Consumer, limit: float = 20.0) -> None:
    """Waits for kvtierd's background work to end (writes to disk, evicts),
    then for the consumer to have every event; asserts that it holds what
    kvtierd holds, per medium."""
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


def test_a_subscriber_sees_every_tier_change_in_order(node: tuple[Daemon, zmq.Context]) -> None:
    d, ctx = node
    consumer = Consumer(ctx, *endpoints(d))
    client = kvtier.Client.connect(d.socket, name="events")
    try:
        time.sleep(0.2)  # the subscription reaches the publisher
        # What went out before the subscriber joined comes from the replay
        # socket: the start's snapshot marker.
        for seq, topic, payload in consumer.replay_from(0):
            consumer.apply(seq, topic, payload)
        assert consumer.events and consumer.events[0] == {"type": "AllBlocksCleared"}
        assert consumer.topics == {b"kv@node-a@m1"}

        cache = client.register_cpu_cache(kvtier.CpuKvCache(small_layout(), 64))
        prompts = Prompts(client, cache, seed=1)
        keys, hashes, tokens = prompts.make(8)
        assert prompts.store(keys, hashes, tokens, list(range(8))) == 8
        settle(client, consumer)
        stored = [e for e in consumer.events if e["type"] == "BlockStored"]
        assert [e["block_hashes"] for e in stored] == [[h] for h in hashes]
        assert [e["parent_block_hash"] for e in stored] == [None] + hashes[:-1]
        assert [e["token_ids"] for e in stored] == [prompts.tokens[h] for h in hashes]
        # hbm (GPU) first: a CPU arena stands in on the host backend.
        assert {(e["medium"], e["block_size"], e["lora_name"]) for e in stored} == {("GPU", BLOCK_TOKENS, None)}

        # Past host's 128 blocks: the oldest go to disk (a removal from CPU,
        # a store in DISK).
        for _ in range(12):  # in steps the disk writes keep up with
            more, more_hashes, more_tokens = prompts.make(16)
            assert prompts.store(more, more_hashes, more_tokens, list(range(16, 32))) == 16
            settle(client, consumer)
        assert set(hashes) <= consumer.held["DISK"], (consumer.counts(), client.stats()["counters"])
        removed_cpu = {h for e in consumer.events if e["type"] == "BlockRemoved" and e["medium"] == "CPU"
                       for h in e["block_hashes"]}
        assert set(hashes) <= removed_cpu

        # A load reads them back up: present in CPU again (and still on disk).
        assert client.load(cache, keys, list(range(8))).blocks == 8
        settle(client, consumer)
        in_memory = consumer.held.get("CPU", set()) | consumer.held.get("GPU", set())
        assert set(hashes) <= in_memory and set(hashes) <= consumer.held["DISK"]

        # A flush writes what host holds to disk as well.
        client.flush()
        settle(client, consumer)
        assert consumer.held["CPU"] <= consumer.held["DISK"]

        # Evict everything: each block's removal, then the clear marker.
        client.evict()
        settle(client, consumer)
        assert consumer.counts() == {} and tier_blocks(client) == {}
        assert consumer.events[-1] == {"type": "AllBlocksCleared"}
        counters = client.stats()["counters"]
        assert counters["events_dropped"] == 0
        assert counters["events_published"] == len(consumer.events)
        assert counters["events_blocks_tracked"] == 0 and counters["events_metadata_bytes"] == 0
        assert consumer.gaps == 0 and consumer.replayed == 0
    finally:
        client.close()
        consumer.close()


def test_a_gap_is_recovered_through_the_replay_socket() -> None:
    with tempfile.TemporaryDirectory(prefix="kvtier-events-") as directory:
        # A subscriber that reads late with a queue of 2 messages: ZMQ drops
        # what does not fit, so its sequence has gaps.
        d = events_daemon(directory, ["events.send_hwm=2", "events.max_batch_events=4"])
        d.start()
        ctx = zmq.Context()
        consumer = Consumer(ctx, *endpoints(d), rcvhwm=2)
        client = kvtier.Client.connect(d.socket, name="events")
        try:
            time.sleep(0.2)
            consumer.last_seq = 0  # the start's marker (seq 0) was before it joined
            consumer.held.clear()
            cache = client.register_cpu_cache(kvtier.CpuKvCache(small_layout(), 64))
            prompts = Prompts(client, cache, seed=2)
            for _ in range(6):
                keys, hashes, tokens = prompts.make(32)
                prompts.store(keys, hashes, tokens, list(range(32)))
            time.sleep(0.5)  # not reading: the queues overflow
            settle(client, consumer)
            assert consumer.gaps > 0 and consumer.replayed > 0, "no gap was made: the test proves nothing"
            counters = client.stats()["counters"]
            assert counters["events_replays_served"] >= consumer.gaps
        finally:
            client.close()
            consumer.close()
            d.stop()
            ctx.term()


def test_a_restart_ends_in_a_consistent_snapshot() -> None:
    with tempfile.TemporaryDirectory(prefix="kvtier-events-") as directory:
        # No hbm tier: a stop writes host blocks to disk, not hbm's.
        d = events_daemon(directory, ["tiers.hbm.enabled=false"])
        d.start()
        client = kvtier.Client.connect(d.socket, name="events")
        cache = client.register_cpu_cache(kvtier.CpuKvCache(small_layout(), 64))
        prompts = Prompts(client, cache, seed=3)
        keys, hashes, tokens = prompts.make(40)
        prompts.store(keys, hashes, tokens, list(range(40)))
        client.flush()
        deadline = time.monotonic() + 20
        while client.stats()["counters"].get("disk_writes_pending", 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        client.close()
        d.stop()  # SIGTERM: a clean stop; what is on disk comes back

        d.start()
        ctx = zmq.Context()
        consumer = Consumer(ctx, *endpoints(d))
        client = kvtier.Client.connect(d.socket, name="events")
        try:
            time.sleep(0.2)
            for seq, topic, payload in consumer.replay_from(0):
                consumer.apply(seq, topic, payload)
            assert consumer.events[0] == {"type": "AllBlocksCleared"}, "a restart starts with the clear marker"
            settle(client, consumer)
            assert consumer.held == {"DISK": set(hashes)}
            # What routers need came back from the disk records.
            by_hash = {e["block_hashes"][0]: e for e in consumer.events if e["type"] == "BlockStored"}
            for i, h in enumerate(hashes):
                assert by_hash[h]["token_ids"] == prompts.tokens[h]
                assert by_hash[h]["parent_block_hash"] == (hashes[i - 1] if i else None)
            assert client.stats()["counters"]["events_blocks_tracked"] == len(hashes)
        finally:
            client.close()
            consumer.close()
            d.stop()
            ctx.term()


@pytest.mark.parametrize("encoding,hash_kind", [("map", "u64"), ("positional", "bytes")])
def test_vllm_decodes_every_batch(encoding: str, hash_kind: str) -> None:
    with tempfile.TemporaryDirectory(prefix="kvtier-events-") as directory:
        d = events_daemon(directory, [f"events.encoding={encoding}", f"events.hash={hash_kind}"])
        d.start()
        ctx = zmq.Context()
        consumer = Consumer(ctx, *endpoints(d))
        client = kvtier.Client.connect(d.socket, name="events")
        try:
            time.sleep(0.2)
            cache = client.register_cpu_cache(kvtier.CpuKvCache(small_layout(), 64))
            rng = random.Random(4)
            tokens = [rng.randrange(0, 128000) for _ in range(8 * BLOCK_TOKENS)]
            keys = client.compute_keys(cache, tokens)
            digests = [rng.randbytes(32) for _ in keys]  # sha256-sized engine hashes
            parent = rng.randbytes(32)
            client.store(cache, keys, list(range(8)), engine_hashes=digests, parent_hash=parent,
                         token_ids=tokens, block_size=BLOCK_TOKENS, lora_name="adapter-1")
            client.evict()
            time.sleep(0.3)
            batches = consumer.replay_from(0)
            assert len(batches) >= 2
            decoder = msgspec.msgpack.Decoder(vllm_events.KVEventBatch if encoding == "map" else LegacyBatch)
            decoded = [e for _, _, payload in batches for e in decoder.decode(payload).events]
            stored = [e for e in decoded if type(e).__name__.endswith("BlockStored")]
            removed = [e for e in decoded if type(e).__name__.endswith("BlockRemoved")]
            cleared = [e for e in decoded if type(e).__name__.endswith("AllBlocksCleared")]
            assert len(stored) == 8 and len(removed) == 8 and len(cleared) == 2  # the start's, the evict's
            expect = [int.from_bytes(h[-8:], "big") for h in digests] if hash_kind == "u64" else digests
            expect_parent = int.from_bytes(parent[-8:], "big") if hash_kind == "u64" else parent
            assert [e.block_hashes for e in stored] == [[h] for h in expect]
            assert [e.parent_block_hash for e in stored] == [expect_parent] + expect[:-1]
            assert [e.token_ids for e in stored] == [tokens[i * 16 : (i + 1) * 16] for i in range(8)]
            assert {(e.block_size, e.medium, e.lora_name, e.lora_id) for e in stored} == {
                (BLOCK_TOKENS, "GPU", "adapter-1", None)}
            assert sorted(map(bytes if hash_kind == "bytes" else int, (e.block_hashes[0] for e in removed))) == \
                sorted(expect)
        finally:
            client.close()
            consumer.close()
            d.stop()
            ctx.term()


def test_a_long_mixed_run_adds_up(node: tuple[Daemon, zmq.Context]) -> None:
    d, ctx = node
    consumer = Consumer(ctx, *endpoints(d))
    client = kvtier.Client.connect(d.socket, name="events")
    try:
        time.sleep(0.2)
        for seq, topic, payload in consumer.replay_from(0):
            consumer.apply(seq, topic, payload)
        cache = client.register_cpu_cache(kvtier.CpuKvCache(small_layout(), 64))
        prompts = Prompts(client, cache, seed=5)
        rng = random.Random(6)
        stored: list[tuple[list[bytes], list[int], list[int]]] = []
        sizes: list[int] = []  # blocks held at each check
        for step in range(2000):
            op = rng.random()
            if op < 0.55 or not stored:
                p = prompts.make(rng.randrange(1, 9))
                prompts.store(*p, list(range(len(p[0]))))
                stored.append(p)
            elif op < 0.85:
                keys = rng.choice(stored)[0]
                client.load(cache, keys, list(range(32, 32 + len(keys))))
            elif op < 0.95:
                client.flush()
            else:
                client.evict(tier=rng.choice(["host", "disk"]))
            if step % 200 == 199:
                settle(client, consumer)
                sizes.append(sum(consumer.counts().values()))
        settle(client, consumer)
        counters = client.stats()["counters"]
        assert counters["events_dropped"] == 0 and consumer.gaps == 0 and consumer.replayed == 0
        assert max(sizes) > 100, sizes
        kinds = {(e["type"], e.get("medium")) for e in consumer.events}
        assert {("BlockStored", "CPU"), ("BlockStored", "DISK"), ("BlockRemoved", "CPU"),
                ("BlockRemoved", "DISK")} <= kinds, kinds
    finally:
        client.close()
        consumer.close()


def test_bad_event_metadata_is_a_clear_error(node: tuple[Daemon, zmq.Context]) -> None:
    d, _ = node
    client = kvtier.Client.connect(d.socket, name="events")
    try:
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
    finally:
        client.close()


def test_blocks_put_to_the_remote_tier_are_external() -> None:
    from redis_cluster import RedisCluster

    cluster = RedisCluster(masters=3, replicas=0)
    with tempfile.TemporaryDirectory(prefix="kvtier-events-") as directory:
        d = events_daemon(directory, ["tiers.remote.enabled=true", f"tiers.remote.seeds=[{','.join(cluster.seeds)}]",
                                      "tiers.remote.write=store", "tiers.disk.enabled=false",
                                      "tiers.hbm.enabled=false"])  # store puts what reaches host
        d.start()
        ctx = zmq.Context()
        consumer = Consumer(ctx, *endpoints(d))
        client = kvtier.Client.connect(d.socket, name="events")
        try:
            time.sleep(0.2)
            for seq, topic, payload in consumer.replay_from(0):
                consumer.apply(seq, topic, payload)
            cache = client.register_cpu_cache(kvtier.CpuKvCache(small_layout(), 64))
            prompts = Prompts(client, cache, seed=7)
            keys, hashes, tokens = prompts.make(8)
            prompts.store(keys, hashes, tokens, list(range(8)))
            deadline = time.monotonic() + 20
            while client.stats()["counters"].get("remote_writes", 0) < 8 and time.monotonic() < deadline:
                time.sleep(0.05)
            settle(client, consumer)
            assert consumer.held == {"CPU": set(hashes), "EXTERNAL": set(hashes)}
            # This node forgets them: the cluster's copies are no longer its to announce.
            client.evict()
            settle(client, consumer)
            assert consumer.counts() == {}
        finally:
            client.close()
            consumer.close()
            d.stop()
            ctx.term()
            cluster.stop()
