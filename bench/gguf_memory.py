"""Where a GGUF model's memory goes after `load_model`: RSS and MLX active memory against the
file size, and what of RSS is the runtime, the weights and the tokenizer.

    .venv/bin/python bench/gguf_memory.py [-m FILE.gguf] [--cpu-dtype auto]
        [--synthetic [--synthetic-vocab 32000]]

Without `-m` it measures the shipped Gemma 3 270M Q4_K_M (bench/gguf_vs_llama.py assembles
it). Every figure comes from a fresh process, all in one run, with a model store of its own:

- `converting`: the first load, which converts the file and saves it to the store;
- `from the store`: the load every later start does;
- each load then drops its tokenizer, then its model (freed memory handed back each time:
  `release_memory`), so the drops give the tokenizer's and the weights' share of RSS;
- `runtime`: a process that imports every module the loading one ended with, runs one MLX
  op and maps the CPU kernel's library, and loads no model: the RSS that exists with no
  model at all;
- `bare runtime`: a process with only numpy, MLX (one op run), the `tokenizers` library
  and the CPU kernel's library, none of transformers or mlx-lm (whose package imports
  transformers): the floor of any process holding this model and a Rust tokenizer; with
  the weights and the tokenizer measured above it gives the floor of RSS after load;
- the store's `tokenizer.json` read by `Tokenizer.from_file` and by `read_tokenizer_json`;
- `RSS the load adds`: RSS after the load less RSS just before it (the loading modules
  already imported), the model's own share without the fixed runtime.

`--synthetic` also writes a random-weight llama GGUF of about 1 GB in K-quants (Q4_K_M's
mix as llama.cpp's quantizer makes it: Q4_K, Q6_K for the output head and for attn_v and
ffn_down in the layers its `use_more_bits` picks, half of them; the tests' random blocks,
a 32000-piece SentencePiece vocabulary: the tests' tiny one, padded; `--synthetic-vocab`
sets its size) into a temporary directory and measures it the same way: a file of the size
people run, where the fixed runtime weighs a quarter of what it does against the 241 MiB
Gemma 3 270M.

The target (issue 27, item 1) is RSS and MLX active memory at most 1.3x the file size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf_vs_llama import shipped_gemma3
from llama_bench import cpu_name

ROOT = Path(__file__).resolve().parent.parent

TARGET = 1.3
MIB = 2**20

_MEASURE = """
import gc, json, resource, sys
from mlxcel.engine.process_memory import memory_now, release_memory

def rss():
    release_memory()
    return memory_now().rss
"""

_LOAD = (
    _MEASURE
    + """
import time
import mlx.core as mx
from mlxcel.engine.loading import load_model

path, cpu_dtype, store = sys.argv[1:4]
base = rss()
start = time.perf_counter()
loaded = load_model(path, cpu_dtype=cpu_dtype, store_dir=store)
seconds = time.perf_counter() - start
loaded.tokenizer.encode("warm the tokenizer once, as serving does")
use = memory_now()
facts = {"base": base, "rss": rss(), "mlx": mx.get_active_memory(), "seconds": seconds,
         "mlx_peak": mx.get_peak_memory(),
         "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
         "quantization": loaded.info.quantization}
loaded.tokenizer = None
gc.collect()
facts["no_tokenizer"] = rss()
loaded.model = None
gc.collect()
facts["no_model"] = rss()
facts["modules"] = sorted(m for m in sys.modules if not m.startswith("__"))
print(json.dumps(facts))
"""
)

_RUNTIME = (
    _MEASURE
    + """
import importlib
for name in json.loads(sys.stdin.read()):
    try:
        importlib.import_module(name)
    except Exception:
        pass
import mlx.core as mx
from mlxcel.engine.cpu_kernels.build import load_kernels

mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))  # MLX's CPU device started, as a load does
if sys.argv[1] == "auto":
    load_kernels()  # and the CPU kernel's library mapped
print(json.dumps({"rss": rss()}))
"""
)

_BARE = (
    _MEASURE
    + """
import numpy, tokenizers
import mlx.core as mx
from mlxcel.engine.cpu_kernels.build import load_kernels

mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
if sys.argv[1] == "auto":
    load_kernels()
assert "transformers" not in sys.modules and "mlx_lm" not in sys.modules
print(json.dumps({"rss": rss()}))
"""
)

_TOKENIZER_JSON = (
    _MEASURE
    + """
from pathlib import Path
from tokenizers import Tokenizer
from mlxcel.engine.loading.gguf_tokenizer import read_tokenizer_json

path, how = Path(sys.argv[1]), sys.argv[2]
base = rss()
tokenizer = Tokenizer.from_file(str(path)) if how == "from_file" else read_tokenizer_json(path)
print(json.dumps({"rss": rss() - base}))
"""
)


def child(script: str, *args: str, stdin: str = "") -> dict[str, Any]:
    """Run `script` in a fresh interpreter; its last stdout line, as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"measuring process failed:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def mib(n: float) -> str:
    return f"{n / MIB:7.1f} MiB"


# The synthetic llama: 26 layers of 2048 wide (GQA 16/4 heads, MLP 8192), 32000 pieces.
SYNTHETIC = {"hidden": 2048, "layers": 26, "heads": 16, "kv_heads": 4, "mlp": 8192, "vocab": 32000}
_TEMPLATE_ROWS = 64  # random rows per tensor, repeated down it (the file's bytes, cheaply)


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the layers whose attn_v and ffn_down Q4_K_M holds in Q6_K
    (the first and last eighth, and every third one between)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def write_synthetic_llama(path: Path, dims: Mapping[str, int] = SYNTHETIC) -> Path:
    """A random-weight llama GGUF in Q4_K_M's mix of K-quants (see module doc), of about 1 GB
    with the default `dims` (widths multiples of 256, as K-quant blocks are)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import gguf
    from fixtures.gguf_quant_blocks import random_blocks
    from fixtures.tiny_spm import add_spm_vocabulary, spm_vocabulary

    c = dims
    hidden, kv = c["hidden"], c["kv_heads"] * c["hidden"] // c["heads"]
    pieces, scores, types = spm_vocabulary(path)
    pad = c["vocab"] - len(pieces)
    pieces += [f"\u2581pad{i}" for i in range(pad)]
    scores += [min(scores) - 1.0 - i for i in range(pad)]
    types += [1] * pad  # normal pieces
    rng = np.random.default_rng(0)

    def blocks(kind: str, rows: int, width: int) -> tuple[np.ndarray, Any]:
        template = random_blocks(kind, min(rows, _TEMPLATE_ROWS), width, rng, largest=0.05)
        data = np.tile(template, (-(-rows // len(template)), 1))[:rows]
        return data, gguf.GGMLQuantizationType[kind]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("synthetic-llama-1gb")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_block_count(c["layers"])
    writer.add_feed_forward_length(c["mlp"])
    writer.add_head_count(c["heads"])
    writer.add_head_count_kv(c["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(c["vocab"])
    writer.add_rope_dimension_count(hidden // c["heads"])
    add_spm_vocabulary(writer, pieces, scores, types)
    norm = np.ones(hidden, np.float32)
    tensors = {
        "token_embd.weight": blocks("Q4_K", c["vocab"], hidden),
        "output_norm.weight": (norm, None),
        "output.weight": blocks("Q6_K", c["vocab"], hidden),
    }
    for layer in range(c["layers"]):
        wide = "Q6_K" if more_bits(layer, c["layers"]) else "Q4_K"
        shapes = {
            "attn_q": ("Q4_K", hidden, hidden),
            "attn_k": ("Q4_K", kv, hidden),
            "attn_v": (wide, kv, hidden),
            "attn_output": ("Q4_K", hidden, hidden),
            "ffn_gate": ("Q4_K", c["mlp"], hidden),
            "ffn_up": ("Q4_K", c["mlp"], hidden),
            "ffn_down": (wide, hidden, c["mlp"]),
        }
        for name, (kind, rows, width) in shapes.items():
            tensors[f"blk.{layer}.{name}.weight"] = blocks(kind, rows, width)
        for name in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{layer}.{name}.weight"] = (norm, None)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def measure(path: str, cpu_dtype: str, store: str) -> dict[str, dict[str, Any]]:
    """The first load (converting) and the next one (from the store), each in a fresh
    process with `store` as its model store."""
    return {
        "converting": child(_LOAD, path, cpu_dtype, store),
        "from the store": child(_LOAD, path, cpu_dtype, store),
    }


def print_loads(loads: dict[str, dict[str, Any]], size: int) -> None:
    """The table of both loads: RSS, MLX active memory, their peaks, the load's time."""
    print(f"{'':16} {'RSS':>11} {'RSS/file':>8} {'MLX active':>11} {'MLX/file':>8}", end="")
    print(f" {'peak RSS':>11} {'peak MLX':>11} {'load':>6}")
    for name, facts in loads.items():
        print(
            f"{name:16} {mib(facts['rss'])} {facts['rss'] / size:7.2f}x {mib(facts['mlx'])} "
            f"{facts['mlx'] / size:7.2f}x {mib(facts['peak_rss'])} {mib(facts['mlx_peak'])} "
            f"{facts['seconds']:5.1f}s"
        )


def print_added(stored: dict[str, Any], size: int) -> None:
    added = stored["rss"] - stored["base"]
    print(
        f"RSS the load adds (after load - before load): {mib(added).strip()}, {added / size:.2f}x"
    )


def print_verdicts(stored: dict[str, Any], size: int) -> None:
    for name, value in (("RSS", stored["rss"]), ("MLX active", stored["mlx"])):
        verdict = "met" if value <= TARGET * size else "not met"
        print(f"{name} after load: {value / size:.2f}x the file, target <= {TARGET}x: {verdict}")


def synthetic_section(cpu_dtype: str, vocab: int) -> None:
    """Write the synthetic llama (a `vocab`-piece vocabulary), measure its loads, print them."""
    dims = {**SYNTHETIC, "vocab": vocab}
    with tempfile.TemporaryDirectory(prefix="mlxcel-memory-1gb-") as directory:
        path = write_synthetic_llama(Path(directory) / "synthetic-llama-q4_k_m.gguf", dims)
        size = path.stat().st_size
        store = Path(directory) / "store"
        loads = measure(str(path), cpu_dtype, str(store))
    stored = loads["from the store"]
    print(f"\nsynthetic llama (random K-quant weights, {dims}): ", end="")
    print(f"{size:,} bytes ({size / MIB:.1f} MiB)")
    print(f"loaded as: {stored['quantization']}")
    print_loads(loads, size)
    print(f"RSS before the load (the loading modules imported): {mib(stored['base']).strip()}")
    print_added(stored, size)
    for name, value in (
        (
            "weights (tokenizer dropped -> model dropped)",
            stored["no_tokenizer"] - stored["no_model"],
        ),
        ("tokenizer (loaded -> tokenizer dropped)", stored["rss"] - stored["no_tokenizer"]),
    ):
        print(f"  {name:48} {mib(value)} {value / size:5.2f}x the file")
    print_verdicts(stored, size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", help="a GGUF file (default: the shipped Gemma 3 270M)")
    parser.add_argument("--cpu-dtype", default="auto", help="as `mlxcel serve` (default auto)")
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="also measure a random-weight ~1 GB K-quant llama GGUF (written to a temp dir)",
    )
    parser.add_argument(
        "--synthetic-vocab",
        type=int,
        default=SYNTHETIC["vocab"],
        help="the synthetic llama's vocabulary size (default 32000; Gemma's is 262144, "
        "which adds 2 x 262144 x 2048 weights too)",
    )
    args = parser.parse_args()
    path = args.model or shipped_gemma3()
    size = Path(path).stat().st_size
    print(f"file: {Path(path).name}, {size:,} bytes ({size / MIB:.1f} MiB); CPU: {cpu_name()}")

    with tempfile.TemporaryDirectory(prefix="mlxcel-memory-") as store:
        loads = measure(path, args.cpu_dtype, store)
        stored = loads["from the store"]
        modules = json.dumps(stored["modules"])
        runtime = child(_RUNTIME, args.cpu_dtype, stdin=modules)["rss"]
        bare = child(_BARE, args.cpu_dtype)["rss"]
        (tokenizer_json,) = Path(store).rglob("tokenizer.json")
        by_file = child(_TOKENIZER_JSON, str(tokenizer_json), "from_file")["rss"]
        by_python = child(_TOKENIZER_JSON, str(tokenizer_json), "python")["rss"]

    print(f"loaded as: {stored['quantization']}")
    print_loads(loads, size)
    rss = stored["rss"]
    parts = {
        "runtime, no model (the same modules imported)": runtime,
        "weights (tokenizer dropped -> model dropped)": stored["no_tokenizer"] - stored["no_model"],
        "tokenizer (loaded -> tokenizer dropped)": rss - stored["no_tokenizer"],
        "rest (model dropped -> runtime)": stored["no_model"] - runtime,
    }
    print(f"RSS after a load from the store, {mib(rss).strip()}:")
    for name, value in parts.items():
        print(f"  {name:48} {mib(value)} {value / size:5.2f}x the file")
    print(f"RSS above the runtime: {mib(rss - runtime).strip()}, {(rss - runtime) / size:.2f}x")
    print_added(stored, size)
    print(f"the store's tokenizer.json: Tokenizer.from_file {mib(by_file).strip()}, ", end="")
    print(f"read_tokenizer_json {mib(by_python).strip()}")
    weights, tokenizer = (
        parts["weights (tokenizer dropped -> model dropped)"],
        rss - stored["no_tokenizer"],
    )
    print(
        f"bare runtime (numpy, MLX, tokenizers; no transformers, no mlx-lm): {mib(bare).strip()}, "
        f"{bare / size:.2f}x; transformers and mlx-lm add {mib(runtime - bare).strip()}"
    )
    for name, value in (
        ("bare runtime + weights + tokenizer", bare + weights + tokenizer),
        ("bare runtime + weights", bare + weights),
    ):
        print(f"floor, {name}: {mib(value).strip()}, {value / size:.2f}x the file")
    print_verdicts(stored, size)
    if args.synthetic:
        synthetic_section(args.cpu_dtype, args.synthetic_vocab)


if __name__ == "__main__":
    main()
