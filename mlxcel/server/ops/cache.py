"""The `/v1/cache/stats` and `/v1/cache/reset` payloads, shaped from the engine's numbers."""

from __future__ import annotations

from typing import Any

from mlxcel.engine.text.prompt_cache import BLOCK_SIZE, HASH_NAME, CacheReset, CacheStats
from mlxcel.engine.text.prompt_disk import DiskStats


def stats_payload(stats: CacheStats | None) -> dict[str, Any]:
    """The stats payload; a stable all-zero one (`enabled: false`) without a prompt cache."""
    if stats is None:
        stats = CacheStats(BLOCK_SIZE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        enabled = False
    else:
        enabled = True
    return {
        "enabled": enabled,
        "apc_enabled": False,
        "block_size": stats.block_size,
        "hash": HASH_NAME,
        "entries": stats.entries,
        "bytes": stats.bytes,
        "capacity_bytes": stats.capacity_bytes,
        "max_entries": stats.max_entries,
        "hits": stats.hits,
        "lookups": stats.lookups,
        "hit_rate": stats.hit_rate,
        "inserts": stats.inserts,
        "evictions_lru": stats.evictions_lru,
        "evictions_ttl": stats.evictions_ttl,
        "rejections_oversized": stats.rejections_oversized,
        "total_blocks_stored": stats.total_blocks_stored,
        "unique_block_hashes": stats.unique_block_hashes,
        "apc_active_entries": 0,
        "disk": _disk_payload(stats.disk),
    }


def _disk_payload(disk: DiskStats | None) -> dict[str, Any]:
    """The disk tier's numbers (`enabled: false` without one; `--prompt-cache-dir`)."""
    if disk is None:
        return {"enabled": False, "entries": 0, "bytes": 0}
    return {
        "enabled": True,
        "directory": disk.directory,
        "entries": disk.entries,
        "bytes": disk.bytes,
        "capacity_bytes": disk.capacity_bytes,
        "hits": disk.hits,
        "writes": disk.writes,
        "evictions": disk.evictions,
        "removed_invalid": disk.removed_invalid,
    }


def reset_payload(freed: CacheReset | None) -> dict[str, Any]:
    """The reset payload (nothing freed without a prompt cache)."""
    freed = freed or CacheReset(0, 0)
    return {"cleared": True, "freed_bytes": freed.freed_bytes, "freed_entries": freed.freed_entries}
