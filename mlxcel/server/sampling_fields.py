"""Request sampling fields shared by the generation routes, and their engine request.

`SamplingFields` is the pydantic base of the OpenAI request bodies: every sampling knob of
the spec (OpenAI names, with llama-server's spellings accepted as aliases), stop strings,
token limits, `n`, `cache_prompt`, `id_slot`, loop detection and logit bias. Fields may also
sit in a nested `extra_body` object (clients that forward OpenAI SDK `extra_body` literally); the
root value wins. `to_generation_request` turns one into a `GenerationRequest` with the
server's defaults filled in.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    create_model,
    model_validator,
)

from mlxcel.engine.defaults import loop_params, sampling_from_settings
from mlxcel.engine.sampling.params import SAMPLING_KNOBS, SamplingKnob, knob_overrides
from mlxcel.engine.text.request import GenerationRequest, Priority
from mlxcel.server.errors import bad_request

if TYPE_CHECKING:
    from mlxcel.config import Settings
    from mlxcel.engine.tokenizer import Tokenizer

MAX_STOP_STRINGS = 64
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
MAX_CHOICES = 16
"""The most choices (`n`) one chat or text completion request may ask for."""
PRIORITY_HEADER = "x-priority"


def _knob_field(knob: SamplingKnob) -> Any:
    aliases = AliasChoices(*knob.request) if len(knob.request) > 1 else None
    return (knob.kind | None, Field(None, validation_alias=aliases))


_CONFIG = ConfigDict(extra="allow", populate_by_name=True)

if TYPE_CHECKING:
    _KnobFields = BaseModel
else:
    # One optional field per sampling knob of the table (its aliases accepted).
    _KnobFields = create_model(
        "_KnobFields", __config__=_CONFIG, **{k.name: _knob_field(k) for k in SAMPLING_KNOBS}
    )


class SamplingFields(_KnobFields):
    """Sampling and stopping fields every generation request body accepts: the knobs of
    `SAMPLING_KNOBS` (one optional field each) and the fields below."""

    model_config = _CONFIG

    max_tokens: int | None = Field(None, ge=-1)
    dry_sequence_breakers: list[int | str] | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    cache_prompt: bool | None = None
    id_slot: int | None = None  # llama-server's: the slot to run in (-1: any)
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    max_pattern_size: int | None = None
    min_pattern_size: int | None = None
    min_count: int | None = None
    timings_per_token: bool | None = None
    return_progress: bool | None = None
    extra_body: dict[str, Any] | None = None
    _sent_names: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _note_sent_names(
        cls, data: Any, handler: ModelWrapValidatorHandler[SamplingFields]
    ) -> SamplingFields:
        """Remember which spelling of each aliased knob the client sent (`sent_name`)."""
        fields = handler(data)
        if isinstance(data, dict):
            nested = data.get("extra_body")
            given = {**nested, **data} if isinstance(nested, dict) else data
            for knob in SAMPLING_KNOBS:  # pydantic takes the first alias present
                sent = next((name for name in knob.request if name in given), None)
                if sent is not None:
                    fields._sent_names[knob.name] = sent
        return fields

    @model_validator(mode="before")
    @classmethod
    def _lift_extra_body(cls, data: Any) -> Any:
        """Fields found in a nested `extra_body` object count unless the root sets them."""
        if not isinstance(data, dict):
            return data
        nested = data.get("extra_body")
        if not isinstance(nested, dict):
            return data
        known = set(SamplingFields.model_fields) - {"extra_body"}
        for info in SamplingFields.model_fields.values():
            if isinstance(info.validation_alias, AliasChoices):
                known.update(str(choice) for choice in info.validation_alias.choices)
        lifted = {k: v for k, v in nested.items() if k in known and k not in data}
        return {**lifted, **data} if lifted else data

    # ------------------------------------------------------------------ helpers

    def sent_name(self, knob: SamplingKnob) -> str:
        """The field name the client set `knob` with (llama-server's `repeat_last_n` or the
        OpenAI-side `repetition_context_size`, ...), for error messages."""
        return self._sent_names.get(knob.name, knob.name)

    def check_knobs(self) -> None:
        """A 400 naming the field as the client sent it for the first knob of the wrong
        type or out of range (the engine's own check names its parameters)."""
        for knob in SAMPLING_KNOBS:
            value = knob.value(getattr(self, knob.name))
            if value is not None:
                try:
                    knob.check(self.sent_name(knob), value)
                except ValueError as exc:
                    raise bad_request(str(exc)) from None

    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple of non-empty strings (a string or a list of them)."""
        if self.stop is None:
            return ()
        items = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(items) > MAX_STOP_STRINGS:
            raise bad_request(f"stop: at most {MAX_STOP_STRINGS} stop strings are allowed")
        return tuple(dict.fromkeys(s for s in items if s))

    def check_n(self, most: int = 1) -> int:
        """How many choices the request asks for (`n`, default 1); 400 outside 1..`most`
        (routes that run one sequence only pass 1)."""
        n = 1 if self.n is None else self.n
        if most <= 1 and n != 1:
            raise bad_request(f"n: only n=1 is supported on this route, not {n}")
        if not 1 <= n <= most:
            raise bad_request(f"n: must be between 1 and {most}, not {n}")
        return n

    def stream_reports(self, request: GenerationRequest, *, stream: bool) -> None:
        """llama-server's `timings_per_token` (each chunk carries the timings so far) and
        `return_progress` (prefill progress chunks before the first token): for streamed
        answers only, as llama-server sends them."""
        request.timings_per_token = stream and bool(self.timings_per_token)
        request.progress = stream and bool(self.return_progress)

    def wants_verbose(self, server_verbose: bool) -> bool:
        """llama-server's `verbose` field (a `__verbose` debug object in the answer); its
        default is the server's `--verbose`."""
        value = (self.model_extra or {}).get("verbose")
        if value is None:
            return server_verbose
        if not isinstance(value, bool):
            raise bad_request("verbose: must be a boolean")
        return value

    def gbnf_grammar(self) -> str | None:
        """llama-server's GBNF `grammar` field (None when absent or empty); a non-string is
        a 400."""
        grammar = (self.model_extra or {}).get("grammar")
        if grammar is None or grammar == "":
            return None
        if not isinstance(grammar, str):
            raise bad_request("grammar: must be a string holding a GBNF grammar")
        return grammar

    def llama_json_schema(self) -> Any:
        """llama-server's top-level `json_schema` field (None when absent or empty)."""
        schema = (self.model_extra or {}).get("json_schema")
        return None if schema is None or schema == {} else schema

    def with_json_schema(self, response_format: dict[str, Any] | None) -> dict[str, Any] | None:
        """`response_format`, or llama-server's `json_schema` field as the equivalent
        `json_schema` response format when `response_format` asks for plain text."""
        schema = self.llama_json_schema()
        if schema is None:
            return response_format
        if response_format is not None and response_format.get("type", "text") != "text":
            raise bad_request("send either response_format or json_schema, not both")
        return {"type": "json_schema", "json_schema": {"schema": schema}}


def parse_priority(value: str | None) -> Priority:
    """The `X-Priority` header as a Priority (400 for anything but high|normal|low)."""
    try:
        return Priority.parse(value)
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def resolve_cache_prompt(settings: Settings, requested: bool | None) -> bool:
    """A request may turn the prompt cache off, never back on (`--no-cache-prompt` wins)."""
    return bool(settings.cache_prompt) and requested is not False


def _breaker_ids(tokenizer: Tokenizer, breakers: list[int | str]) -> tuple[int, ...]:
    ids: set[int] = set()
    for item in breakers:
        if isinstance(item, int):
            ids.add(item)
        else:
            ids.update(tokenizer.encode(item, add_special=False))
    return tuple(sorted(ids))


_TOKEN_ID_KEY = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+")


def token_id_key(key: str) -> int | None:
    """A `logit_bias` key as a token id, read as llama-server reads it (`strtol` to the key's
    end: leading whitespace, a sign, ASCII digits); None for anything else. Python's `int`
    also took `1_000` and other scripts' digits (`٣`), and `str.isdigit` lets `²` through to
    an `int` that raises."""
    return int(key) if _TOKEN_ID_KEY.fullmatch(key) else None


def _logit_bias(tokenizer: Tokenizer, bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias: at most {MAX_LOGIT_BIAS} entries are allowed")
    out: list[tuple[int, float]] = []
    for key, value in bias.items():
        token = token_id_key(key)
        if token is None:
            raise bad_request(f"logit_bias: keys must be token ids, not {key!r}")
        if not tokenizer.is_valid_id(token):
            raise bad_request(f"logit_bias: token id {token} is out of vocabulary range")
        # OpenAI's range is [-100, 100]; -100 bans the token outright.
        out.append((token, float("-inf") if value <= -100 else min(float(value), 100.0)))
    return tuple(out)


def to_generation_request(
    fields: SamplingFields,
    *,
    settings: Settings,
    tokenizer: Tokenizer,
    family: str | None,
    prompt_tokens: list[int],
    max_tokens: int | None,
    priority: Priority,
    logprobs: int | None = None,
) -> GenerationRequest:
    """Build the engine request: request fields over the server's defaults.

    `max_tokens` is the request's limit (None or -1: the server's `--predict`, and when
    that is -1 too, up to the slot's context; the engine bounds it by the context anyway).
    Out-of-range values raise a 400 APIError. `n` is the route's to check (`check_n`): it
    runs the choices itself, see `per_choice`.
    """
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
    if max_tokens is None or max_tokens == -1:
        max_tokens = None if settings.n_predict < 0 else settings.n_predict
    fields.check_knobs()
    overrides = knob_overrides({k.name: getattr(fields, k.name) for k in SAMPLING_KNOBS})
    if fields.dry_sequence_breakers is not None:
        overrides["dry_sequence_breakers"] = _breaker_ids(tokenizer, fields.dry_sequence_breakers)
    if fields.logit_bias:
        overrides["logit_bias"] = _logit_bias(tokenizer, fields.logit_bias)
    try:
        sampling = sampling_from_settings(settings, tokenizer, **overrides)
        loop = loop_params(
            settings,
            family,
            max_pattern_size=fields.max_pattern_size,
            min_pattern_size=fields.min_pattern_size,
            min_count=fields.min_count,
        )
    except (TypeError, ValueError) as exc:
        raise bad_request(
            str(exc).splitlines()[0] if str(exc) else "invalid sampling value"
        ) from None
    ignore_eos = settings.ignore_eos if fields.ignore_eos is None else fields.ignore_eos
    return GenerationRequest(
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=fields.stop_strings(),
        loop=loop,
        ignore_eos=bool(ignore_eos),
        cache_prompt=resolve_cache_prompt(settings, fields.cache_prompt),
        priority=priority,
        id_slot=-1 if fields.id_slot is None else fields.id_slot,
        logprobs=logprobs,
    )


def per_choice(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """`n` engine requests for `n` choices of one prompt: copies of `request`, each with
    its own id; with a fixed seed, choice i samples with seed + i (distinct yet
    reproducible), else each draws its own random seed."""
    if n <= 1:
        return [request]
    seed = request.sampling.seed
    out = [request]
    for i in range(1, n):
        sampling = request.sampling
        if seed is not None and seed >= 0:
            sampling = replace(sampling, seed=seed + i)
        out.append(replace(request, sampling=sampling, request_id=f"{request.request_id}.{i}"))
    return out


__all__ = [
    "MAX_CHOICES",
    "MAX_TOP_LOGPROBS",
    "PRIORITY_HEADER",
    "SamplingFields",
    "parse_priority",
    "per_choice",
    "resolve_cache_prompt",
    "to_generation_request",
    "token_id_key",
]
