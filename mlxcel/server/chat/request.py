"""`ChatRequest`: a chat request of any API family, as the chat core runs it.

Each family translates its own body into one (its messages as `ChatTurn`s, each naming
where the client sent it, so errors use the client's field names). `ChatOptions` holds
the sampling knobs and chat switches a body may carry, validated under the names the
client used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from mlxcel.server.errors import bad_request
from mlxcel.server.sampling_fields import MAX_TOP_LOGPROBS, SamplingFields
from mlxcel.server.token_limit import TokenLimitFields

THINKING_BUDGET_FIELDS = ("thinking_budget_tokens", "thinking_token_budget", "thinking_budget")
"""Per-request aliases of `--reasoning-budget`, first match wins."""

REASONING_FORMATS = ("auto", "none", "deepseek", "deepseek-legacy")
"""llama-server's `reasoning_format` values."""

RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "pad_token",
        "unk_token",
        "raise_exception",
        "strftime_now",
    }
)
"""chat_template_kwargs keys that would override what the server renders (400)."""


class ChatOptions(SamplingFields, TokenLimitFields):
    """Sampling knobs and chat switches of a chat body (unknown fields allowed)."""

    max_completion_tokens: int | None = Field(None, ge=-1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    # llama-server / vLLM rendering switches: no generation prompt, or continue the final
    # assistant message.
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False

    def token_limit(self) -> int | None:
        """llama-server's `n_predict`, else `max_completion_tokens`, else `max_tokens` (None:
        the server default)."""
        if self.max_completion_tokens is not None:
            return self.llama_limit(self.max_completion_tokens)
        return self.llama_limit(self.max_tokens)

    def logprobs_count(self) -> int | None:
        """Alternatives per token for the engine (None: logprobs off)."""
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def thinking_budget(self) -> int | None:
        """The request's thinking budget alias (-1: unlimited), None when it sets none."""
        for source in (self.model_extra or {}, self.extra_body or {}):
            for name in THINKING_BUDGET_FIELDS:
                value = source.get(name)
                if value is None:
                    continue
                if type(value) is not int or value < -1:
                    raise bad_request(f"'{name}' must be an integer >= -1 (-1: no limit, 0: off)")
                return value
        return None

    def template_kwargs(self) -> dict[str, Any]:
        """The request's chat template kwargs, from the first form present:
        `chat_template_kwargs`, `extra_body.chat_template_kwargs`,
        `extra_body.preserve_thinking`, then a top-level `preserve_thinking`; keys the
        server renders itself (`messages`, `tools`, special tokens...) are a 400."""
        nested = self.extra_body or {}
        extra = self.model_extra or {}
        requested: dict[str, Any] = {}
        if self.chat_template_kwargs is not None:
            requested = dict(self.chat_template_kwargs)
        elif isinstance(nested.get("chat_template_kwargs"), dict):
            requested = dict(nested["chat_template_kwargs"])
        elif isinstance(nested.get("preserve_thinking"), bool):
            requested = {"preserve_thinking": nested["preserve_thinking"]}
        elif isinstance(extra.get("preserve_thinking"), bool):
            requested = {"preserve_thinking": extra["preserve_thinking"]}
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(requested))
        if reserved:
            raise bad_request(
                f"chat_template_kwargs cannot set {', '.join(reserved)}: the server renders it"
            )
        return requested

    def reasoning_format(self) -> str | None:
        """llama-server's per-request `reasoning_format` (None: the server's)."""
        value = (self.model_extra or {}).get("reasoning_format")
        if value is None:
            return None
        if value not in REASONING_FORMATS:
            raise bad_request(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}")
        return str(value)


@dataclass(frozen=True)
class ChatTurn:
    """One message as the chat template gets it (`role`, `content`, and `name`,
    `tool_calls`, `tool_call_id`, `reasoning_content`... when present), and where the
    client sent it (`where`: `messages[2]`, `input[0]`, `instructions`...)."""

    message: dict[str, Any]
    where: str

    @property
    def role(self) -> str:
        """The message's role."""
        return str(self.message["role"])


@dataclass(frozen=True)
class ChatRequest:
    """A chat request of any family: what to render, constrain and sample.

    `continue_assistant`: a trailing assistant turn (text, no tool calls) is a prefill the
    model continues (llama-server's chat route); False: it is history and the model starts
    a new turn (Responses, Messages). `thinking_budget` and `template_kwargs` are the
    request's own (the server's fill the gaps when rendering).
    """

    turns: list[ChatTurn]
    options: ChatOptions
    max_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    thinking_budget: int | None = None
    reasoning_format: str | None = None
    continue_assistant: bool = False

    @classmethod
    def build(
        cls,
        turns: list[ChatTurn],
        options: ChatOptions,
        *,
        max_tokens: int | None = None,
        thinking_budget: int | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        response_format: dict[str, Any] | None = None,
        continue_assistant: bool = False,
    ) -> ChatRequest:
        """The request of a family's translated `turns` and `options`: the token limit,
        thinking budget (unless the family gives them), template kwargs and reasoning
        format are read from `options` here, once; 400 on bad values."""
        return cls(
            turns=turns,
            options=options,
            max_tokens=max_tokens if max_tokens is not None else options.token_limit(),
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            response_format=response_format,
            template_kwargs=options.template_kwargs(),
            thinking_budget=(
                thinking_budget if thinking_budget is not None else options.thinking_budget()
            ),
            reasoning_format=options.reasoning_format(),
            continue_assistant=continue_assistant,
        )

    @property
    def forced_tool_choice(self) -> bool:
        """`required` or a named function: choices that need their own grammar."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)
