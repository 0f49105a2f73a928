"""The sampling chain, written once: every stage in llama.cpp's order, over a batch of rows.

The order: top-n-sigma; the candidates (the top k, or the whole vocabulary sorted when top-p
needs it, else the vocabulary in its own order); typical-p; top-p; min-p; XTC; the
temperature (fixed or dynamic); mlxcel's p-less; then adaptive-p's reshaping when it is on,
and a categorical draw. Mirostat (1 or 2) replaces the stages from top-n-sigma to XTC, as in
llama.cpp: the temperature, then its own truncation at each row's target `mu`.

Each row's settings are `[G, 1]` columns (`ChainSettings`, built from the `STAGES` table):
a stage no row uses is skipped, one only some rows use goes through `mx.where`, so a row
draws the same tokens whatever shares its batch. Rows draw with a key each (`[G, 2]`), or
all with one key (a request's own sampler: `samplers.make_sampler` runs this chain on a
batch of one row; the decode batch's sampler is `batched.BatchSampler`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from mlxcel.engine.sampling.params import SamplingParams
from mlxcel.engine.sampling.stages import (
    adaptive_p_transform,
    dynamic_temperature,
    gumbel_choice,
    mask_min_p,
    mask_p_less,
    mask_top_n_sigma,
    mask_top_p,
    mask_typical,
    mask_xtc,
    mirostat_candidates,
    sorted_candidates,
    top_k_candidates,
)

Candidates = tuple[str, int]
"""How a row finds its candidates: ("greedy", 0), ("mirostat", version), ("top_k", k),
("sorted", 0) (the vocabulary sorted, for top-p) or ("vocab", 0) (the vocabulary as is).
Rows with the same `Candidates` run as one batched graph."""


def candidates_of(params: SamplingParams, vocab: int) -> Candidates:
    """How a row with `params` finds its candidates over a vocabulary of `vocab` tokens."""
    if params.temperature <= 0:
        return ("greedy", 0)
    if params.mirostat:
        return ("mirostat", int(params.mirostat))
    if 0 < params.top_k < vocab:
        return ("top_k", int(params.top_k))
    if params.top_p < 1.0:
        return ("sorted", 0)
    return ("vocab", 0)


def adaptive_target(params: SamplingParams) -> float | None:
    """Adaptive-p's target (at most 1), or None when it is off: a negative target, or
    Mirostat in its place."""
    if params.adaptive_target < 0 or params.mirostat:
        return None
    return min(float(params.adaptive_target), 1.0)


def initial_mu(params: SamplingParams) -> float:
    """Mirostat's starting target: twice tau, as llama.cpp starts it."""
    return 2.0 * float(params.mirostat_tau)


_TOP_P_KEEPS_ONE = 1e-9
"""The top_p a row runs with at least: top_p 0 keeps the most probable token alone, as
llama.cpp keeps at least one (the top token's probability is at least 1 / vocabulary)."""


@dataclass(frozen=True)
class Stage:
    """One stage's per-row settings: whether a row uses the stage, and the values (one
    column each) it takes for a row that does."""

    uses: Callable[[SamplingParams], bool]
    values: tuple[Callable[[SamplingParams], float], ...] = ()


STAGES: dict[str, Stage] = {
    "top_n_sigma": Stage(lambda p: p.top_n_sigma > 0, (lambda p: p.top_n_sigma,)),
    "typical_p": Stage(lambda p: p.typical_p < 1.0, (lambda p: p.typical_p,)),
    "top_p": Stage(lambda p: p.top_p < 1.0, (lambda p: max(p.top_p, _TOP_P_KEEPS_ONE),)),
    "min_p": Stage(lambda p: p.min_p > 0, (lambda p: math.log(p.min_p),)),
    "xtc": Stage(
        lambda p: p.xtc_probability > 0,
        (lambda p: p.xtc_probability, lambda p: p.xtc_threshold),
    ),
    "dynatemp": Stage(
        lambda p: p.dynatemp_range > 0,
        (lambda p: p.temperature, lambda p: p.dynatemp_range, lambda p: p.dynatemp_exponent),
    ),
    "p_less": Stage(lambda p: bool(p.p_less)),
    "adaptive": Stage(
        lambda p: adaptive_target(p) is not None,
        (
            lambda p: adaptive_target(p) or 0.0,
            lambda p: min(max(float(p.adaptive_decay), 0.0), 0.99),
        ),
    ),
    "mirostat": Stage(
        lambda p: p.mirostat > 0, (lambda p: p.mirostat_tau, lambda p: p.mirostat_eta)
    ),
}
"""Every stage with per-row settings. A new knob of a stage is one entry here (and its
place in `truncate` when it is a new stage)."""

# The stages after which candidates no longer run most probable first.
_REORDERING = ("typical_p", "xtc", "adaptive")


def _column(values: Sequence[float | bool], dtype: mx.Dtype) -> mx.array:
    return mx.array(list(values), dtype=dtype)[:, None]


class ChainSettings:
    """The per-row settings of a batch of sampling (not greedy) rows, as `[G, 1]` columns."""

    __slots__ = ("flips_coins", "inv_temperature", "reorders", "stages", "xtc_always")

    def __init__(self, params: Sequence[SamplingParams]) -> None:
        self.inv_temperature = _column([1.0 / p.temperature for p in params], mx.float32)
        # stage name -> (its value columns, which rows use it: None when all do)
        self.stages: dict[str, tuple[tuple[mx.array, ...], mx.array | None]] = {}
        for name, stage in STAGES.items():
            uses = [stage.uses(p) for p in params]
            if not any(uses):
                continue
            columns = tuple(
                _column(
                    [value(p) if u else 0.0 for p, u in zip(params, uses, strict=True)], mx.float32
                )
                for value in stage.values
            )
            self.stages[name] = (columns, None if all(uses) else _column(uses, mx.bool_))
        # Every XTC row always applies it: no coin to flip.
        self.xtc_always = all(p.xtc_probability >= 1 for p in params if p.xtc_probability > 0)
        # XTC draws a coin per row (some row applies it with a probability below 1).
        self.flips_coins = "xtc" in self.stages and not self.xtc_always
        # A stage in use leaves the candidates out of most-probable-first order.
        self.reorders = any(name in self.stages for name in _REORDERING)

    def uses(self, name: str) -> bool:
        """Whether any row uses stage `name`."""
        return name in self.stages

    def values(self, name: str) -> tuple[mx.array, ...]:
        """Stage `name`'s value columns (the stage must be in use)."""
        return self.stages[name][0]

    def apply(
        self,
        name: str,
        vals: mx.array,
        stage: Callable[..., mx.array],
        otherwise: mx.array | None = None,
    ) -> mx.array:
        """`stage(vals, *columns)` for the rows using stage `name`; the other rows get
        `otherwise` (default: `vals` unchanged)."""
        rest = vals if otherwise is None else otherwise
        stage_columns = self.stages.get(name)
        if stage_columns is None:
            return rest
        columns, uses = stage_columns
        staged = stage(vals, *columns)
        return staged if uses is None else mx.where(uses, staged, rest)


def truncate(
    settings: ChainSettings, candidates: Candidates, logprobs: mx.array, coin_keys: mx.array | None
) -> tuple[mx.array, mx.array | None]:
    """The rows' candidates after every stage, divided by the temperature: (values, token ids;
    None when the candidates are the whole vocabulary in its own order).

    `coin_keys` draw XTC's coins (`coins`); None: from MLX's global random state.
    """
    vals = logprobs.astype(mx.float32)
    vals = settings.apply("top_n_sigma", vals, mask_top_n_sigma)
    idx: mx.array | None = None
    kind, k = candidates
    if kind == "top_k":
        vals, idx = top_k_candidates(vals, k)
    elif kind == "sorted":
        vals, idx = sorted_candidates(vals)
    vals = settings.apply("typical_p", vals, mask_typical)
    vals = settings.apply("top_p", vals, mask_top_p)
    vals = settings.apply("min_p", vals, mask_min_p)
    if settings.uses("xtc"):
        apply = None
        if settings.flips_coins:
            apply = coins(coin_keys, vals.shape[0]) < settings.values("xtc")[0]
        vals = settings.apply("xtc", vals, lambda v, _, threshold: mask_xtc(v, threshold, apply))
    fixed = vals * settings.inv_temperature
    vals = settings.apply("dynatemp", vals, _dynamic_scale, otherwise=fixed)
    vals = settings.apply("p_less", vals, mask_p_less)
    return vals, idx


def _dynamic_scale(
    vals: mx.array, temperature: mx.array, dynatemp_range: mx.array, exponent: mx.array
) -> mx.array:
    return vals * (1.0 / dynamic_temperature(vals, temperature, dynatemp_range, exponent))


def mirostat_truncate(
    settings: ChainSettings, logprobs: mx.array, mu: mx.array, version: int
) -> tuple[mx.array, mx.array | None]:
    """Mirostat's chain: the temperature, then its truncation at each row's `mu` ([G, 1]).
    (values, token ids: Mirostat 1's sorted, most probable first; Mirostat 2's None)."""
    return mirostat_candidates(logprobs.astype(mx.float32) * settings.inv_temperature, mu, version)


def adaptive_reshape(
    settings: ChainSettings, vals: mx.array, averages: mx.array
) -> tuple[mx.array, mx.array]:
    """Adaptive-p's reshaping of the rows using it, around their running `averages`
    ([G, 1]): (new values, the probabilities before it)."""
    (target, _decay), uses = settings.stages["adaptive"]
    shaped, probs = adaptive_p_transform(vals, target, averages)
    return (shaped if uses is None else mx.where(uses, shaped, vals)), probs


# -- random keys: one per row ([G, 2]), or one for every row ([2]) ---------------------------

_split3 = mx.vmap(lambda key: mx.random.split(key, 3))
_uniform1 = mx.vmap(lambda key: mx.random.uniform(shape=(1,), key=key))
_choices = mx.vmap(gumbel_choice)


def initial_key(seed: int | None) -> mx.array:
    """A request's first random key: from `seed`, or a fresh random one (None or negative)."""
    if seed is None or seed < 0:
        seed = secrets.randbits(63)
    return mx.random.key(seed & 0xFFFF_FFFF_FFFF_FFFF)


NEXT_KEYS, COIN_KEYS, DRAW_KEYS = 0, 1, 2  # the parts of a step's split keys


def split_keys(keys: mx.array) -> mx.array:
    """One step's keys from `keys` ([2] or [G, 2]): [3, 2] or [G, 3, 2], read with
    `key_part` (the next step's keys, XTC's coin keys, the draw keys). Per row, the same
    split as a lone key's."""
    return mx.random.split(keys, 3) if keys.ndim == 1 else _split3(keys)


def key_part(split: mx.array, part: int) -> mx.array:
    """Part `part` (`NEXT_KEYS`, `COIN_KEYS` or `DRAW_KEYS`) of `split_keys`' keys."""
    return split[part] if split.ndim == 2 else split[:, part]


def coins(keys: mx.array | None, rows: int) -> mx.array:
    """`[rows, 1]` uniform draws: one per row's key, or all from one key (None: MLX's global
    random state)."""
    if keys is None or keys.ndim == 1:
        return mx.random.uniform(shape=(rows, 1), key=keys)
    return _uniform1(keys)


def draw(vals: mx.array, keys: mx.array) -> mx.array:
    """The position of each row's draw from `softmax(vals)`: with a key per row, or one key
    for every row."""
    return gumbel_choice(vals, keys) if keys.ndim == 1 else _choices(vals, keys)
