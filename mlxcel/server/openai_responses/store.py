"""In-memory stores of the Responses API: stored responses and conversations (LRU + TTL).

A conversation's TTL restarts whenever it is written (created, updated, items added).

Both are `TTLStore`s: at most `max_entries` values (the least recently used is evicted
first), each kept `ttl` seconds after it was last written (0: no expiry). An expired or
evicted entry is gone: it reads exactly like one that never existed. `max_entries` 0
disables a store. The stores are thread-safe (one lock each), though the server only
touches them from its event loop. The clock is injectable for tests.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from mlxcel.config import Settings

V = TypeVar("V")

Clock = Callable[[], float]


class TTLStore(Generic[V]):
    """A bounded mapping whose entries expire `ttl` seconds after their last write."""

    def __init__(self, max_entries: int, ttl: float, *, clock: Clock = time.monotonic) -> None:
        self.max_entries = max(0, int(max_entries))
        self.ttl = max(0.0, float(ttl))
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, V]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """False when `max_entries` is 0: nothing is ever kept."""
        return self.max_entries > 0

    def _expired(self, written: float, now: float) -> bool:
        return self.ttl > 0 and now - written >= self.ttl

    def _purge(self, now: float) -> None:
        if self.ttl <= 0:
            return
        stale = [key for key, (written, _) in self._entries.items() if self._expired(written, now)]
        for key in stale:
            del self._entries[key]

    def get(self, key: str) -> V | None:
        """The live value of `key` (marked most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if self._expired(entry[0], self.clock()):
                del self._entries[key]
                return None
            self._entries.move_to_end(key)
            return entry[1]

    def put(self, key: str, value: V) -> None:
        """Store `value` under `key` (its TTL restarts); evicts the oldest entries if full."""
        if not self.enabled:
            return
        with self._lock:
            now = self.clock()
            self._entries[key] = (now, value)
            self._entries.move_to_end(key)
            self._purge(now)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def pop(self, key: str) -> V | None:
        """Remove `key`; its live value, or None when it was missing or expired."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None or self._expired(entry[0], self.clock()):
                return None
            return entry[1]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    def __len__(self) -> int:
        with self._lock:
            self._purge(self.clock())
            return len(self._entries)


@dataclass
class StoredResponse:
    """One stored response: its JSON object and the items a follow-up request replays.

    `history` is every item of the exchange in order (the previous chain's items, this
    request's input, then its output); `instructions` are never part of it. `request` keeps
    fields that are stored but not echoed (e.g. `context_management`). `input_items` are
    this request's own input items, with ids (GET /v1/responses/{id}/input_items).
    """

    response: dict[str, Any]
    history: list[dict[str, Any]]
    request: dict[str, Any] = field(default_factory=dict)
    input_items: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Conversation:
    """One stored conversation: its object's fields and its items (with ids), in order."""

    id: str
    created_at: int
    metadata: dict[str, str] = field(default_factory=dict)
    items: list[dict[str, Any]] = field(default_factory=list)

    def object(self) -> dict[str, Any]:
        """The conversation object of the Conversations API."""
        return {
            "id": self.id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": dict(self.metadata),
        }


@dataclass
class InFlight:
    """A response being generated: its engine stream (closing it cancels the job), and
    whether it was cancelled or deleted meanwhile."""

    stream: Any
    cancelled: bool = False
    deleted: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class ResponseStores:
    """The server's stores: responses by id, conversations by id, and the responses still
    generating (for cancel)."""

    responses: TTLStore[StoredResponse]
    conversations: TTLStore[Conversation]
    inflight: dict[str, InFlight] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: Settings, *, clock: Clock = time.monotonic) -> ResponseStores:
        """Stores sized by `--responses-store-*` and `--conversation-store-*`."""
        return cls(
            responses=TTLStore(
                settings.responses_store_max_entries,
                settings.responses_store_ttl_secs,
                clock=clock,
            ),
            conversations=TTLStore(
                settings.conversation_store_max_entries,
                settings.conversation_store_ttl_secs,
                clock=clock,
            ),
        )

    def extend_conversation(self, conversation_id: str, items: list[dict[str, Any]]) -> None:
        """Append `items` to a conversation, creating it when a response names one that is
        not stored (as `conversation` always could)."""
        conversation = self.conversations.get(conversation_id)
        if conversation is None:
            conversation = Conversation(conversation_id, int(time.time()))
        conversation.items.extend(items)
        self.conversations.put(conversation_id, conversation)


APP_ATTRIBUTE = "mlxcel_response_stores"
"""Where `stores_for` keeps the stores: an attribute of the FastAPI app's `state`."""


def stores_for(app: Any, settings: Settings) -> ResponseStores:
    """The stores of `app` (a FastAPI/Starlette app), created on first use."""
    stores: ResponseStores | None = getattr(app.state, APP_ATTRIBUTE, None)
    if stores is None:
        stores = ResponseStores.from_settings(settings)
        setattr(app.state, APP_ATTRIBUTE, stores)
    return stores
