"""Where a GGUF model's memory goes after `load_model`: RSS and MLX active memory against the
file size, and what of RSS is the runtime, the weights and the tokenizer.

    .venv/bin/python bench/gguf_memory.py [-m FILE.gguf] [--cpu-dtype auto]

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
- the store's `tokenizer.json` read by `Tokenizer.from_file` and by `read_tokenizer_json`.

The target (issue 27, item 1) is RSS and MLX active memory at most 1.3x the file size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gguf_vs_llama import shipped_gemma3
from llama_bench import cpu_name

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", help="a GGUF file (default: the shipped Gemma 3 270M)")
    parser.add_argument("--cpu-dtype", default="auto", help="as `mlxcel serve` (default auto)")
    args = parser.parse_args()
    path = args.model or shipped_gemma3()
    size = Path(path).stat().st_size
    print(f"file: {Path(path).name}, {size:,} bytes ({size / MIB:.1f} MiB); CPU: {cpu_name()}")

    with tempfile.TemporaryDirectory(prefix="mlxcel-memory-") as store:
        loads = {
            "converting": child(_LOAD, path, args.cpu_dtype, store),
            "from the store": child(_LOAD, path, args.cpu_dtype, store),
        }
        stored = loads["from the store"]
        modules = json.dumps(stored["modules"])
        runtime = child(_RUNTIME, args.cpu_dtype, stdin=modules)["rss"]
        bare = child(_BARE, args.cpu_dtype)["rss"]
        (tokenizer_json,) = Path(store).rglob("tokenizer.json")
        by_file = child(_TOKENIZER_JSON, str(tokenizer_json), "from_file")["rss"]
        by_python = child(_TOKENIZER_JSON, str(tokenizer_json), "python")["rss"]

    print(f"loaded as: {stored['quantization']}")
    print(f"{'':16} {'RSS':>11} {'RSS/file':>8} {'MLX active':>11} {'MLX/file':>8}", end="")
    print(f" {'peak RSS':>11} {'peak MLX':>11} {'load':>6}")
    for name, facts in loads.items():
        print(
            f"{name:16} {mib(facts['rss'])} {facts['rss'] / size:7.2f}x {mib(facts['mlx'])} "
            f"{facts['mlx'] / size:7.2f}x {mib(facts['peak_rss'])} {mib(facts['mlx_peak'])} "
            f"{facts['seconds']:5.1f}s"
        )
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
    for name, value in (("RSS", rss), ("MLX active", stored["mlx"])):
        verdict = "met" if value <= TARGET * size else "not met"
        print(f"{name} after load: {value / size:.2f}x the file, target <= {TARGET}x: {verdict}")


if __name__ == "__main__":
    main()
