"""The prompt (prefix) cache: block hashing, longest prefix, LRU/TTL/byte cap, counters."""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlxcel.engine.text.prompt_cache import (
    BLOCK_SIZE,
    PromptCache,
    block_hashes,
)
from mlxcel.server.ops.cache import reset_payload, stats_payload

LAYERS, HEADS, DIM = 2, 2, 4
ENTRY_BYTES = LAYERS * 2 * HEADS * DIM * 4  # per token: keys + values, float32


def kv_for(tokens: list[int]) -> list[KVCache]:
    """A KV cache whose rows encode the tokens, so a copy's content can be checked."""
    cache = []
    for layer in range(LAYERS):
        c = KVCache()
        base = mx.array(tokens, dtype=mx.float32)[None, None, :, None] + layer * 1000
        keys = mx.broadcast_to(base, (1, HEADS, len(tokens), DIM))
        c.update_and_fetch(keys, keys + 0.5)
        cache.append(c)
    mx.eval([c.state for c in cache])
    return cache


def rows(cache: list[Any]) -> list[int]:
    keys, _ = cache[0].keys_and_values()
    return [int(v) for v in keys[0, 0, :, 0].tolist()]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ----------------------------------------------------------------------------- hashing


def test_block_hashes_are_chained_per_full_block() -> None:
    tokens = seq(0, 40)
    digests = block_hashes(tokens)
    assert len(digests) == 40 // BLOCK_SIZE == 2
    assert all(len(d) == 32 for d in digests)  # sha256
    assert block_hashes(list(tokens)) == digests  # deterministic
    # The trailing partial block has no digest, and does not change the others.
    assert block_hashes(tokens[:32]) == digests
    # A change in block 1 leaves digest 0 alone; a change in block 0 changes both.
    changed_1 = tokens[:20] + [999] + tokens[21:]
    assert block_hashes(changed_1)[0] == digests[0]
    assert block_hashes(changed_1)[1] != digests[1]
    changed_0 = [999] + tokens[1:]
    assert all(a != b for a, b in zip(block_hashes(changed_0), digests, strict=True))
    # The same block after a different history hashes differently (chained).
    assert block_hashes(seq(100, 16) + seq(0, 16))[1] != block_hashes(seq(200, 16) + seq(0, 16))[1]


# ------------------------------------------------------------------------ longest prefix


def test_longest_prefix_is_reused_with_a_trimmed_copy() -> None:
    cache = PromptCache()
    stored = seq(1, 48)
    assert cache.insert(stored, kv_for(stored))
    prompt = stored[:40] + [7777, 7778, 7779]
    kv, n = cache.lookup(prompt)
    assert n == 40  # 2 full blocks, then token by token into the third
    assert kv is not None and len(kv) == LAYERS
    assert all(layer.offset == 40 for layer in kv)
    assert rows(kv) == stored[:40]


def test_miss_when_no_block_matches() -> None:
    cache = PromptCache()
    cache.insert(seq(1, 32), kv_for(seq(1, 32)))
    assert cache.lookup([5] + seq(2, 31)) == (None, 0)
    assert cache.lookup(seq(1, 10)) == (None, 0)  # shorter than one block


def test_full_prompt_hit_leaves_one_token_to_prefill() -> None:
    cache = PromptCache()
    stored = seq(1, 37)
    cache.insert(stored, kv_for(stored))
    kv, n = cache.lookup(stored)
    assert n == len(stored) - 1
    assert kv is not None and rows(kv) == stored[:-1]
    # A prompt that is exactly one block long still gets its first 15 tokens.
    kv, n = cache.lookup(stored[:16])
    assert n == 15


def test_prefers_the_longest_of_several_entries() -> None:
    cache = PromptCache()
    shared = seq(1, 32)
    short = shared + seq(500, 16)
    long = shared + seq(600, 40)
    cache.insert(short, kv_for(short))
    cache.insert(long, kv_for(long))
    kv, n = cache.lookup(long[:70] + [1])
    assert n == 70 and kv is not None and rows(kv) == long[:70]
    kv, n = cache.lookup(short + [9, 9])
    assert n == len(short) and kv is not None and rows(kv) == short


def test_copies_are_private() -> None:
    cache = PromptCache()
    stored = seq(1, 32)
    cache.insert(stored, kv_for(stored))
    first, n = cache.lookup(stored + [50])
    assert first is not None and n == 32
    # Extend the copy in place the way a model would: the stored entry must not change.
    extra = mx.full((1, HEADS, 3, DIM), -1.0)
    for layer in first:
        layer.keys[..., 0, :] = 12345.0
        layer.update_and_fetch(extra, extra)
    assert rows(first)[0] == 12345 and first[0].offset == 35
    second, n2 = cache.lookup(stored + [50])
    assert second is not None and n2 == 32
    assert rows(second) == stored
    assert first[0] is not second[0]


class _Fixed:
    """A non-trimmable layer cache (like a recurrent state)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self.a = mx.zeros((4,))

    def size(self) -> int:
        return self._size

    def is_trimmable(self) -> bool:
        return False

    @property
    def state(self) -> list[Any]:
        return [self.a]

    @property
    def nbytes(self) -> int:
        return 16


def test_untrimmable_caches_are_reused_only_whole() -> None:
    cache = PromptCache()
    stored = seq(1, 32)
    assert cache.insert(stored, [_Fixed(32)])
    kv, n = cache.lookup(stored + [1, 2])  # the entry is a prefix: usable as is
    assert n == 32 and kv is not None and isinstance(kv[0], _Fixed) and kv[0] is not None
    assert cache.lookup(stored[:30] + [7, 7, 7]) == (None, 0)  # would need a trim
    assert cache.lookup(stored) == (None, 0)  # would need a trim to leave a token


def test_mismatched_or_short_sequences_are_not_stored() -> None:
    cache = PromptCache()
    assert not cache.insert(seq(1, 10), kv_for(seq(1, 10)))
    assert not cache.insert(seq(1, 32), kv_for(seq(1, 31)))  # cache size != tokens
    assert cache.stats().entries == 0 and cache.stats().inserts == 0


def test_covered_sequences_add_nothing_and_extensions_replace_prefixes() -> None:
    cache = PromptCache()
    base = seq(1, 40)
    assert cache.insert(base, kv_for(base))
    assert not cache.insert(base[:33], kv_for(base[:33]))  # already served by `base`
    assert not cache.insert(base, kv_for(base))
    longer = base + seq(900, 20)
    assert cache.insert(longer, kv_for(longer))
    stats = cache.stats()
    assert stats.entries == 1 and stats.inserts == 2
    assert stats.bytes == len(longer) * ENTRY_BYTES
    kv, n = cache.lookup(base + [3])
    assert n == 40 and kv is not None and rows(kv) == base


# ---------------------------------------------------------------------- LRU, TTL, bytes


def test_lru_eviction_by_entry_count() -> None:
    cache = PromptCache(max_entries=2)
    a, b, c = seq(0, 16), seq(100, 16), seq(200, 16)
    cache.insert(a, kv_for(a))
    cache.insert(b, kv_for(b))
    assert cache.lookup(a + [1])[1] == 16  # `a` is now the most recently used
    cache.insert(c, kv_for(c))
    assert cache.lookup(b + [1]) == (None, 0)
    assert cache.lookup(a + [1])[1] == 16
    assert cache.lookup(c + [1])[1] == 16
    assert cache.stats().evictions_lru == 1


def test_byte_cap_evicts_and_rejects_oversized() -> None:
    one = 16 * ENTRY_BYTES
    cache = PromptCache(capacity_bytes=2 * one + 10)
    a, b, c = seq(0, 16), seq(100, 16), seq(200, 16)
    for s in (a, b, c):
        assert cache.insert(s, kv_for(s))
    stats = cache.stats()
    assert stats.entries == 2 and stats.bytes == 2 * one
    assert stats.evictions_lru == 1 and stats.capacity_bytes == 2 * one + 10
    big = seq(300, 48)
    assert not cache.insert(big, kv_for(big))
    assert cache.stats().rejections_oversized == 1
    assert cache.stats().entries == 2


def test_ttl_expires_unused_entries() -> None:
    clock = FakeClock()
    cache = PromptCache(ttl_secs=60, clock=clock)
    a, b = seq(0, 16), seq(100, 16)
    cache.insert(a, kv_for(a))
    clock.now += 30
    cache.insert(b, kv_for(b))
    clock.now += 40  # `a` is 70 s old, `b` 40 s
    stats = cache.stats()
    assert stats.entries == 1 and stats.evictions_ttl == 1
    assert cache.lookup(a + [1]) == (None, 0)
    assert cache.lookup(b + [1])[1] == 16  # a hit refreshes `b`
    clock.now += 59
    assert cache.stats().entries == 1
    clock.now += 2
    assert cache.stats().entries == 0 and cache.stats().evictions_ttl == 2


# --------------------------------------------------------------------------- counters


def test_counters_match_the_stats_payload() -> None:
    cache = PromptCache(capacity_bytes=1 << 20)
    a = seq(0, 40)
    b = seq(1000, 20)
    cache.insert(a, kv_for(a))
    cache.insert(b, kv_for(b))
    cache.lookup(a + [1])
    cache.lookup(seq(5000, 20))
    cache.lookup(b[:18])
    stats = stats_payload(cache.stats())
    assert list(stats) == list(stats_payload(None))
    assert stats == {
        "enabled": True,
        "apc_enabled": False,
        "block_size": 16,
        "hash": "sha256",
        "entries": 2,
        "bytes": (40 + 20) * ENTRY_BYTES,
        "capacity_bytes": 1 << 20,
        "max_entries": 1024,
        "hits": 2,
        "lookups": 3,
        "hit_rate": pytest.approx(2 / 3),
        "inserts": 2,
        "evictions_lru": 0,
        "evictions_ttl": 0,
        "rejections_oversized": 0,
        "total_blocks_stored": 2 + 1,
        "unique_block_hashes": 3,
        "apc_active_entries": 0,
        "disk": {"enabled": False, "entries": 0, "bytes": 0},
    }


def test_reset_frees_everything_and_is_idempotent() -> None:
    cache = PromptCache()
    a = seq(0, 32)
    cache.insert(a, kv_for(a))
    cache.lookup(a + [1])
    freed = reset_payload(cache.reset())
    assert freed == {"cleared": True, "freed_bytes": 32 * ENTRY_BYTES, "freed_entries": 1}
    assert reset_payload(cache.reset()) == {"cleared": True, "freed_bytes": 0, "freed_entries": 0}
    stats = cache.stats()
    assert stats.entries == 0 and stats.bytes == 0 and stats.unique_block_hashes == 0
    assert stats.hits == 1 and stats.inserts == 1  # counters survive a reset
    assert cache.lookup(a + [1]) == (None, 0)


def test_disabled_payloads_are_stable() -> None:
    stats = stats_payload(None)
    assert stats["enabled"] is False and stats["apc_enabled"] is False
    assert stats["block_size"] == 16 and stats["hash"] == "sha256"
    assert all(stats[k] == 0 for k in ("entries", "bytes", "hits", "lookups", "inserts"))
    assert reset_payload(None) == {"cleared": True, "freed_bytes": 0, "freed_entries": 0}


def test_from_settings() -> None:
    from mlxcel.config import Settings

    assert PromptCache.from_settings(Settings(cache_prompt=False)) is None
    assert PromptCache.from_settings(Settings(cache_ram=0)) is None
    unlimited = PromptCache.from_settings(Settings(cache_ram=-1))
    assert unlimited is not None and unlimited.capacity_bytes == -1
    sized = PromptCache.from_settings(Settings(cache_ram=3, cache_ttl_secs=9))
    assert sized is not None and sized.capacity_bytes == 3 * 1024 * 1024 and sized.ttl_secs == 9


def test_stats_and_reset_from_other_threads() -> None:
    cache = PromptCache(max_entries=8)
    errors: list[BaseException] = []
    stop = threading.Event()

    def observer() -> None:
        try:
            while not stop.is_set():
                stats = cache.stats()
                assert stats.entries <= 8
                cache.reset()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=observer) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(40):
            tokens = seq(i * 100, 20)
            cache.insert(tokens, kv_for(tokens))
            cache.lookup(tokens + [1])
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors
    stats = cache.stats()
    assert stats.lookups == 40 and stats.inserts == 40
    assert stats.bytes == stats.entries * 20 * ENTRY_BYTES


# ------------------------------------------------------------ through the engine, real model


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: Any) -> Any:
    from mlxcel.engine.loading import load_model

    return load_model(str(tiny_llama_dir))


def _engine(loaded: Any, cache: PromptCache | None) -> Any:
    from mlxcel.engine.text.scheduler import TextEngine

    return TextEngine(loaded, slots=2, context_per_slot=512, prompt_cache=cache).start()


def _request(loaded: Any, n: int = 6, **kw: Any) -> Any:
    from mlxcel.engine.sampling.params import SamplingParams
    from mlxcel.engine.text.request import GenerationRequest

    text = "The morning train left the station at 7:45, and the platform slowly emptied. "
    prompt = loaded.tokenizer.encode(text * 2)
    assert len(prompt) > 2 * BLOCK_SIZE
    options: dict[str, Any] = {"max_tokens": n, "ignore_eos": True, "logprobs": 0}
    options.update(kw)
    return GenerationRequest(
        prompt_tokens=prompt, sampling=SamplingParams(temperature=0.0), **options
    )


def _run(engine: Any, request: Any) -> tuple[list[int], Any]:
    events = list(engine.generate(request))
    return [t for e in events for t in e.token_ids], events[-1]


def test_cached_run_matches_cold_run(tiny_loaded: Any) -> None:
    cache = PromptCache()
    engine = _engine(tiny_loaded, cache)
    try:
        cold, cold_final = _run(engine, _request(tiny_loaded, cache_prompt=False))
        first, first_final = _run(engine, _request(tiny_loaded))
        warm, warm_final = _run(engine, _request(tiny_loaded))
    finally:
        engine.stop()
    n_prompt = cold_final.prompt_tokens
    assert len(cold) == 6 and len(set(cold)) > 1  # a real sequence, not one repeated token
    assert cold_final.timings.cache_n == 0 and first_final.timings.cache_n == 0
    assert warm_final.timings.cache_n == n_prompt - 1  # all but the last prompt token
    assert warm_final.timings.prompt_n == 1
    assert first == cold and warm == cold
    stats = cache.stats()
    assert (stats.lookups, stats.hits, stats.inserts) == (2, 1, 1)


def test_cache_prompt_false_adds_nothing(tiny_loaded: Any) -> None:
    cache = PromptCache()
    engine = _engine(tiny_loaded, cache)
    try:
        _run(engine, _request(tiny_loaded, cache_prompt=False))
        _run(engine, _request(tiny_loaded, cache_prompt=False))
    finally:
        engine.stop()
    stats = cache.stats()
    assert stats.lookups == 0 and stats.inserts == 0 and stats.entries == 0


def test_sequences_the_scheduler_ends_are_stored(tiny_loaded: Any) -> None:
    import queue

    cache = PromptCache()
    engine = _engine(tiny_loaded, cache)
    try:
        tokens, _ = _run(engine, _request(tiny_loaded, n=12, cache_prompt=False))
        text = tiny_loaded.tokenizer.decode(tokens)
        stop = text[len(text) // 2 :][:2]
        assert stop.strip()
        # A stop string: the scheduler removes the sequence itself.
        _, final = _run(engine, _request(tiny_loaded, n=12, stop=(stop,)))
        assert final.finish_reason == "stop"
        assert cache.stats().inserts == 1
        cache.reset()
        # A cancelled sequence keeps what it had computed.
        request = _request(tiny_loaded, n=400)
        events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        engine.submit(request, events.put)
        for _ in range(3):
            assert not events.get(timeout=30).finished
        engine.cancel(request.request_id)
        while not (event := events.get(timeout=30)).finished:
            pass
        assert event.finish_reason == "cancelled"
    finally:
        engine.stop()
    stats = cache.stats()
    assert stats.inserts == 2 and stats.entries == 1  # the reset kept the counters
    probe = [*request.prompt_tokens, 7]
    _, n_cached = cache.lookup(probe)
    assert n_cached == len(request.prompt_tokens)
