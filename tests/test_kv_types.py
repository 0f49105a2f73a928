"""KV cache types (`-ctk/-ctv`): storage, the CPU kernel reading each type in place, greedy
output batched = alone and speculative = plain per type, the real bytes per token, and the
startup errors of what is not supported (`mlxcel serve`'s before it listens)."""

from __future__ import annotations

import copy
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxcel.engine.sampling.params import SamplingParams
from mlxcel.engine.text.request import GenerationRequest

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
PROMPTS = (
    "The cat sat on the mat, the hat sat on the cat. " * 2,
    "Water boils at 100 degrees",
    "Numbers such as 3.14, 2.71 and 1.41 appear again and again",
)


def _kernels() -> Any:
    from mlxcel.engine.cpu_kernels.build import load_kernels

    return load_kernels()


needs_kernel = pytest.mark.skipif(
    sys.platform != "linux" or _kernels() is None, reason="mlxcel's CPU kernel is Linux-only"
)


# ----------------------------------------------------------------------------- storage


def test_each_type_stores_its_dtype_through_merge_and_extract() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxcel.engine.text.kv_types import kv_type, typed_cache

    rows = mx.random.normal((1, 2, 5, 64))
    for name, stored in (("f32", mx.float32), ("f16", mx.float16), ("bf16", mx.bfloat16)):
        kv = kv_type(name)
        a, b = typed_cache([KVCache()], kv)[0], typed_cache([KVCache()], kv)[0]
        a.update_and_fetch(rows, rows)
        assert a.keys.dtype == stored
        batch = type(a).merge([a, b])
        batch.update_and_fetch(mx.random.normal((2, 2, 1, 64)), mx.random.normal((2, 2, 1, 64)))
        assert batch.keys.dtype == stored
        back = batch.extract(1)
        assert type(back) is type(a) and back.offset == 1 and back.keys.dtype == stored
        empty = type(a).merge([typed_cache([KVCache()], kv)[0]])  # mlx-lm's own would be f32
        empty.update_and_fetch(rows, rows)
        assert empty.keys.dtype == stored
    for name, bits in (("q8_0", 8), ("q4_0", 4)):
        q = typed_cache([KVCache()], kv_type(name))[0]
        q.update_and_fetch(rows, rows)
        assert (q.bits, q.group_size, q.keys[1].dtype) == (bits, 32, mx.float16)
        batch = type(q).merge([q, typed_cache([KVCache()], kv_type(name))[0]])
        assert batch.bits == bits and batch.size() == 5
        batch.update_and_fetch(mx.random.normal((2, 2, 1, 64)), mx.random.normal((2, 2, 1, 64)))
        first, second = batch.extract(0), batch.extract(1)
        assert (first.offset, second.offset) == (6, 1)
        assert mx.array_equal(first.keys[0][..., :5, :], q.keys[0][..., :5, :])


def test_bytes_per_token_follow_the_type(tmp_path: Path) -> None:
    from fixtures.tiny_models import build_tiny_model

    from mlxcel.engine.loading import load_model
    from mlxcel.engine.text.kv_types import kv_type
    from mlxcel.engine.text.memory_budget import model_shapes

    path = build_tiny_model(tmp_path / "m", hidden_size=128, num_heads=2, num_kv_heads=1)
    model = load_model(str(path)).model
    per_row = {"f32": 256, "f16": 128, "bf16": 128, "q8_0": 64 + 8, "q4_0": 32 + 8}
    for name, row in per_row.items():
        # 2 layers x 1 key head x (keys + values)
        assert model_shapes(model, kv_type(name)).kv_bytes_per_token == 2 * 2 * row
    assert model_shapes(model).kv_bytes_per_token == 2 * 2 * 256  # the model's float32


# -------------------------------------------------------------------------- the kernel


def _reference(q: Any, k: Any, v: Any, scale: float) -> Any:
    import mlx.core as mx

    repeat = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, repeat, axis=1), mx.repeat(v, repeat, axis=1)
    L, S = q.shape[2], k.shape[2]
    visible = mx.arange(S)[None] <= (S - L + mx.arange(L))[:, None]
    scores = mx.where(visible, (q @ k.swapaxes(-1, -2)) * scale, -mx.inf)
    return mx.softmax(scores, axis=-1) @ v


def _values(packed: Any, group: int, bits: int) -> Any:
    """The float32 values 8 / 4-bit rows hold (float16 scales and biases, exactly)."""
    import mlx.core as mx

    scales, biases = packed[1].astype(mx.float32), packed[2].astype(mx.float32)
    return mx.dequantize(packed[0], scales, biases, group_size=group, bits=bits)


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 128, 256, 48])
def test_the_kernel_reads_each_type_in_place(head_dim: int) -> None:
    """float16 / bfloat16 rows and 8 / 4-bit rows (groups of 32 and 64) give the attention
    of the float32 values they hold (strided cache slices, causal, grouped heads)."""
    import mlx.core as mx

    kernels = _kernels()
    mx.random.seed(head_dim)
    B, Hq, Hk, L, S, D = 2, 6, 2, 3, 37, head_dim
    q = mx.random.normal((B, Hq, L, D))
    k32 = mx.random.normal((B, Hk, S + 5, D))[:, :, :S]
    v32 = mx.random.normal((B, Hk, S + 5, D))[:, :, :S]
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        k, v = k32.astype(dtype), v32.astype(dtype)
        out = kernels.attention(q, k, v, 0.125, 1, None)
        expected = _reference(q, k.astype(mx.float32), v.astype(mx.float32), 0.125)
        assert out.dtype == mx.float32
        assert float(mx.abs(out - expected).max()) < 1e-5, dtype
    if D % 32:
        return
    for bits in (8, 4):
        for group in (32, 64):
            if D % group:
                continue
            kq = mx.quantize(k32.astype(mx.float16), group_size=group, bits=bits)
            vq = mx.quantize(v32.astype(mx.float16), group_size=group, bits=bits)
            out = kernels.quantized_attention(q, *kq, *vq, 0.125, 1, None, bits, group)

            expected = _reference(q, _values(kq, group, bits), _values(vq, group, bits), 0.125)
            assert float(mx.abs(out - expected).max()) < 1e-5, (bits, group)


# ------------------------------------------------------------------ greedy output, engine


@pytest.fixture(scope="module")
def wide_loaded(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny llama with 64-value heads (the quantized types need a multiple of 32), on the
    CPU kernel's attention."""
    from fixtures.tiny_models import build_tiny_model

    from mlxcel.engine.loading import load_model

    path = build_tiny_model(
        tmp_path_factory.mktemp("kv") / "tiny-llama-64", hidden_size=128, num_heads=4,
        num_kv_heads=2,
    )  # fmt: skip
    return load_model(str(path), cpu_dtype="auto")


def _request(loaded: Any, text: str, n: int) -> GenerationRequest:
    return GenerationRequest(
        prompt_tokens=loaded.tokenizer.encode(text),
        sampling=SamplingParams(temperature=0.0),
        max_tokens=n,
        ignore_eos=True,
        cache_prompt=False,
    )


def _tokens(engine: Any, request: GenerationRequest) -> list[int]:
    return [t for e in engine.generate(copy.deepcopy(request)) for t in e.token_ids]


def _engine(loaded: Any, name: str, **kw: Any) -> Any:
    from mlxcel.engine.text.kv_types import kv_type
    from mlxcel.engine.text.scheduler import TextEngine

    options: dict[str, Any] = {"slots": 1, "context_per_slot": 1024, "kv_type": kv_type(name)}
    options.update(kw)
    return TextEngine(loaded, **options).start()


@needs_kernel
@pytest.mark.parametrize("name", TYPES)
def test_batched_equals_alone_for_each_type(wide_loaded: Any, name: str) -> None:
    requests = [_request(wide_loaded, p, n) for p, n in zip(PROMPTS, (40, 33, 47), strict=True)]
    alone = _engine(wide_loaded, name)
    try:
        expected = [_tokens(alone, r) for r in requests]
    finally:
        alone.stop()
    batched = _engine(wide_loaded, name, slots=4)
    got: list[list[int]] = [[] for _ in requests]
    try:

        def run(i: int) -> None:
            got[i] = _tokens(batched, requests[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert batched.counters.busy_slots_max >= 2  # they did share the batch
        snap = batched.snapshot()
        assert snap.kv_type == name and snap.kv_bytes_per_token > 0
    finally:
        batched.stop()
    assert got == expected


@needs_kernel
@pytest.mark.parametrize("name", TYPES)
def test_speculative_equals_plain_for_each_type(wide_loaded: Any, name: str) -> None:
    from mlxcel.engine.text.speculative import SpeculationConfig

    request = _request(wide_loaded, PROMPTS[0], 60)
    plain = _engine(wide_loaded, name)
    try:
        expected = _tokens(plain, request)
    finally:
        plain.stop()
    lookup = SpeculationConfig("prompt-lookup", n_max=4, adaptive=False)
    spec = _engine(wide_loaded, name, speculation=lookup)
    try:
        events = list(spec.generate(copy.deepcopy(request)))
    finally:
        spec.stop()
    assert [t for e in events for t in e.token_ids] == expected
    timings = events[-1].timings
    assert timings is not None and timings.draft_rounds > 0


@needs_kernel
def test_q8_0_stays_close_to_f16(wide_loaded: Any) -> None:
    """Not bit-identical across types (the values differ), but the quantized cache must
    compute the same attention: the first tokens agree on this model."""
    request = _request(wide_loaded, PROMPTS[1], 8)
    runs = {}
    for name in ("f16", "q8_0"):
        engine = _engine(wide_loaded, name)
        try:
            runs[name] = _tokens(engine, request)
        finally:
            engine.stop()
    assert runs["q8_0"][:4] == runs["f16"][:4]


# ------------------------------------------------------------------------ startup errors


def _mlxcel(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", *args], capture_output=True, text=True, timeout=240
    )


def test_types_that_differ_or_do_not_exist_are_one_line_and_exit_2(tiny_llama_dir: Path) -> None:
    for args, words in (
        (("-ctk", "q8_0", "-ctv", "f16"), "-ctk q8_0 with -ctv f16"),
        (("-ctk", "q4_1", "-ctv", "q4_1"), "q4_1"),
    ):
        for command in (
            ("generate", "-m", str(tiny_llama_dir), "-n", "2", "Hi"),
            ("serve", "-m", str(tiny_llama_dir), "--port", "0"),
        ):
            done = _mlxcel(*command, *args)
            assert done.returncode == 2, done.stderr
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1 and words in lines[0] and "Traceback" not in done.stderr


def test_a_quantized_type_the_model_cannot_take_is_one_line_and_exit_2(
    tiny_llama_dir: Path,
) -> None:
    """The tiny llama's heads have 16 values, not a multiple of the group size (32)."""
    done = _mlxcel("generate", "-m", str(tiny_llama_dir), "-n", "2", "-ctk", "q4_0", "-ctv",
                   "q4_0", "Hi")  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "head size 16" in lines[0], done.stderr


def _refused_before_listening(model: Path, kv: str, words: str) -> None:
    """`mlxcel serve -m MODEL -ctk KV -ctv KV` exits 2 with one line naming `words`, before
    it announces a port."""
    done = _mlxcel("serve", "-m", str(model), "--host", "127.0.0.1", "--port", "0",
                   "-ctk", kv, "-ctv", kv)  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], done.stderr
    assert "listening" not in done.stderr


def test_serve_refuses_a_head_size_off_the_group_before_listening(
    tiny_llama_dir: Path, tiny_gguf: Path
) -> None:
    """The tiny llama's 16-value heads, as an MLX directory and as a GGUF file: the model is
    built from its configuration (no weights read) and refused before the port opens."""
    for model in (tiny_llama_dir, tiny_gguf):
        _refused_before_listening(model, "q4_0", "head size 16")


def test_serve_refuses_a_sliding_window_model_before_listening(tmp_path: Path) -> None:
    """Gemma 3's sliding-window layers keep a rotating cache the quantized types lack."""
    from fixtures.tiny_gemma3 import write_tiny_gemma3_gguf

    path, _ = write_tiny_gemma3_gguf(tmp_path / "tiny-gemma3.gguf")
    _refused_before_listening(path, "q8_0", "sliding-window")


def test_serve_takes_a_quantized_type_the_model_can_take(tmp_path: Path) -> None:
    """32-value heads and plain KV layers: q8_0 passes the check before listening and the
    server answers with it."""
    from fixtures.tiny_models import build_tiny_model
    from server_harness import ServeProcess

    model = build_tiny_model(tmp_path / "tiny-llama-32", hidden_size=128, num_heads=4)
    args = ["-m", str(model), "-np", "1", "-c", "256", "--no-warmup", "-ctk", "q8_0", "-ctv",
            "q8_0"]  # fmt: skip
    with ServeProcess(args) as server:
        body = {"prompt": "Hello", "n_predict": 3, "temperature": 0}
        answer = httpx.post(f"{server.url}/completion", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert httpx.get(f"{server.url}/slots", timeout=30).json()[0]["kv_cache_type"] == "q8_0"


def test_a_vision_model_takes_only_the_default_type(tmp_path: Path) -> None:
    """mlx-vlm's language models keep the model's dtype: another type is refused."""
    from fixtures.tiny_vlm import build_tiny_qwen2_vl

    model = build_tiny_qwen2_vl(tmp_path / "qwen2vl")
    done = _mlxcel("generate", "-m", str(model), "-n", "2", "-ctk", "q8_0", "-ctv", "q8_0", "Hi")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "vision model" in lines[0], done.stderr
    _refused_before_listening(model, "bf16", "vision model")
