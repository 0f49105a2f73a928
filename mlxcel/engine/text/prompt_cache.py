"""The prompt (prefix) cache: KV caches of earlier sequences, found by block hashes.

A token sequence is cut into blocks of `BLOCK_SIZE` tokens; block `i` is named by a sha256
digest chained over blocks `0..i`, so one digest identifies a whole prefix. Each entry
holds an mlx-lm KV cache (one object per layer) for exactly its tokens. A lookup walks the
prompt's digests, takes the entry sharing the longest prefix (extended token by token into
the next partial block) and hands out a private copy trimmed to that prefix, always leaving
at least one prompt token to prefill. Entries leave by LRU order, by TTL and under a byte
cap. Lookups and inserts run on the engine thread; `stats()` and `reset()` may be called
from any thread (one lock guards the bookkeeping; MLX work happens outside it).

Slots (llama-server's `/slots/{id}?action=save|restore|erase`, `slot_files`): an insert
names the slot its sequence ran in, and the cache remembers the tokens each slot last held.
`slot_entry` gives them with the entry serving them, `erase_slot` drops that entry, and
`restore` queues a cache read from a file: the engine thread loads it at its next lookup,
so no MLX work runs on the caller's thread.

MLX is only imported inside functions, so the server can import this module (for its
`CacheStats`) without loading MLX; the HTTP payloads are the server's.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxcel.config import Settings
    from mlxcel.engine.text.prompt_disk import DiskStats, DiskTier

log = logging.getLogger(__name__)

BLOCK_SIZE = 16
HASH_NAME = "sha256"
DEFAULT_MAX_ENTRIES = 1024
_SEED = b"mlxcel-prompt-cache-v1"


def block_hashes(tokens: Sequence[int], block_size: int = BLOCK_SIZE) -> list[bytes]:
    """Chained sha256 digests of every full block of `tokens`.

    Digest `i` covers blocks `0..i`, so equal digests mean equal prefixes of
    `(i + 1) * block_size` tokens. A trailing partial block gets no digest.
    """
    out: list[bytes] = []
    previous = _SEED
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        digest = hashlib.sha256(previous)
        digest.update(struct.pack(f"<{block_size}q", *block))
        previous = digest.digest()
        out.append(previous)
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the common prefix of `a` and `b`, assuming the first `start` agree."""
    n = start
    limit = min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


@dataclass(frozen=True)
class CacheStats:
    """The cache's size and counters at one moment (the server shapes `/v1/cache/stats`)."""

    block_size: int
    entries: int
    bytes: int
    capacity_bytes: int
    max_entries: int
    hits: int
    lookups: int
    inserts: int
    evictions_lru: int
    evictions_ttl: int
    rejections_oversized: int
    total_blocks_stored: int
    unique_block_hashes: int
    disk: DiskStats | None = None  # the disk tier's (None: no disk tier)

    @property
    def hit_rate(self) -> float:
        """Hits per lookup (0 before the first lookup)."""
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass(frozen=True)
class CacheReset:
    """What one `reset()` freed."""

    freed_bytes: int
    freed_entries: int


@dataclass
class _Entry:
    id: int
    tokens: list[int]
    hashes: list[bytes]
    cache: list[Any]
    nbytes: int
    trimmable: bool
    last_used: float


def _cache_nbytes(cache: list[Any]) -> int:
    total = 0
    for layer in cache:
        try:
            total += int(layer.nbytes)
        except (AttributeError, NotImplementedError):
            continue
    return total


def _cache_size(cache: list[Any]) -> int | None:
    """Tokens held by the first layer that reports a size (None: unknown)."""
    for layer in cache:
        size = layer.size() if hasattr(layer, "size") else 0
        if size:
            return int(size)
    return None


def _compact(cache: list[Any]) -> list[Any]:
    """`cache` with every plain KV layer (of any `-ctk` float type: mlx-lm's `KVCache` or
    a subclass) cut to the tokens it holds (no growth padding)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    out: list[Any] = []
    for layer in cache:
        keys: Any = getattr(layer, "keys", None)
        if isinstance(layer, KVCache) and keys is not None and keys.shape[2] != layer.offset:
            fresh = type(layer)()
            fresh.keys = mx.contiguous(keys[..., : layer.offset, :])
            values: Any = layer.values
            fresh.values = mx.contiguous(values[..., : layer.offset, :])
            fresh.offset = layer.offset
            layer = fresh
        out.append(layer)
    return out


def _copy_prefix(cache: list[Any], n_tokens: int, total: int) -> list[Any]:
    """A private copy of `cache` (which holds `total` tokens) cut to its first `n_tokens`."""
    from mlx_lm.models.cache import KVCache

    out: list[Any] = []
    for layer in cache:
        if isinstance(layer, KVCache):
            fresh = type(layer)()
            keys: Any = layer.keys
            values: Any = layer.values
            if keys is not None:
                # Slicing makes new arrays: the copy can be updated without touching ours.
                fresh.keys = keys[..., :n_tokens, :]
                fresh.values = values[..., :n_tokens, :]
                fresh.offset = n_tokens
            out.append(fresh)
            continue
        clone = copy.deepcopy(layer)
        if n_tokens < total:
            clone.trim(total - n_tokens)
        out.append(clone)
    return out


class PromptCache:
    """Longest-prefix reuse of KV caches with LRU, TTL and a byte cap.

    `capacity_bytes` < 0 means no byte cap; `ttl_secs` 0 means entries never expire.
    """

    def __init__(
        self,
        *,
        capacity_bytes: int = -1,
        ttl_secs: float = 0.0,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        block_size: int = BLOCK_SIZE,
        clock: Callable[[], float] = time.monotonic,
        disk: DiskTier | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.capacity_bytes = capacity_bytes
        self.ttl_secs = ttl_secs
        self.max_entries = max_entries
        self.block_size = block_size
        self._clock = clock
        self.disk = disk  # evicted entries go there, lookups look there too
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._index: dict[bytes, set[int]] = {}
        self._next_id = 0
        self._bytes = 0
        self.hits = 0
        self.lookups = 0
        self.inserts = 0
        self.evictions_lru = 0
        self.evictions_ttl = 0
        self.rejections_oversized = 0
        self._slot_tokens: dict[int, list[int]] = {}  # the tokens each slot last held
        self._restores: list[tuple[int, list[int], Callable[[], list[Any]]]] = []

    @classmethod
    def from_settings(cls, settings: Settings, disk: DiskTier | None = None) -> PromptCache | None:
        """The server's cache per `--cache-prompt`, `--cache-ram` (MiB) and the TTL, over
        `disk` (None: RAM only); or None."""
        if not settings.cache_prompt or settings.cache_ram == 0:
            return None
        capacity = -1 if settings.cache_ram < 0 else settings.cache_ram * 1024 * 1024
        return cls(capacity_bytes=capacity, ttl_secs=float(settings.cache_ttl_secs), disk=disk)

    # ------------------------------------------------------------------ engine thread

    def lookup(
        self, tokens: Sequence[int], slot: int | None = None
    ) -> tuple[list[Any] | None, int]:
        """`(kv_cache, n_cached)` for the longest cached prefix of `tokens`, or `(None, 0)`.
        `slot`: a request pinned to that slot (`id_slot`) starts from what the slot holds
        (its last sequence, or a file restored into it), as llama-server's slot keeps its KV;
        from the longest cached prefix only when the slot holds none of `tokens`.

        The cache returned is a fresh copy holding exactly `n_cached` tokens, and
        `n_cached < len(tokens)` so at least one token is left to prefill.
        """
        self._load_restores()
        tokens = list(tokens)
        hashes = block_hashes(tokens, self.block_size)
        if self.disk is not None:
            self._load_from_disk(tokens, hashes)
        with self._lock:
            self._expire(self._clock())
            self.lookups += 1
            entry, n_cached = self._slot_match(slot, tokens) if slot is not None else (None, 0)
            if entry is None:
                entry, n_cached = self._best_match(tokens, hashes)
            if entry is None:
                return None, 0
            self.hits += 1
            entry.last_used = self._clock()
            self._entries.move_to_end(entry.id)
        return _copy_prefix(entry.cache, n_cached, len(entry.tokens)), n_cached

    def insert(self, tokens: Sequence[int], cache: list[Any], slot: int | None = None) -> bool:
        """Store `cache`, the KV cache of exactly `tokens`; True when a new entry was added.
        `slot`: the slot the sequence ran in (it now holds `tokens`).

        Sequences shorter than one block, caches whose size does not match `tokens` and
        sequences already covered by an entry add nothing; a cache over the byte cap is
        counted in `rejections_oversized`.
        """
        tokens = list(tokens)
        if slot is not None:
            with self._lock:
                self._slot_tokens[slot] = tokens
        if len(tokens) < self.block_size or not cache:
            return False
        size = _cache_size(cache)
        if size is not None and size != len(tokens):
            return False
        hashes = block_hashes(tokens, self.block_size)
        if self._touch_covering(tokens, hashes):  # before paying for the copy below
            return False
        import mlx.core as mx
        from mlx_lm.models.cache import can_trim_prompt_cache

        # Materialize now so the entry no longer refers to the batch it came from.
        cache = _compact(cache)
        mx.eval([layer.state for layer in cache])
        nbytes = _cache_nbytes(cache)
        trimmable = bool(can_trim_prompt_cache(cache))
        with self._lock:
            now = self._clock()
            self._expire(now)
            if 0 <= self.capacity_bytes < nbytes:
                self.rejections_oversized += 1
                return False
            if self._covering(tokens, hashes) is not None:
                return False
            if trimmable:  # the new entry can serve every entry that is a prefix of it
                for old in self._prefixes_of(tokens, hashes):
                    self._drop(old)
            entry = _Entry(self._next_id, tokens, hashes, cache, nbytes, trimmable, now)
            self._next_id += 1
            self._entries[entry.id] = entry
            for digest in hashes:
                self._index.setdefault(digest, set()).add(entry.id)
            self._bytes += nbytes
            self.inserts += 1
            evicted = []
            while len(self._entries) > self.max_entries or (0 <= self.capacity_bytes < self._bytes):
                oldest = next(iter(self._entries.values()))
                self._drop(oldest)
                self.evictions_lru += 1
                evicted.append(oldest)
        if self.disk is not None:
            for old in evicted:  # out of RAM, onto the disk tier
                self.disk.write(old.tokens, old.cache)
        return True

    def _touch_covering(self, tokens: list[int], hashes: list[bytes]) -> bool:
        """Whether an entry already serves `tokens` (it then counts as recently used)."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            covering = self._covering(tokens, hashes)
            if covering is None:
                return False
            covering.last_used = now
            self._entries.move_to_end(covering.id)
            return True

    def _load_from_disk(self, tokens: list[int], hashes: list[bytes]) -> None:
        """Engine thread: bring the disk tier's entry in when it holds a longer prefix of
        `tokens` than RAM does."""
        assert self.disk is not None
        with self._lock:
            _, in_ram = self._best_match(tokens, hashes)
        entry, on_disk = self.disk.best(tokens, len(tokens) - 1)
        if entry is None or on_disk <= in_ram or on_disk < self.block_size:
            return
        cache = self.disk.load(entry)
        if cache is not None:
            self.insert(entry.tokens, cache)

    def release(self) -> CacheReset:
        """Engine thread, the model about to be unloaded: `persist`, then `reset`."""
        self.persist()
        return self.reset()

    def persist(self) -> int:
        """Write every RAM entry to the disk tier (at shutdown, the engine stopped); how many
        were written (0 without a disk tier)."""
        if self.disk is None:
            return 0
        with self._lock:
            entries = list(self._entries.values())
        return sum(self.disk.write(entry.tokens, entry.cache) for entry in entries)

    def _load_restores(self) -> None:
        """Engine thread: read the caches `restore` queued and insert them."""
        with self._lock:
            queued, self._restores = self._restores, []
        for slot, tokens, load in queued:
            try:
                self.insert(tokens, load(), slot=slot)
            except Exception:  # a file that went bad since it was checked: skip it
                log.exception("restoring a slot's cache failed")

    # -------------------------------------------------------------------- any thread

    def slot_entry(self, slot: int) -> tuple[list[int], int, list[Any]] | None:
        """The tokens `slot` last held, and the entry serving them: its token count (the
        slot's, or more when a longer sequence extended them) and its cache, whose arrays
        are evaluated (reading them runs no MLX work). None: nothing cached."""
        with self._lock:
            tokens = self._slot_tokens.get(slot)
            if not tokens:
                return None
            entry = self._covering(tokens, block_hashes(tokens, self.block_size))
            if entry is None:
                return None
            return tokens, len(entry.tokens), entry.cache

    def erase_slot(self, slot: int) -> int:
        """Forget what `slot` held and drop the entry that served it; its token count."""
        with self._lock:
            tokens = self._slot_tokens.pop(slot, None)
            if not tokens:
                return 0
            entry = self._covering(tokens, block_hashes(tokens, self.block_size))
            if entry is not None:
                self._drop(entry)
            return len(tokens)

    def restore(self, slot: int, tokens: Sequence[int], load: Callable[[], list[Any]]) -> None:
        """Queue the cache `load()` reads (the KV cache of exactly `tokens`) for `slot`; the
        engine thread inserts it before its next lookup."""
        with self._lock:
            self._restores.append((slot, list(tokens), load))

    def stats(self) -> CacheStats:
        """Size and counters now (expired entries dropped first)."""
        with self._lock:
            self._expire(self._clock())
            return CacheStats(
                block_size=self.block_size,
                entries=len(self._entries),
                bytes=self._bytes,
                capacity_bytes=self.capacity_bytes,
                max_entries=self.max_entries,
                hits=self.hits,
                lookups=self.lookups,
                inserts=self.inserts,
                evictions_lru=self.evictions_lru,
                evictions_ttl=self.evictions_ttl,
                rejections_oversized=self.rejections_oversized,
                total_blocks_stored=sum(len(e.hashes) for e in self._entries.values()),
                unique_block_hashes=len(self._index),
                disk=self.disk.stats() if self.disk is not None else None,
            )

    def reset(self) -> CacheReset:
        """Drop every entry (idempotent); what it freed. Counters stay."""
        with self._lock:
            freed = CacheReset(self._bytes, len(self._entries))
            self._entries.clear()
            self._restores.clear()
            self._index.clear()
            self._bytes = 0
        return freed

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached KV arrays."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    # --------------------------------------------------------------- lock held below

    def _best_match(self, tokens: list[int], hashes: list[bytes]) -> tuple[_Entry | None, int]:
        depth = 0
        while depth < len(hashes) and hashes[depth] in self._index:
            depth += 1
        limit = len(tokens) - 1  # leave one token to prefill
        for d in range(depth, 0, -1):
            start = d * self.block_size
            best: _Entry | None = None
            best_n = 0
            for entry_id in self._index[hashes[d - 1]]:
                entry = self._entries[entry_id]
                if entry.tokens[:start] != tokens[:start]:  # a digest collision: ignore
                    continue
                n = min(_common_prefix(entry.tokens, tokens, start), limit)
                if n <= 0 or (not entry.trimmable and n != len(entry.tokens)):
                    continue
                if n > best_n or (n == best_n and best is not None and entry.nbytes < best.nbytes):
                    best, best_n = entry, n
            if best is not None:
                # A shallower block holds at most `start - 1` matching tokens: no better.
                return best, best_n
        return None, 0

    def _slot_match(self, slot: int, tokens: list[int]) -> tuple[_Entry | None, int]:
        """The entry serving what `slot` last held, and how many tokens of `tokens` it gives
        (at most all but the last); `(None, 0)` when it gives none."""
        held = self._slot_tokens.get(slot)
        if not held:
            return None, 0
        entry = self._covering(held, block_hashes(held, self.block_size))
        if entry is None:
            return None, 0
        n = min(_common_prefix(held, tokens, 0), len(tokens) - 1)
        if n <= 0 or (not entry.trimmable and n != len(entry.tokens)):
            return None, 0
        return entry, n

    def _covering(self, tokens: list[int], hashes: list[bytes]) -> _Entry | None:
        """An entry that already serves every prefix of `tokens`."""
        if not hashes:
            return None
        for entry_id in self._index.get(hashes[-1], ()):
            entry = self._entries[entry_id]
            if entry.tokens[: len(tokens)] != tokens:
                continue
            if len(entry.tokens) == len(tokens) or entry.trimmable:
                return entry
        return None

    def _prefixes_of(self, tokens: list[int], hashes: list[bytes]) -> list[_Entry]:
        found: dict[int, _Entry] = {}
        for digest in hashes:
            for entry_id in self._index.get(digest, ()):
                entry = self._entries[entry_id]
                if len(entry.tokens) < len(tokens) and tokens[: len(entry.tokens)] == entry.tokens:
                    found[entry_id] = entry
        return list(found.values())

    def _drop(self, entry: _Entry) -> None:
        self._entries.pop(entry.id, None)
        for digest in entry.hashes:
            ids = self._index.get(digest)
            if ids is not None:
                ids.discard(entry.id)
                if not ids:
                    del self._index[digest]
        self._bytes -= entry.nbytes

    def _expire(self, now: float) -> None:
        if self.ttl_secs <= 0:
            return
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if now - oldest.last_used < self.ttl_secs:
                return
            self._drop(oldest)
            self.evictions_ttl += 1
