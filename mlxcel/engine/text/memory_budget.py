"""Request memory admission: refuse a request whose memory would not fit, before it runs.

Each request's memory is estimated from the model's shapes and the context it asks for
(prompt plus the tokens it may generate): its KV cache (every attention layer's keys and
values, allocated in mlx-lm's 256-token steps) plus the activations of one prefill chunk
(hidden states, MLP intermediates, attention scores and the last position's logits).
The KV cache is counted in the engine's KV type (`-ctk/-ctv`: its real bytes a row, scales
included for the quantized types), else in the model's dtype.

The budget is the memory the device can give requests: on Metal the smallest of the device's
recommended working set and MLX's allocator limit; elsewhere the smallest of MLX's allocator
limit, the process's memory limit (cgroup `memory.max`, `RLIMIT_AS`) and physical memory.
The weights already resident are taken off it. `MLXCEL_REQUEST_MEMORY_BUDGET` (a byte size
such as `12G`) can only lower it; an invalid value is refused when the server starts.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxcel.config.process_env import REQUEST_MEMORY_BUDGET, request_memory_budget
from mlxcel.engine.errors import RequestMemoryBudgetError

if TYPE_CHECKING:
    from mlxcel.engine.text.kv_types import KVType

KV_STEP = 256  # mlx-lm's KVCache grows its buffers in steps of this many tokens

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def parse_byte_size(text: str) -> int:
    """`12G`, `512M`, `1.5GiB`, `4096` -> bytes (binary units); ValueError unless > 0."""
    match = _SIZE.match(text or "")
    if match is None:
        raise ValueError(
            f"{REQUEST_MEMORY_BUDGET}={text!r}: not a byte size (examples: 12G, 512M, 1073741824)"
        )
    number, unit, _ = match.groups()
    value = int(float(number) * _UNITS[unit.lower()])
    if value <= 0:
        raise ValueError(f"{REQUEST_MEMORY_BUDGET}={text!r}: the budget must be more than 0 bytes")
    return value


def configured_budget(environ: Mapping[str, str] | None = None) -> int | None:
    """The budget `MLXCEL_REQUEST_MEMORY_BUDGET` sets (None: unset); ValueError if invalid."""
    text = request_memory_budget(environ)
    return None if text is None else parse_byte_size(text)


def device_memory_limit() -> int:
    """The memory this process may use, from the device and the operating system."""
    import mlx.core as mx

    limits: list[int] = []
    with contextlib.suppress(AttributeError, RuntimeError):
        limits.append(int(mx.get_memory_limit()))
    if mx.metal.is_available():
        info = mx.device_info()
        working_set = info.get("max_recommended_working_set_size")
        if isinstance(working_set, int) and working_set > 0:
            limits.append(working_set)
    else:
        limits.extend(_os_limits())
    positive = [limit for limit in limits if limit > 0]
    return min(positive) if positive else 1 << 62


def _os_limits() -> list[int]:
    limits: list[int] = []
    with contextlib.suppress(ValueError, OSError, AttributeError):
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            limits.append(int(text))
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY and soft > 0:
            limits.append(int(soft))
    except (ImportError, ValueError, OSError):
        pass
    return limits


@dataclass(frozen=True)
class ModelShapes:
    """The figures of a model the estimate needs."""

    layers: int
    kv_heads: int
    head_dim: int
    heads: int
    hidden: int
    intermediate: int
    vocab: int
    dtype_bytes: int
    weight_bytes: int
    kv_row_bytes: int = 0  # one head's key (or value) row in the KV type; 0: the model dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys plus values of one token over every layer."""
        row = self.kv_row_bytes or self.head_dim * self.dtype_bytes
        return 2 * self.layers * self.kv_heads * row


def model_shapes(model: Any, kv: KVType | None = None) -> ModelShapes:
    """Shapes from an mlx-lm model's `args` (and its parameters for dtype and size); the
    KV cache in type `kv` (None: the model's dtype)."""
    from mlx.utils import tree_flatten

    args = getattr(model, "args", None)

    def arg(*names: str, default: int = 0) -> int:
        for name in names:
            value = getattr(args, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return default

    leaves: Any = tree_flatten(model.parameters())
    weight_bytes = sum(int(value.nbytes) for _, value in leaves)
    float_sizes = [int(v.itemsize) for _, v in leaves if "float" in str(v.dtype)]
    dtype_bytes = max(float_sizes) if float_sizes else 4
    layers = arg("num_hidden_layers", "n_layer", "num_layers")
    if not layers:
        layers = len(getattr(getattr(model, "model", model), "layers", []) or []) or 1
    hidden = arg("hidden_size", "d_model", "n_embd", default=1024)
    heads = arg("num_attention_heads", "n_head", default=max(1, hidden // 64))
    head_dim = arg("head_dim", default=max(1, hidden // heads))
    return ModelShapes(
        layers=layers,
        kv_heads=arg("num_key_value_heads", "n_kv_heads", default=heads),
        head_dim=head_dim,
        heads=heads,
        hidden=hidden,
        intermediate=arg("intermediate_size", "ffn_hidden_size", default=4 * hidden),
        vocab=arg("vocab_size", default=32000),
        dtype_bytes=dtype_bytes,
        weight_bytes=weight_bytes,
        kv_row_bytes=kv.row_bytes(head_dim) if kv is not None else 0,
    )


def estimate_request_bytes(shapes: ModelShapes, n_prompt: int, max_new: int, chunk: int) -> int:
    """Bytes one request needs: its KV cache plus one prefill chunk's activations."""
    tokens = max(1, n_prompt + max(0, max_new))
    kv = math.ceil(tokens / KV_STEP) * KV_STEP * shapes.kv_bytes_per_token
    step = max(1, min(n_prompt, chunk))
    width = shapes.dtype_bytes
    hidden = 4 * step * shapes.hidden * width
    mlp = 3 * step * shapes.intermediate * width
    scores = shapes.heads * step * tokens * 4
    logits = 2 * shapes.vocab * 4
    return kv + hidden + mlp + scores + logits


class MemoryAdmission:
    """Per model: the shapes once, the budget once per process; `check` per request."""

    def __init__(self, model: Any, budget: int | None = None, kv: KVType | None = None) -> None:
        self.shapes = model_shapes(model, kv)
        available = max(0, device_memory_limit() - self.shapes.weight_bytes)
        if budget is None:
            try:
                budget = configured_budget()
            except ValueError:  # `mlxcel serve` refuses it at start; elsewhere it is ignored
                budget = None
        configured = budget
        self.budget = available if configured is None else min(available, configured)

    def check(self, n_prompt: int, max_new: int, chunk: int) -> int:
        """The request's estimate; RequestMemoryBudgetError when it exceeds the budget."""
        estimated = estimate_request_bytes(self.shapes, n_prompt, max_new, chunk)
        if estimated > self.budget:
            raise RequestMemoryBudgetError(estimated, self.budget)
        return estimated


class AdmissionControl:
    """An engine's memory admission, held by the engine: the model's shapes are read at its
    first request (or before it sleeps) and kept, also while the model is unloaded.

    `model` gives the engine's network now. A vision-language model (mlx-vlm) is estimated
    from its language model, whose KV cache and activations grow with the context; its
    vision tower's memory is not counted. `kv`: the engine's KV cache type (None: the
    model's dtype)."""

    def __init__(self, model: Callable[[], Any], kv: KVType | None = None) -> None:
        self._model = model
        self._kv = kv
        self._lock = threading.Lock()
        self._admission: MemoryAdmission | None = None

    def admission(self) -> MemoryAdmission:
        """The admission of the engine's model (built at the first call, then kept)."""
        with self._lock:
            if self._admission is None:
                model = self._model()
                language = getattr(model, "language_model", None) or model
                self._admission = MemoryAdmission(language, kv=self._kv)
            return self._admission

    def kv_bytes_per_token(self) -> int:
        """The KV cache's bytes a token, every layer's keys and values."""
        return self.admission().shapes.kv_bytes_per_token

    def admit(self, n_prompt: int, max_new: int, chunk: int | None = None) -> None:
        """Refuse (RequestMemoryBudgetError) a request that would not fit in memory; `chunk`:
        the engine's prefill chunk (None: it runs the whole prompt at once)."""
        self.admission().check(n_prompt, max_new, chunk or max(1, n_prompt))
