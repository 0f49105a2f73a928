"""bench/gguf_memory.py: where RSS goes after a GGUF load (no memory figure asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gguf_memory.py"


def test_prints_both_loads_and_a_breakdown_that_adds_up(tmp_path: Path) -> None:
    from fixtures.tiny_gemma3 import write_tiny_gemma3_gguf

    path, _ = write_tiny_gemma3_gguf(tmp_path / "tiny-gemma3.Q8_0.gguf", "Q8_0")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "-m", str(path), "--cpu-dtype", "keep"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    size = path.stat().st_size
    assert f"{size:,} bytes" in out
    for load in ("converting", "from the store"):
        row = re.search(rf"^{load} +([\d.]+) MiB +([\d.]+)x +([\d.]+) MiB +([\d.]+)x", out, re.M)
        assert row, out
        rss, rss_ratio, mlx, mlx_ratio = map(float, row.groups())
        assert abs(rss * 2**20 / size - rss_ratio) <= 0.01 * rss_ratio + 0.01
        assert abs(mlx * 2**20 / size - mlx_ratio) <= 0.01 * mlx_ratio + 0.01
    heading = re.search(r"RSS after a load from the store, ([\d.]+) MiB", out)
    assert heading, out
    total = float(heading.group(1))
    parts = [float(v) for v in re.findall(r"^  .+? +(-?[\d.]+) MiB", out, re.M)]
    assert len(parts) == 4 and abs(sum(parts) - total) <= 0.3, out
    assert parts[0] > 20  # the runtime: Python, MLX, transformers
    added = re.search(
        r"^RSS the load adds \(after load - before load\): ([\d.]+) MiB, ([\d.]+)x$", out, re.M
    )
    assert added, out
    assert 0 < float(added.group(1)) < total  # the load's share: the process had RSS before
    added_ratio = float(added.group(2))
    assert abs(float(added.group(1)) * 2**20 / size - added_ratio) <= 0.01 * added_ratio + 0.01
    assert "Tokenizer.from_file" in out and "read_tokenizer_json" in out
    bare = re.search(
        r"^bare runtime .+?: ([\d.]+) MiB, [\d.]+x; transformers and mlx-lm add", out, re.M
    )
    assert bare and 0 < float(bare.group(1)) < parts[0], out
    floors = dict(re.findall(r"^floor, (.+?): ([\d.]+) MiB, [\d.]+x the file$", out, re.M))
    with_tokenizer = float(bare.group(1)) + parts[1] + parts[2]
    assert abs(float(floors["bare runtime + weights + tokenizer"]) - with_tokenizer) <= 0.3
    assert abs(float(floors["bare runtime + weights"]) - (with_tokenizer - parts[2])) <= 0.3
    for name in ("RSS", "MLX active"):
        assert re.search(
            rf"^{name} after load: [\d.]+x the file, target <= 1.3x: (met|not met)$", out, re.M
        )


def test_the_synthetic_llama_is_a_q4_k_m_file_that_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--synthetic`'s writer, at a small size: a llama GGUF whose tensors are Q4_K, Q6_K
    where llama.cpp's Q4_K_M puts them (`use_more_bits`: the first and last eighth and every
    third layer between, as llama.cpp lists them for 32 layers), that mlxcel loads."""
    import gguf

    from mlxcel.engine.loading import load_model

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gguf_memory

    assert [i for i in range(32) if gguf_memory.more_bits(i, 32)] == [
        *range(4),
        *range(6, 28, 3),
        *range(28, 32),
    ]
    dims = {"hidden": 256, "layers": 8, "heads": 2, "kv_heads": 1, "mlp": 512, "vocab": 600}
    path = gguf_memory.write_synthetic_llama(tmp_path / "synthetic.gguf", dims)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    for layer in range(8):
        wide = "Q6_K" if layer in (0, 3, 6, 7) else "Q4_K"  # 0, 7, and (i - 1) % 3 == 2
        assert types[f"blk.{layer}.attn_v.weight"] == wide
        assert types[f"blk.{layer}.ffn_down.weight"] == wide
        assert types[f"blk.{layer}.ffn_up.weight"] == "Q4_K"
    loaded = load_model(str(path), cpu_dtype="keep", store_dir=str(tmp_path / "store"))
    assert loaded.info.quantization.startswith("Q4_K_M")
    assert loaded.tokenizer.vocab_size == 600
