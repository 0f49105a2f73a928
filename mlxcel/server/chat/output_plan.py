"""How one chat answer's output is split: tool-call format, tools and reasoning markup."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxcel.engine.chat.reasoning import ReasoningConfig, detect_reasoning, prompt_opens_reasoning
from mlxcel.engine.chat.tool_calls import detect_format, get_format
from mlxcel.engine.chat.tool_calls.base import (
    ContentDelta,
    OutputEvent,
    ParseResult,
    ReasoningDelta,
    ToolCallFormat,
)
from mlxcel.engine.chat.tool_calls.output import ChatOutputStream, parse_chat_output

if TYPE_CHECKING:
    from mlxcel.server.state import ServerState

HARMONY = "harmony"


@functools.lru_cache(maxsize=8)
def _template_format(template: str | None) -> str | None:
    return detect_format(template)


@functools.lru_cache(maxsize=8)
def _template_reasoning(template: str | None) -> ReasoningConfig | None:
    return detect_reasoning(template)


def _template(state: ServerState) -> str | None:
    return state.tokenizer.chat_template if state.tokenizer is not None else None


def format_name(state: ServerState) -> str | None:
    """The loaded chat template's tool-call format (None: the template has no tools)."""
    return _template_format(_template(state))


def model_reasoning(
    state: ServerState, reasoning_format: str | None = None
) -> ReasoningConfig | None:
    """The template's reasoning markup, unless the reasoning format is `none`."""
    if (reasoning_format or state.settings.reasoning_format) == "none":
        return None
    return _template_reasoning(_template(state))


@dataclass(frozen=True)
class OutputPlan:
    """Per request: the parsers its output goes through (both None: plain content)."""

    tool_format: ToolCallFormat | None = None
    tools: list[dict[str, Any]] | None = None
    reasoning: ReasoningConfig | None = None
    start_in_reasoning: bool = False
    reasoning_in_content: bool = False  # deepseek-legacy: think text stays in content too

    @property
    def active(self) -> bool:
        """True when the output is parsed, so special tokens must be decoded too."""
        return self.tool_format is not None or self.reasoning is not None

    def stream(self, request_id: str) -> ChatOutputStream:
        """A streaming splitter for one choice.

        With `reasoning_in_content` (deepseek-legacy), reasoning streams as content between
        its tags instead of as `reasoning_content`.
        """
        cls = LegacyReasoningStream if self.reasoning_in_content else ChatOutputStream
        return cls(
            tool_format=self.tool_format,
            tools=self.tools,
            reasoning=self.reasoning,
            start_in_reasoning=self.start_in_reasoning,
            request_id=request_id,
        )

    def parse(self, text: str) -> ParseResult:
        """The whole output, split."""
        return parse_chat_output(
            text,
            tool_format=self.tool_format,
            tools=self.tools,
            reasoning=self.reasoning,
            start_in_reasoning=self.start_in_reasoning,
        )

    def shown(self, result: ParseResult) -> ParseResult:
        """`result` as a client sees it: with deepseek-legacy, the reasoning stays in the
        content between its tags (and there is no separate reasoning)."""
        block = self.legacy_block(result)
        return result if block is None else ParseResult(block + result.content, result.calls, None)

    def legacy_block(self, result: ParseResult) -> str | None:
        """deepseek-legacy: the reasoning of `result` between its tags, to lead the content
        (None otherwise)."""
        if not (self.reasoning_in_content and result.reasoning and self.reasoning is not None):
            return None
        return f"{self.reasoning.open_tag}{result.reasoning}{self.reasoning.close_tag}"


class LegacyReasoningStream(ChatOutputStream):
    """deepseek-legacy streaming: reasoning deltas become content wrapped in its tags."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        config = kwargs.get("reasoning") or ReasoningConfig()
        self._open, self._close = config.open_tag, config.close_tag
        self._in_reasoning = False

    def _legacy(self, events: list[OutputEvent]) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                text = event.text
                if not self._in_reasoning:
                    text, self._in_reasoning = self._open + text, True
                out.append(ContentDelta(text))
                continue
            if self._in_reasoning:
                self._in_reasoning = False
                out.append(ContentDelta(self._close))
            out.append(event)
        return out

    def feed(self, text: str) -> list[OutputEvent]:
        return self._legacy(super().feed(text))

    def finish(self) -> list[OutputEvent]:
        events = self._legacy(super().finish())
        if self._in_reasoning:
            self._in_reasoning = False
            events.append(ContentDelta(self._close))
        return events

    @property
    def reasoning_only(self) -> bool:
        return False


def plan_output(
    state: ServerState,
    tools: list[dict[str, Any]] | None,
    prompt_text: str,
    reasoning_format: str | None = None,
) -> OutputPlan:
    """The plan for a request whose rendered prompt is `prompt_text` with `tools` rendered.

    Tool calls are parsed only when tools were rendered, except for Harmony, whose channels
    always need its own parser.
    """
    name = format_name(state)
    fmt = get_format(name) if name is not None and (tools or name == HARMONY) else None
    reasoning = model_reasoning(state, reasoning_format)
    legacy = (reasoning_format or state.settings.reasoning_format) == "deepseek-legacy"
    return OutputPlan(
        tool_format=fmt,
        tools=tools,
        reasoning=reasoning,
        start_in_reasoning=prompt_opens_reasoning(prompt_text, reasoning),
        reasoning_in_content=legacy and reasoning is not None and not reasoning.harmony,
    )
