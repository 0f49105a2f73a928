"""The prompt cache's disk tier: evicted and shut-down entries survive a restart, keyed by
model and KV type, bounded by bytes (LRU), and damaged, truncated or foreign files are
removed, never loaded, never an error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlxcel.engine.text.kv_types import kv_type, typed_cache
from mlxcel.engine.text.prompt_cache import PromptCache
from mlxcel.engine.text.prompt_disk import DiskTier, clear_directory, list_directory

F16 = kv_type("f16")


def _cache(n: int, seed: int) -> list[Any]:
    rows = mx.random.normal((1, 2, n, 32), key=mx.random.key(seed))
    layer = typed_cache([KVCache()], F16)
    layer[0].update_and_fetch(rows, rows)
    return layer


def _tokens(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def _tier(path: Path, capacity: int = 1 << 30, identity: str = "model-a") -> DiskTier:
    return DiskTier(path, capacity, identity, F16)


def test_an_evicted_entry_is_found_after_a_restart(tmp_path: Path) -> None:
    first, second = _cache(32, 1), _cache(32, 2)
    entry_bytes = 2 * 2 * 32 * 32 * 2
    ram = PromptCache(capacity_bytes=entry_bytes, disk=_tier(tmp_path))
    assert ram.insert(_tokens(32, 0), first)
    assert ram.insert(_tokens(32, 100), second)  # evicts the first onto the disk
    assert ram.evictions_lru == 1 and ram.disk is not None and ram.disk.stats().entries == 1
    restarted = PromptCache(capacity_bytes=entry_bytes, disk=_tier(tmp_path))
    cache, n = restarted.lookup(_tokens(32, 0) + [7, 8])
    assert n == 32 and cache is not None
    assert type(cache[0]) is type(first[0]) and cache[0].keys.dtype == mx.float16
    assert mx.array_equal(cache[0].keys[..., :32, :], first[0].keys[..., :32, :])
    stats = restarted.stats()
    assert stats.disk is not None and stats.disk.hits == 1 and stats.hits == 1


def test_entries_held_at_shutdown_are_written(tmp_path: Path) -> None:
    ram = PromptCache(disk=_tier(tmp_path))
    ram.insert(_tokens(48, 0), _cache(48, 3))
    assert ram.persist() == 1
    assert ram.persist() == 0  # already there
    restarted = PromptCache(disk=_tier(tmp_path))
    assert restarted.lookup(_tokens(40, 0) + [1])[1] == 40


def test_another_model_or_kv_type_never_sees_the_entries(tmp_path: Path) -> None:
    ram = PromptCache(disk=_tier(tmp_path))
    ram.insert(_tokens(32, 0), _cache(32, 4))
    ram.persist()
    for other in (
        DiskTier(tmp_path, 1 << 30, "model-b", F16),
        DiskTier(tmp_path, 1 << 30, "model-a", kv_type("q8_0")),
    ):
        assert other.stats().entries == 0
        assert other.best(_tokens(32, 0), 31) == (None, 0)
    assert _tier(tmp_path).stats().entries == 1


def _one_entry(tmp_path: Path) -> tuple[DiskTier, Path]:
    tier = _tier(tmp_path)
    assert tier.write(_tokens(32, 0), _cache(32, 5))
    (data,) = tier.dir.glob("*.safetensors")
    return tier, data


def test_a_damaged_file_is_removed_not_loaded(tmp_path: Path) -> None:
    tier, data = _one_entry(tmp_path)
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF  # one flipped bit in the values: the size still matches
    data.write_bytes(bytes(raw))
    ram = PromptCache(disk=_tier(tmp_path))
    assert ram.lookup(_tokens(32, 0) + [1]) == (None, 0)
    assert not data.exists() and not data.with_suffix(".json").exists()
    assert ram.disk is not None and ram.disk.stats().removed_invalid == 1


@pytest.mark.parametrize("damage", ["truncate", "index", "foreign", "orphan", "temporary"])
def test_bad_files_are_removed_at_start(tmp_path: Path, damage: str) -> None:
    tier, data = _one_entry(tmp_path)
    index = data.with_suffix(".json")
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:100])
    elif damage == "index":
        index.write_text("{not json")
    elif damage == "foreign":  # an index in this directory naming another model
        index.write_text(index.read_text().replace('"model-a|f16"', '"model-z|f16"'))
    elif damage == "orphan":
        index.unlink()
    else:
        (tier.dir / ".half-written.safetensors").write_bytes(b"x" * 10)
    again = _tier(tmp_path)
    if damage == "temporary":
        assert again.stats().entries == 1
        assert not (tier.dir / ".half-written.safetensors").exists()
        return
    assert again.stats().entries == 0 and again.stats().removed_invalid == 1
    assert not data.exists() and not index.exists()


def test_the_tier_is_bounded_by_bytes_least_recently_used_first(tmp_path: Path) -> None:
    tier, data = _one_entry(tmp_path)
    size = data.stat().st_size
    small = _tier(tmp_path, capacity=2 * size + size // 2)
    assert small.write(_tokens(32, 100), _cache(32, 6))
    entry, _ = small.best(_tokens(32, 0), 31)
    assert entry is not None and small.load(entry) is not None  # the first is used again
    assert small.write(_tokens(32, 200), _cache(32, 7))  # evicts the least recently used
    assert small.stats().entries == 2 and small.stats().evictions == 1
    assert small.best(_tokens(32, 100), 31) == (None, 0)
    assert small.best(_tokens(32, 0), 31)[1] == 31


def test_list_and_clear_a_directory(tmp_path: Path) -> None:
    _one_entry(tmp_path)
    DiskTier(tmp_path, 1 << 30, "model-b", F16).write(_tokens(32, 9), _cache(32, 8))
    listed = list_directory(tmp_path)
    assert len(listed) == 2 and all(s.entries == 1 and s.bytes > 0 for s in listed)
    removed, freed = clear_directory(tmp_path)
    assert removed == 4 and freed == sum(s.bytes for s in listed)
    assert list_directory(tmp_path) == []


def test_a_served_prefix_survives_a_restart(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Through `mlxcel serve --prompt-cache-dir`: held at shutdown, found after a restart
    (`timings.cache_n`), reported by `/v1/cache/stats`, listed and cleared by `mlxcel cache
    prompts`."""
    import subprocess
    import sys

    from server_harness import ServeProcess

    directory = tmp_path / "disk"
    args = ["-m", str(tiny_llama_dir), "-np", "1", "--no-warmup", "--prompt-cache-dir",
            str(directory)]  # fmt: skip
    body = {"prompt": "The lighthouse keeper counted " * 8, "n_predict": 6, "temperature": 0}
    first_server = ServeProcess(args).start()
    try:
        with first_server.client() as client:
            first = client.post("/completion", json=body).json()
            assert first["timings"]["cache_n"] == 0
    finally:
        assert first_server.stop() == 0
    assert list(directory.glob("*/*.safetensors"))
    second_server = ServeProcess(args).start()
    try:
        with second_server.client() as client:
            stats = client.get("/v1/cache/stats").json()["disk"]
            assert stats["enabled"] and stats["entries"] >= 1 and stats["removed_invalid"] == 0
            again = client.post("/completion", json=body).json()
            assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 1
            assert again["content"] == first["content"]
            assert client.get("/v1/cache/stats").json()["disk"]["hits"] == 1
    finally:
        second_server.stop()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "mlxcel", "cache", "prompts", *args],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    listed = cli("--dir", str(directory))
    assert listed.returncode == 0 and "entries" in listed.stdout
    cleared = cli("--dir", str(directory), "--clear", "--yes")
    assert cleared.returncode == 0 and "removed" in cleared.stdout
    assert not list(directory.glob("*/*.safetensors"))
    assert cli("--dir", str(tmp_path / "missing")).returncode == 2


def test_clear_leaves_what_the_tier_did_not_write(tmp_path: Path) -> None:
    """`mlxcel cache prompts --dir ~/models --clear` given the wrong directory by mistake:
    a model folder's config.json and weights stay, only the tier's entry goes."""
    _one_entry(tmp_path)
    model = tmp_path / "SmolLM2"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (model / name).write_text("{}")
    hexlike = tmp_path / ("ab" * 8)  # a namespace's name, not its files
    hexlike.mkdir()
    (hexlike / "weights.safetensors").write_text("x")
    [listed] = [s for s in list_directory(tmp_path) if s.entries]
    removed, _ = clear_directory(tmp_path)
    assert removed == 2
    assert sorted(p.name for p in model.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert (hexlike / "weights.safetensors").exists()
    assert not (tmp_path / listed.namespace).exists()
    assert [s.namespace for s in list_directory(tmp_path)] == [hexlike.name]
