"""Per-request sampling parameters (llama-server / OpenAI meanings and defaults), and the
one table of the sampling knobs that request parsing, the server defaults and `/props`
all read (`SAMPLING_KNOBS`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token; pure data, no MLX.

    Window sizes follow llama-server's `repeat_last_n`: 0 disables the penalty, -1 means the
    whole context. DRY is the exception (`dry_penalty_last_n` 0 or -1: whole context).
    `top_k` <= 0 is off, `temperature` <= 0 is greedy, a negative `seed` is like None
    (llama-server's -1: a fresh random seed). `top_n_sigma` <= 0, `typical_p` 1 and
    `dynatemp_range` 0 are off, as in llama-server. `mirostat` 1 or 2 replaces the
    truncation stages (top-n-sigma to XTC) with Mirostat, as llama-server does. A negative
    `adaptive_target` leaves adaptive-p off.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    p_less: bool = False
    repetition_penalty: float = 1.0
    repetition_context_size: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_context_size: int = 64
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 0
    dry_sequence_breakers: tuple[int, ...] = ()
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    top_n_sigma: float = -1.0
    typical_p: float = 1.0
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    adaptive_target: float = -1.0
    adaptive_decay: float = 0.9
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature <= 0)."""
        return self.temperature <= 0

    def validate(self) -> None:
        """Raise ValueError (one line) for the first out-of-range field."""
        for knob in SAMPLING_KNOBS:  # each knob's type and range, from the one table
            for name in knob.params:
                knob.check(name, getattr(self, name))
        for token in self.dry_sequence_breakers:
            _check(
                isinstance(token, int) and not isinstance(token, bool) and token >= 0,
                f"dry_sequence_breakers must be token ids >= 0, not {token!r}",
            )
        _check(
            self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
            f"seed must be an integer or None, not {self.seed!r}",
        )
        _check(isinstance(self.p_less, bool), f"p_less must be a boolean, not {self.p_less!r}")
        for entry in self.logit_bias:
            _check(
                isinstance(entry, tuple) and len(entry) == 2,
                f"logit_bias entries must be (token_id, bias) pairs, not {entry!r}",
            )
            token, bias = entry
            _check(
                isinstance(token, int) and not isinstance(token, bool) and token >= 0,
                f"logit_bias token ids must be integers >= 0, not {token!r}",
            )
            _check(
                isinstance(bias, (int, float)) and not math.isnan(bias) and bias != math.inf,
                f"logit_bias for token {token} must be a number or -inf, not {bias!r}",
            )


@dataclass(frozen=True)
class SamplingKnob:
    """One plain sampling setting, wherever it appears.

    `params` are the `SamplingParams` fields it sets (usually one), `setting` the `Settings`
    field holding the server default, `request` the request body field and the aliases it
    also answers to (llama-server's spellings), `kind` the value type. `props` is its name
    in `/props` `default_generation_settings` (None: not shown there). A negative value of
    a `negative_unset` knob means unset (llama-server's seed -1). `ge`, `gt` and `le` bound
    its value (None: unbounded on that side); `SamplingParams.validate` checks them.
    """

    params: tuple[str, ...]
    setting: str
    request: tuple[str, ...]
    kind: type
    props: str | None = None
    negative_unset: bool = False
    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    @property
    def name(self) -> str:
        """The request body field name."""
        return self.request[0]

    def check(self, name: str, value: Any) -> None:
        """Raise ValueError (one line, naming `name`) when `value` is not of the knob's type
        (a finite number for a float knob, an integer for an int one) or out of bounds."""
        if self.kind in (float, int) and not self.negative_unset:  # the seed may be None
            _check_type(name, value, self.kind)
        self.check_range(name, value)

    def check_range(self, name: str, value: float) -> None:
        """Raise ValueError (one line) when `value` of param `name` is out of the bounds
        (NaN always is)."""
        if (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
        ):
            return
        low = self.ge if self.ge is not None else self.gt
        if low is not None and self.le is not None:
            opening = "[" if self.ge is not None else "("
            rule = f"in {opening}{low:g}, {self.le:g}]"
        elif low is not None:
            rule = f"{'>=' if self.ge is not None else '>'} {low:g}"
        else:
            rule = f"<= {self.le:g}"
        raise ValueError(f"{name} must be {rule}, not {value}")

    def value(self, raw: Any) -> Any:
        """`raw` as given (None: not set), negative values unset where that applies."""
        if raw is not None and self.negative_unset and raw < 0:
            return None
        return raw


def _knob(
    param: str,
    setting: str,
    kind: type,
    *aliases: str,
    props: str | None = None,
    also: tuple[str, ...] = (),
    negative_unset: bool = False,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
) -> SamplingKnob:
    return SamplingKnob(
        (param, *also), setting, (param, *aliases), kind, props, negative_unset, ge, gt, le
    )


SAMPLING_KNOBS: tuple[SamplingKnob, ...] = (
    _knob("temperature", "temp", float, props="temperature", ge=0),
    _knob("top_k", "top_k", int, props="top_k"),
    _knob("top_p", "top_p", float, props="top_p", ge=0, le=1),  # 0: the top token only
    _knob("min_p", "min_p", float, props="min_p", ge=0, le=1),
    _knob(
        "repetition_penalty",
        "repeat_penalty",
        float,
        "repeat_penalty",
        props="repeat_penalty",
        gt=0,
    ),
    _knob(
        "repetition_context_size",
        "repeat_last_n",
        int,
        "repeat_last_n",
        props="repeat_last_n",
        also=("penalty_context_size",),
        ge=-1,
    ),
    _knob("seed", "seed", int, props="seed", negative_unset=True),
    _knob("frequency_penalty", "frequency_penalty", float, props="frequency_penalty"),
    _knob("presence_penalty", "presence_penalty", float, props="presence_penalty"),
    _knob("dry_multiplier", "dry_multiplier", float, props="dry_multiplier", ge=0),
    _knob("dry_base", "dry_base", float, props="dry_base", ge=0),  # below 1: DRY off
    _knob("dry_allowed_length", "dry_allowed_length", int, props="dry_allowed_length", ge=1),
    _knob("dry_penalty_last_n", "dry_penalty_last_n", int, props="dry_penalty_last_n", ge=-1),
    _knob("xtc_probability", "xtc_probability", float, ge=0, le=1),
    _knob("xtc_threshold", "xtc_threshold", float, ge=0, le=1),
    _knob("top_n_sigma", "top_n_sigma", float),
    _knob("typical_p", "typical_p", float, gt=0, le=1),
    _knob("dynatemp_range", "dynatemp_range", float, ge=0),
    _knob("dynatemp_exponent", "dynatemp_exponent", float, ge=0),
    _knob("mirostat", "mirostat", int, ge=0, le=2),
    _knob("mirostat_tau", "mirostat_tau", float, ge=0),
    _knob("mirostat_eta", "mirostat_eta", float, ge=0),
    _knob("adaptive_target", "adaptive_target", float, le=1),  # negative: off
    _knob("adaptive_decay", "adaptive_decay", float, ge=0, le=1),
    _knob("p_less", "", bool),
)
"""Every plain sampling knob, in `/props` order. `p_less` has no server setting (off). The
token-list knobs (`dry_sequence_breakers`, `logit_bias`) need the tokenizer and are read
on their own."""


def knob_overrides(values: dict[str, Any]) -> dict[str, Any]:
    """`SamplingParams` keyword arguments from knob values by request name (None: unset)."""
    out: dict[str, Any] = {}
    for knob in SAMPLING_KNOBS:
        value = knob.value(values.get(knob.name))
        for param in knob.params:
            out[param] = value
    return out


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_type(name: str, value: Any, kind: type) -> None:
    """A float knob takes any finite number, an int knob an integer (never a bool)."""
    if kind is int:
        _check(
            isinstance(value, int) and not isinstance(value, bool),
            f"{name} must be an integer, not {value!r}",
        )
        return
    _check(
        isinstance(value, (int, float)) and not isinstance(value, bool),
        f"{name} must be a number, not {value!r}",
    )
    _check(math.isfinite(value), f"{name} must be finite, not {value!r}")
