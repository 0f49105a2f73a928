"""A generation request and the events that answer it."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Literal

from mlxcel.engine.sampling.params import SamplingParams
from mlxcel.engine.text.loop_detection import LoopParams

FinishReason = Literal["stop", "length", "error", "cancelled"]

_ids = itertools.count(1)


class Priority(enum.IntEnum):
    """Prefill queue order (`X-Priority`): lower values are admitted first."""

    HIGH = 0
    NORMAL = 1
    LOW = 2

    @classmethod
    def parse(cls, value: str | None) -> Priority:
        """`high|normal|low` (case-insensitive); None or empty means normal."""
        if not value:
            return cls.NORMAL
        try:
            return cls[value.strip().upper()]
        except KeyError:
            raise ValueError(f"X-Priority must be high, normal or low, not {value!r}") from None


@dataclass
class GenerationRequest:
    """One sequence to generate: prompt tokens, sampling and stopping rules."""

    prompt_tokens: list[int]
    max_tokens: int | None = None  # None: up to the slot's context
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    loop: LoopParams | None = None
    ignore_eos: bool = False
    cache_prompt: bool = True
    priority: Priority = Priority.NORMAL
    id_slot: int = -1  # llama-server's `id_slot`: the slot to run in (-1: any free one)
    logprobs: int | None = None  # None: off; N >= 0: sampled token + N alternatives
    post_sampling_probs: bool = False  # logprobs under the distribution actually sampled from
    grammar: Any = None  # a compiled grammar (mlxcel.engine.grammar.CompiledGrammar) or None
    thinking: Any = None  # a thinking budget (mlxcel.engine.text.thinking_budget) or None
    skip_special: bool = True  # False: special tokens' text is decoded (output parsers)
    media: Any = None  # a vision prompt (mlxcel.engine.vision.VisionPrompt) or None
    timings_per_token: bool = False  # every token's event carries the timings so far
    progress: bool = False  # prefill progress events (`GenerationEvent.progress`)
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one generated token and its top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Timings:
    """llama-server style timings of one request."""

    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    cache_n: int = 0
    # Speculative decoding, for the request: tokens drafted, drafted tokens accepted,
    # verify rounds, and the drafter's kind ("prompt-lookup" or the draft model's).
    draft_n: int = 0
    draft_n_accepted: int = 0
    draft_rounds: int = 0
    draft_kind: str | None = None

    @property
    def prompt_per_second(self) -> float:
        return self.prompt_n / (self.prompt_ms / 1000) if self.prompt_ms > 0 else 0.0

    @property
    def predicted_per_second(self) -> float:
        return self.predicted_n / (self.predicted_ms / 1000) if self.predicted_ms > 0 else 0.0

    def to_dict(self) -> dict[str, float | int | str]:
        """The llama-server `timings` object (draft counters only after a verify round)."""
        out: dict[str, float | int | str] = {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / self.prompt_n if self.prompt_n else 0.0,
            "prompt_per_second": self.prompt_per_second,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": (
                self.predicted_ms / self.predicted_n if self.predicted_n else 0.0
            ),
            "predicted_per_second": self.predicted_per_second,
        }
        if self.draft_rounds > 0:
            out["draft_n"] = self.draft_n
            out["draft_n_accepted"] = self.draft_n_accepted
            out["draft_rounds"] = self.draft_rounds
            out["draft_kind"] = self.draft_kind or "unknown"
        return out


@dataclass(frozen=True)
class PromptProgress:
    """How far a request's prompt processing is (llama-server's `prompt_progress`): prompt
    tokens in all, served by the prompt cache, processed so far (the cached ones included)
    and milliseconds since the request was admitted."""

    total: int
    cache: int
    processed: int
    time_ms: float

    def to_dict(self) -> dict[str, int | float]:
        return {
            "total": self.total,
            "cache": self.cache,
            "processed": self.processed,
            "time_ms": self.time_ms,
        }


@dataclass
class GenerationEvent:
    """A step of a request's output: new text, and on the last event the finish."""

    request_id: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: Timings | None = None
    error: str | None = None
    slot: int = -1
    stop_word: str | None = None  # the stop string that ended generation, if any
    progress: PromptProgress | None = None  # a prefill progress event (no output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
