"""llama-server's native request bodies and the settings objects its answers carry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from mlxcel.engine.sampling.params import SAMPLING_KNOBS
from mlxcel.server.errors import bad_request
from mlxcel.server.sampling_fields import MAX_TOP_LOGPROBS, SamplingFields, token_id_key
from mlxcel.server.token_limit import TokenLimitFields

if TYPE_CHECKING:
    from mlxcel.config import Settings
    from mlxcel.engine.sampling.params import SamplingParams
    from mlxcel.engine.tokenizer import Tokenizer

UNSET_SEED = 18446744073709551615
"""llama-server's `seed` when none is set (u64::MAX): a fresh random seed per request."""

MAX_PROMPTS = 64
"""Most prompts one native request may carry (each becomes its own sequence)."""

SAMPLERS = (
    "penalties",
    "dry",
    "top_n_sigma",
    "top_k",
    "typ_p",
    "top_p",
    "min_p",
    "xtc",
    "temperature",
)
"""The sampler chain as `generation_settings.samplers` reports it: llama-server's default
order, which mlxcel's chain follows."""

PromptPart = str | int
"""One element of a native prompt: text, or a token id."""

PROMPT_STRING_KEY = "prompt_string"
MULTIMODAL_KEY = "multimodal_data"
"""The keys of llama-server's JSON-object prompt (`{"prompt_string": ..., ...}`)."""


class NativeCompletionRequest(SamplingFields, TokenLimitFields):
    """POST /completion (and /completions): llama-server's native completion body."""

    model: str | None = None
    prompt: Any = ""
    stream: bool = False
    n_probs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    # With `n_probs`: probabilities (`prob`, `top_probs`) of the distribution the token was
    # drawn from, after the whole sampler chain, instead of the model's log-probabilities.
    # A JSON boolean (null: unset), as llama-server checks it.
    post_sampling_probs: StrictBool | None = None
    # Where llama.cpp samples (its GPU backend or the CPU): no meaning here, accepted.
    backend_sampling: StrictBool | None = None
    return_tokens: bool = False
    response_format: dict[str, Any] | None = None
    # Thinking-budget aliases: accepted (a raw completion has no reasoning channel to cap).
    thinking_budget_tokens: int | None = Field(None, ge=-1)
    reasoning_budget: int | None = Field(None, ge=-1)
    thinking_budget: int | None = Field(None, ge=-1)
    response_fields: list[str] | None = None
    # llama-server's `logit_bias` forms (pairs, text keys, `false`), resolved with the
    # tokenizer into the shared id-keyed `logit_bias` by `resolve_logit_bias`.
    native_logit_bias: Any = Field(None, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _take_logit_bias(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("logit_bias") is not None:
            data = dict(data)
            data["native_logit_bias"] = data.pop("logit_bias")
        return data

    def resolve_logit_bias(self, tokenizer: Tokenizer) -> None:
        """Turn `native_logit_bias` into the shared `logit_bias` (token id -> bias)."""
        if self.native_logit_bias is not None:
            self.logit_bias = native_logit_bias(self.native_logit_bias, tokenizer)

    def token_limit(self) -> int | None:
        """`n_predict`, else `max_tokens` (None: the server's `--predict`)."""
        return self.llama_limit(self.max_tokens)


class InfillRequest(NativeCompletionRequest):
    """POST /infill: fill in the middle between `input_prefix` and `input_suffix`."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[dict[str, Any]] = Field(default_factory=list)


class TokenizeRequest(BaseModel):
    """POST /tokenize."""

    model_config = ConfigDict(extra="allow")

    content: str
    add_special: bool = False
    parse_special: bool = True  # False: special-token text is tokenized as plain text
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize; ids are JSON integers (arbitrary precision, checked later; `true` or
    `"5"` is refused, as llama-server refuses them)."""

    model_config = ConfigDict(extra="allow")

    tokens: list[StrictInt] = Field(default_factory=list)


def split_prompts(value: Any) -> list[list[PromptPart]]:
    """The prompts of a native `prompt` field, each a list of text and token-id parts.

    A string, a list of token ids, or a list mixing ids and strings is one prompt; a list
    of strings, or a list whose items are strings or lists, is several prompts.
    """

    def is_id(item: Any) -> bool:
        return isinstance(item, int) and not isinstance(item, bool)

    def one(item: Any) -> list[PromptPart]:
        if isinstance(item, str):
            return [item]
        if isinstance(item, dict):
            return object_prompt(item)
        if isinstance(item, list) and all(is_id(x) or isinstance(x, str) for x in item):
            return list(item)
        raise bad_request(
            "prompt must be a string, a list of token ids (optionally mixed with strings) "
            "or a list of such prompts"
        )

    if isinstance(value, str):
        return [[value]]
    if isinstance(value, dict):
        return [object_prompt(value)]
    if not isinstance(value, list) or not value:
        raise bad_request("prompt must be a non-empty string or list")
    if any(is_id(x) for x in value) and all(is_id(x) or isinstance(x, str) for x in value):
        return [list(value)]
    prompts = [one(item) for item in value]
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"prompt: at most {MAX_PROMPTS} prompts per request")
    return prompts


def object_prompt(item: dict[str, Any]) -> list[PromptPart]:
    """A JSON-object prompt: its `prompt_string` (media data: 400, the model is text only)."""
    text = item.get(PROMPT_STRING_KEY)
    if not isinstance(text, str):
        raise bad_request(f"a prompt object needs a string '{PROMPT_STRING_KEY}'")
    if item.get(MULTIMODAL_KEY):
        raise bad_request(f"{MULTIMODAL_KEY}: this model takes text only")
    return [text]


def _bias_value(value: Any) -> float:
    if value is False:
        return float("-inf")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request("logit_bias: a bias must be a number, or false to ban the token")
    return float(value)


def native_logit_bias(value: Any, tokenizer: Tokenizer) -> dict[str, float]:
    """llama-server's `logit_bias` as token id (text) -> bias.

    Pairs `[[id or text, bias], ...]` or an object `{"id or text": bias}`; a text key biases
    every token it encodes to; `false` bans the token. Later entries win.
    """
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        items = [(p[0], p[1]) for p in value]
    else:
        raise bad_request("logit_bias must be a list of [token, bias] pairs or an object")
    out: dict[str, float] = {}
    for key, raw in items:
        bias = _bias_value(raw)
        if isinstance(key, int) and not isinstance(key, bool):
            ids = [key]
        elif isinstance(key, str) and (token := token_id_key(key)) is not None:
            ids = [token]
        elif isinstance(key, str):
            ids = tokenizer.encode(key, add_special=False)
        else:
            raise bad_request("logit_bias: a token must be an id or a string")
        for token in ids:
            out[str(token)] = bias
    return out


def project_fields(result: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """llama-server's `response_fields`: only `paths` (`a/b` reads a nested value, kept
    under the key `a/b`); missing ones are left out."""
    out: dict[str, Any] = {}
    for path in paths:
        node: Any = result
        for part in path.split("/"):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            out[path] = node
    return out


def seed_value(seed: int | None) -> int:
    """A seed as llama-server reports it (u64::MAX when unset)."""
    return UNSET_SEED if seed is None or seed < 0 else seed


def sampling_params_view(
    sampling: SamplingParams,
    *,
    n_predict: int,
    stream: bool = False,
    n_probs: int = 0,
    ignore_eos: bool = False,
    post_sampling_probs: bool = False,
) -> dict[str, Any]:
    """The llama-server `params` object (as in `/props` and `/slots`) for `sampling`."""
    return {
        "seed": seed_value(sampling.seed),
        "temperature": sampling.temperature,
        "dynatemp_range": sampling.dynatemp_range,
        "dynatemp_exponent": sampling.dynatemp_exponent,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "min_p": sampling.min_p,
        "top_n_sigma": sampling.top_n_sigma,
        "xtc_probability": sampling.xtc_probability,
        "xtc_threshold": sampling.xtc_threshold,
        "typical_p": sampling.typical_p,
        "repeat_last_n": sampling.repetition_context_size,
        "repeat_penalty": sampling.repetition_penalty,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "dry_multiplier": sampling.dry_multiplier,
        "dry_base": sampling.dry_base,
        "dry_allowed_length": sampling.dry_allowed_length,
        "dry_penalty_last_n": sampling.dry_penalty_last_n,
        "p_less": sampling.p_less,
        "mirostat": sampling.mirostat,
        "mirostat_tau": sampling.mirostat_tau,
        "mirostat_eta": sampling.mirostat_eta,
        "adaptive_target": sampling.adaptive_target,
        "adaptive_decay": sampling.adaptive_decay,
        "max_tokens": n_predict,
        "n_predict": n_predict,
        "n_keep": 0,
        "n_discard": 0,
        "ignore_eos": ignore_eos,
        "stream": stream,
        "n_probs": n_probs,
        "min_keep": 0,
        "chat_format": "Content-only",
        "reasoning_format": "none",
        "reasoning_in_content": False,
        "generation_prompt": "",
        "samplers": list(SAMPLERS),
        "speculative.types": "none",
        "timings_per_token": False,
        "post_sampling_probs": post_sampling_probs,
        "backend_sampling": False,
        "lora": [],
    }


def generation_settings(
    sampling: SamplingParams,
    *,
    settings: Settings,
    n_predict: int,
    stream: bool,
    n_probs: int,
    stop: tuple[str, ...],
    ignore_eos: bool,
    eog_tokens: frozenset[int] = frozenset(),
    post_sampling_probs: bool = False,
) -> dict[str, Any]:
    """The `generation_settings` object of a native completion answer.

    `logit_bias` is llama-server's list of `{"bias", "token"}`, a banned token's bias `null`
    (-inf; JSON has no infinity); with `ignore_eos` the end-of-generation tokens are listed
    as banned, as llama-server adds them."""
    biases = dict(sampling.logit_bias)
    if ignore_eos:
        biases.update({token: float("-inf") for token in sorted(eog_tokens)})
    out = sampling_params_view(
        sampling,
        n_predict=n_predict,
        stream=stream,
        n_probs=n_probs,
        ignore_eos=ignore_eos,
        post_sampling_probs=post_sampling_probs,
    )
    out.update(
        {
            "dry_sequence_breakers": list(settings.dry_sequence_breaker),
            "stop": list(stop),
            "logit_bias": [
                {"bias": None if bias == float("-inf") else bias, "token": token}
                for token, bias in biases.items()
            ],
            "grammar": "",
            "grammar_lazy": False,
            "grammar_triggers": [],
            "preserved_tokens": [],
        }
    )
    return out


def default_settings_flat(sampling: SamplingParams, n_predict: int) -> dict[str, Any]:
    """The spec's flat `default_generation_settings` fields (besides llama-server's): the
    knobs of `SAMPLING_KNOBS` that `/props` shows, under their llama-server names."""
    out: dict[str, Any] = {"n_predict": n_predict}
    for knob in SAMPLING_KNOBS:
        if knob.props is not None:
            value = getattr(sampling, knob.params[0])
            out[knob.props] = seed_value(value) if knob.negative_unset else value
    return out
