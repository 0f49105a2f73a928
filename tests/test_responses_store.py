"""The Responses API stores: LRU eviction and TTL expiry, with an injected clock."""

from __future__ import annotations

from mlxcel.config import Settings
from mlxcel.server.openai_responses.store import ResponseStores, TTLStore


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_entries_expire_ttl_seconds_after_their_last_write() -> None:
    clock = FakeClock()
    store: TTLStore[str] = TTLStore(8, 10, clock=clock)
    store.put("a", "A")
    clock.now += 9.9
    assert store.get("a") == "A"  # reading does not extend the TTL
    clock.now += 0.1
    assert store.get("a") is None
    assert "a" not in store and len(store) == 0

    store.put("b", "B")
    clock.now += 8
    store.put("b", "B2")  # a write restarts it
    clock.now += 8
    assert store.get("b") == "B2"


def test_least_recently_used_entry_is_evicted_first() -> None:
    store: TTLStore[int] = TTLStore(2, 0, clock=FakeClock())
    store.put("a", 1)
    store.put("b", 2)
    assert store.get("a") == 1  # `a` is now the most recently used
    store.put("c", 3)
    assert store.get("b") is None
    assert store.get("a") == 1 and store.get("c") == 3
    assert len(store) == 2


def test_ttl_zero_never_expires_and_max_zero_stores_nothing() -> None:
    clock = FakeClock()
    forever: TTLStore[str] = TTLStore(4, 0, clock=clock)
    forever.put("a", "A")
    clock.now += 10**9
    assert forever.get("a") == "A"

    disabled: TTLStore[str] = TTLStore(0, 60, clock=clock)
    assert not disabled.enabled
    disabled.put("a", "A")
    assert disabled.get("a") is None and len(disabled) == 0


def test_pop_returns_live_values_only() -> None:
    clock = FakeClock()
    store: TTLStore[str] = TTLStore(4, 5, clock=clock)
    store.put("a", "A")
    store.put("b", "B")
    assert store.pop("a") == "A"
    assert store.pop("a") is None
    clock.now += 5
    assert store.pop("b") is None  # expired: as if it never existed
    assert len(store) == 0


def test_expired_entries_are_purged_on_write() -> None:
    clock = FakeClock()
    store: TTLStore[int] = TTLStore(2, 5, clock=clock)
    store.put("old", 1)
    clock.now += 6
    store.put("x", 2)
    store.put("y", 3)  # `old` expired, so nothing live is evicted
    assert store.get("x") == 2 and store.get("y") == 3


def test_stores_are_sized_by_the_settings() -> None:
    settings = Settings(
        warmup=False,
        responses_store_max_entries=3,
        responses_store_ttl_secs=7,
        conversation_store_max_entries=0,
        conversation_store_ttl_secs=9,
    )
    stores = ResponseStores.from_settings(settings, clock=FakeClock())
    assert (stores.responses.max_entries, stores.responses.ttl) == (3, 7)
    assert stores.responses.enabled and not stores.conversations.enabled
    assert stores.conversations.ttl == 9
    assert stores.inflight == {}
