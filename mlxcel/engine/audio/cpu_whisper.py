"""Whisper's encoder and decoder forward passes in numpy, for the CPU.

On the CPU, MLX's Linux wheel computes `exp` and `erf` one scalar at a time (a 1500x1500
softmax per head and layer dominated the encoder: ~1.7 s for tiny.en's 30-second window) and
runs the decoder's per-token vocabulary projection as a transposed matrix-vector product that
is several times slower than numpy's on a pre-transposed copy. numpy's ufuncs are vectorized
(AVX2/AVX-512) and its matmuls run on its own OpenBLAS, so the same float32 arithmetic is
many times faster here. These classes take the weights of a loaded `mlx_whisper` model and
stand in for its `encoder` and `decoder` with the same call signatures (MLX arrays in and out),
so mlx-whisper's decoding loop, temperature fallback and word alignment run unchanged.

The attention and MLP work on row blocks so their intermediates stay in cache; GELU is the
exact (erf) one, with erf from Abramowitz & Stegun 7.1.26 (absolute error < 1.5e-7).

A window shorter than 30 seconds reaches the encoder padded with all-zero mel frames
(mlx-whisper's `pad_or_trim`). With `audio_ctx="auto"` (the default) the encoder runs on the
frames that hold audio plus a two-second margin instead of all 3000, as whisper.cpp's
`audio_ctx` does: the encoder's cost grows with the square of its length, so a 3-second clip
encodes about five times faster. `MLXCEL_WHISPER_AUDIO_CTX=full` keeps the whole window.
The encoder's large matmuls use one OpenBLAS thread per core (up to four); the decoder's
small ones stay on one.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mlxcel.config import process_env

if TYPE_CHECKING:
    import mlx.core as mx

ROWS = 256  # rows per attention / MLP block: a 256x1536 float32 block is 1.5 MiB
AUDIO_CTXS = ("auto", "full")
MARGIN_FRAMES = 200  # mel frames (2 s) kept after the last one that holds audio
STEP_FRAMES = 128  # the encoder's length is rounded up to a multiple of this many mel frames
# mlx_whisper.transcribe's defaults (mlxcel keeps them): a window's decoding above the first
# or below the second is redone at the next temperature, unless it is silence (the third).
COMPRESSION_RATIO_THRESHOLD = 2.4
LOGPROB_THRESHOLD = -1.0
NO_SPEECH_THRESHOLD = 0.6
MAX_ENCODER_THREADS = 4
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
_ERF_P = 0.3275911
_INV_SQRT2 = 0.7071067811865476


def gelu_(x: np.ndarray) -> np.ndarray:
    """Exact GELU, x * Φ(x), computed in place on float32 `x` (returned)."""
    z = np.abs(x) * np.float32(_INV_SQRT2)
    t = z * np.float32(_ERF_P)
    t += np.float32(1.0)
    np.reciprocal(t, out=t)
    poly = t * np.float32(_ERF_A[4])
    for a in _ERF_A[3::-1]:
        poly += np.float32(a)
        poly *= t
    np.multiply(z, z, out=z)
    np.negative(z, out=z)
    np.exp(z, out=z)
    poly *= z  # 1 - erf(|x| / sqrt 2)
    poly *= np.float32(0.5)  # Φ(-|x|)
    np.subtract(np.float32(1.0), poly, out=poly, where=x >= 0)  # Φ(x)
    x *= poly
    return x


def layer_norm(
    x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = 1e-5
) -> np.ndarray:
    """LayerNorm over the last axis (a new array)."""
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = np.mean(np.square(centred), axis=-1, keepdims=True)
    centred *= 1.0 / np.sqrt(var + np.float32(eps))
    centred *= weight
    centred += bias
    return centred


def softmax_(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in place."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


@dataclass
class _Linear:
    weight: np.ndarray  # (in, out), C-contiguous
    bias: np.ndarray | None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = x @ self.weight
        if self.bias is not None:
            y += self.bias
        return y


@dataclass
class _Norm:
    weight: np.ndarray
    bias: np.ndarray

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return layer_norm(x, self.weight, self.bias)


@dataclass
class _Attention:
    query: _Linear
    key: _Linear
    value: _Linear
    out: _Linear
    n_head: int


@dataclass
class _Block:
    attn: _Attention
    attn_ln: _Norm
    cross_attn: _Attention | None
    cross_attn_ln: _Norm | None
    mlp1: _Linear
    mlp2: _Linear
    mlp_ln: _Norm

    def mlp_(self, x: np.ndarray) -> None:
        """x += MLP(LN(x)), a block of rows at a time."""
        for start in range(0, x.shape[0], ROWS):
            rows = x[start : start + ROWS]
            hidden = self.mlp1(self.mlp_ln(rows))
            rows += self.mlp2(gelu_(hidden))


def _f32(value: Any) -> np.ndarray:
    return np.ascontiguousarray(np.array(value, dtype=np.float32))


def _linear(layer: Any) -> _Linear:
    bias = getattr(layer, "bias", None)
    return _Linear(_f32(layer.weight).T.copy(), None if bias is None else _f32(bias))


def _norm(layer: Any) -> _Norm:
    return _Norm(_f32(layer.weight), _f32(layer.bias))


def _attention(layer: Any, n_head: int) -> _Attention:
    return _Attention(
        _linear(layer.query), _linear(layer.key), _linear(layer.value), _linear(layer.out), n_head
    )


def _block(block: Any, n_head: int) -> _Block:
    cross = block.cross_attn
    return _Block(
        attn=_attention(block.attn, n_head),
        attn_ln=_norm(block.attn_ln),
        cross_attn=_attention(cross, n_head) if cross is not None else None,
        cross_attn_ln=_norm(block.cross_attn_ln) if cross is not None else None,
        mlp1=_linear(block.mlp1),
        mlp2=_linear(block.mlp2),
        mlp_ln=_norm(block.mlp_ln),
    )


def _heads(x: np.ndarray, n_head: int) -> np.ndarray:
    """(T, D) → (H, T, D/H), contiguous."""
    t, d = x.shape
    return np.ascontiguousarray(x.reshape(t, n_head, d // n_head).transpose(1, 0, 2))


def _merge(x: np.ndarray) -> np.ndarray:
    """(H, T, d) → (T, H*d)."""
    h, t, d = x.shape
    return x.transpose(1, 0, 2).reshape(t, h * d)


def _to_mx(x: np.ndarray) -> mx.array:
    import mlx.core as mx

    return mx.array(x)


def _to_np(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float32) if isinstance(x, np.ndarray) else np.array(x, np.float32)


class AudioEncoder:
    """Whisper's audio encoder (two convolutions, pre-norm transformer) on numpy.

    Called like mlx-whisper's: `encoder(mel)` with mel (batch, frames, n_mels) returns
    (batch, frames / 2, n_state) float32 as an MLX array.
    """

    def __init__(self, encoder: Any, n_head: int, *, audio_ctx: str = "auto") -> None:
        if audio_ctx not in AUDIO_CTXS:
            raise ValueError(f"audio_ctx must be one of {', '.join(AUDIO_CTXS)}, not {audio_ctx!r}")
        self.audio_ctx = audio_ctx

        def conv(layer: Any) -> _Linear:
            weight = _f32(layer.weight)  # MLX layout (out, kernel, in)
            return _Linear(weight.reshape(weight.shape[0], -1).T.copy(), _f32(layer.bias))

        self.conv1 = conv(encoder.conv1)
        self.conv2 = conv(encoder.conv2)
        self.positional = _f32(encoder._positional_embedding)
        self.blocks = [_block(b, n_head) for b in encoder.blocks]
        self.ln_post = _norm(encoder.ln_post)
        self.n_head = n_head

    def __call__(self, mel: Any) -> mx.array:
        batch = _to_np(mel)
        if batch.ndim == 2:
            batch = batch[None]
        return _to_mx(np.stack([self.encode(item) for item in batch]))

    def encode(self, mel: np.ndarray) -> np.ndarray:
        """One (frames, n_mels) log-mel spectrogram → (frames / 2, n_state) features; with
        `audio_ctx="auto"` a window's zero padding is mostly left out (fewer rows out)."""
        if self.audio_ctx == "auto" and mel.shape[0] == 2 * self.positional.shape[0]:
            mel = mel[: audio_frames(mel)]
        with _encoder_blas_threads():
            return self._encode(mel)

    def _encode(self, mel: np.ndarray) -> np.ndarray:
        padded = np.pad(mel, ((1, 1), (0, 0)))
        x = gelu_(self.conv1(np.concatenate([padded[:-2], padded[1:-1], padded[2:]], axis=1)))
        padded = np.pad(x, ((1, 1), (0, 0)))
        windows = [padded[0:-2:2], padded[1:-1:2], padded[2::2]]
        x = gelu_(self.conv2(np.concatenate(windows, axis=1)))
        positions = self.positional[: x.shape[0]]
        if x.shape != positions.shape or mel.shape[0] % 2:
            raise ValueError(f"incorrect audio shape {mel.shape} for this encoder")
        x += positions
        for block in self.blocks:
            x += self._self_attention(block.attn, block.attn_ln(x))
            block.mlp_(x)
        return self.ln_post(x)

    def _self_attention(self, attn: _Attention, x: np.ndarray) -> np.ndarray:
        n_head = attn.n_head
        scale = np.float32((x.shape[1] // n_head) ** -0.5)
        q = _heads(attn.query(x) * scale, n_head)
        k = np.ascontiguousarray(_heads(attn.key(x), n_head).transpose(0, 2, 1))  # (H, d, T)
        v = _heads(attn.value(x), n_head)
        out = np.empty_like(q)
        for head in range(n_head):
            for start in range(0, q.shape[1], ROWS):
                scores = softmax_(q[head, start : start + ROWS] @ k[head])
                np.matmul(scores, v[head], out=out[head, start : start + ROWS])
        return attn.out(_merge(out))


def audio_frames(mel: np.ndarray) -> int:
    """How many of a padded window's mel frames the encoder needs: those up to the last one
    that is not all zeros (mlx-whisper pads with zero frames), plus `MARGIN_FRAMES`, rounded
    up to `STEP_FRAMES`, at most the whole window."""
    holding = np.flatnonzero(np.any(mel != 0, axis=1))
    end = int(holding[-1]) + 1 if holding.size else 0
    return min(mel.shape[0], -(-(end + MARGIN_FRAMES) // STEP_FRAMES) * STEP_FRAMES)


class KVCache:
    """Per layer: self-attention keys/values (grown per token) and the cross-attention ones
    (computed once from the audio features). Indexing by a list reorders the batch, as
    mlx-whisper's beam search does with its cache."""

    def __init__(self, n_layer: int) -> None:
        self.self_kv: list[tuple[np.ndarray, np.ndarray] | None] = [None] * n_layer
        self.cross_kv: list[tuple[np.ndarray, np.ndarray] | None] = [None] * n_layer

    @property
    def length(self) -> int:
        first = self.self_kv[0]
        return 0 if first is None else int(first[0].shape[2])

    def __getitem__(self, index: Any) -> KVCache:
        other = KVCache(len(self.self_kv))
        other.self_kv = [
            None if kv is None else (kv[0][index], kv[1][index]) for kv in self.self_kv
        ]
        other.cross_kv = [
            None if kv is None else (kv[0][index], kv[1][index]) for kv in self.cross_kv
        ]
        return other


class TextDecoder:
    """Whisper's text decoder on numpy, called like mlx-whisper's:
    `decoder(tokens, audio_features, kv_cache)` → (logits, kv_cache, cross_qk), MLX arrays
    (the cache is a `KVCache`)."""

    def __init__(self, decoder: Any, n_head: int) -> None:
        self.embedding = _f32(decoder.token_embedding.weight)  # (vocab, state)
        self.unembedding = self.embedding.T.copy()  # (state, vocab): a fast matrix-vector product
        self.positional = _f32(decoder.positional_embedding)
        self.blocks = [_block(b, n_head) for b in decoder.blocks]
        self.ln = _norm(decoder.ln)
        self.n_head = n_head

    def __call__(
        self, tokens: Any, audio_features: Any, kv_cache: KVCache | None = None
    ) -> tuple[mx.array, KVCache, list[mx.array]]:
        ids = np.asarray(np.array(tokens), dtype=np.int64)
        cache = kv_cache if isinstance(kv_cache, KVCache) else KVCache(len(self.blocks))
        offset = cache.length
        x = self.embedding[ids] + self.positional[offset : offset + ids.shape[-1]]
        features = None
        cross_qk = []
        for layer, block in enumerate(self.blocks):
            x += self._self_attention(block, layer, x, cache, offset)
            if block.cross_attn is not None and block.cross_attn_ln is not None:
                if cache.cross_kv[layer] is None:
                    if features is None:
                        features = _to_np(audio_features)
                    cache.cross_kv[layer] = self._cross_kv(block.cross_attn, features)
                y, qk = self._cross_attention(block, layer, x, cache)
                x += y
                cross_qk.append(_to_mx(qk))
            for row in x:
                block.mlp_(row)
        logits = self.ln(x) @ self.unembedding
        return _to_mx(logits), cache, cross_qk

    def _self_attention(
        self, block: _Block, layer: int, x: np.ndarray, cache: KVCache, offset: int
    ) -> np.ndarray:
        attn = block.attn
        h = block.attn_ln(x)
        scale = np.float32((x.shape[-1] // attn.n_head) ** -0.5)
        q = self._split(attn.query(h)) * scale
        k = self._split(attn.key(h))
        v = self._split(attn.value(h))
        previous = cache.self_kv[layer]
        if previous is not None:
            k = np.concatenate([previous[0], k], axis=2)
            v = np.concatenate([previous[1], v], axis=2)
        cache.self_kv[layer] = (k, v)
        scores = q @ k.transpose(0, 1, 3, 2)  # (B, H, L, offset + L)
        n_new, n_all = q.shape[2], k.shape[2]
        if n_new > 1:
            future = np.arange(n_all)[None, :] > (offset + np.arange(n_new))[:, None]
            scores[..., future] = -np.inf
        return attn.out(self._join(softmax_(scores) @ v))

    def _cross_kv(self, attn: _Attention, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k = self._split(attn.key(features))
        return np.ascontiguousarray(k.transpose(0, 1, 3, 2)), self._split(attn.value(features))

    def _cross_attention(
        self, block: _Block, layer: int, x: np.ndarray, cache: KVCache
    ) -> tuple[np.ndarray, np.ndarray]:
        attn = block.cross_attn
        assert attn is not None and block.cross_attn_ln is not None
        kv = cache.cross_kv[layer]
        assert kv is not None
        scale = np.float32((x.shape[-1] // attn.n_head) ** -0.5)
        q = self._split(attn.query(block.cross_attn_ln(x))) * scale
        qk = q @ kv[0]  # (B, H, L, frames), before the softmax (for word alignment)
        weights = softmax_(qk.copy())
        return attn.out(self._join(weights @ kv[1])), qk

    def _split(self, x: np.ndarray) -> np.ndarray:
        """(B, T, D) → (B, H, T, D/H)."""
        b, t, d = x.shape
        return np.ascontiguousarray(
            x.reshape(b, t, self.n_head, d // self.n_head).transpose(0, 2, 1, 3)
        )

    @staticmethod
    def _join(x: np.ndarray) -> np.ndarray:
        """(B, H, T, d) → (B, T, H*d)."""
        b, h, t, d = x.shape
        return x.transpose(0, 2, 1, 3).reshape(b, t, h * d)


_SET_THREADS = (
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)


_limited = False  # whether limit_numpy_blas_threads set numpy's OpenBLAS to one thread


def _numpy_blas_setter() -> Any | None:
    """numpy's OpenBLAS `set_num_threads` function, or None when numpy has no OpenBLAS."""
    for path in _loaded_openblas():
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in _SET_THREADS:
            setter = getattr(library, symbol, None)
            if setter is not None:
                return setter
    return None


def limit_numpy_blas_threads() -> int | None:
    """One thread for numpy's OpenBLAS on machines with 4 cores or fewer, as mlxcel does for
    MLX's (`mlxcel.engine.blas`): its spinning helper threads fight the Python thread and
    other work for the cores. `OPENBLAS_NUM_THREADS` wins when set. Returns the count set,
    or None when nothing was changed (a larger machine, the variable set, no OpenBLAS)."""
    global _limited
    if os.environ.get("OPENBLAS_NUM_THREADS") or (os.cpu_count() or 1) > 4:
        return None
    setter = _numpy_blas_setter()
    if setter is None:
        return None
    setter(ctypes.c_int(1))
    _limited = True
    return 1


@contextmanager
def _encoder_blas_threads() -> Iterator[None]:
    """While the encoder runs (a few large matmuls), numpy's OpenBLAS gets one thread per
    core, up to `MAX_ENCODER_THREADS`, where `limit_numpy_blas_threads` had set one."""
    setter = _numpy_blas_setter() if _limited else None
    threads = min(os.cpu_count() or 1, MAX_ENCODER_THREADS)
    if setter is None or threads == 1:
        yield
        return
    setter(ctypes.c_int(threads))
    try:
        yield
    finally:
        setter(ctypes.c_int(1))


def _loaded_openblas() -> list[str]:
    """Paths of the OpenBLAS libraries numpy has loaded (Linux: from /proc/self/maps)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []
    found: list[str] = []
    for line in lines:
        path = line.split()[-1] if line.split() else ""
        if "openblas" in path.lower() and "numpy" in path.lower() and path not in found:
            found.append(path)
    return found


def use_numpy_forward(model: Any, *, audio_ctx: str | None = None) -> None:
    """Replace `model.encoder` / `model.decoder` (an mlx_whisper Whisper) by the numpy ones.

    The MLX weights they held are released; everything else (dims, alignment heads,
    mlx-whisper's decoding) is untouched. `audio_ctx` (default: $MLXCEL_WHISPER_AUDIO_CTX,
    else `auto`) is the encoder's: `auto` leaves most of a short window's padding out.
    """
    choice = (audio_ctx or process_env.whisper_audio_ctx() or "auto").strip().lower()
    limit_numpy_blas_threads()
    dims = model.dims
    encoder = AudioEncoder(model.encoder, dims.n_audio_head, audio_ctx=choice)
    decoder = TextDecoder(model.decoder, dims.n_text_head)
    # nn.Module keeps submodules as dict items; plain attributes win over them on lookup,
    # and deleting the items lets MLX free the weights.
    for name, replacement in (("encoder", encoder), ("decoder", decoder)):
        if name in model:
            del model[name]
        object.__setattr__(model, name, replacement)
    object.__setattr__(model, "decode", _FullContextRetry(model.decode, encoder))


class _FullContextRetry:
    """`model.decode` that decodes a window again on the whole 30 s of encoder input when
    the shortened one (`audio_ctx="auto"`) gives what mlx-whisper would reject (too
    repetitive or too unlikely, and not silence). The model never saw a short window in
    training: with a prompt (--prompt, or the previous window's text) it can repeat the
    speech until its token budget is spent, at every fallback temperature."""

    def __init__(self, decode: Callable[..., Any], encoder: AudioEncoder) -> None:
        self.decode = decode
        self.encoder = encoder

    def __call__(self, mel: Any, options: Any) -> Any:
        result = self.decode(mel, options)
        if self.encoder.audio_ctx != "auto" or not _rejected(result):
            return result
        self.encoder.audio_ctx = "full"
        try:
            return self.decode(mel, options)
        finally:
            self.encoder.audio_ctx = "auto"


def _rejected(result: Any) -> bool:
    """Whether mlx-whisper's transcribe (at its default thresholds) would fall back from
    `result` (a DecodingResult, or a list of them for a batch)."""
    if isinstance(result, list):
        return any(_rejected(item) for item in result)
    if result.no_speech_prob > NO_SPEECH_THRESHOLD:
        return False
    return bool(
        result.compression_ratio > COMPRESSION_RATIO_THRESHOLD
        or result.avg_logprob < LOGPROB_THRESHOLD
    )
