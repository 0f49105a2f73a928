"""Reasoning split: `<think>...</think>` (and its relatives) or Harmony's analysis channel.

`ReasoningFilter` is fed generated text as it comes and emits `ReasoningDelta` (for
`reasoning_content`) and `ContentDelta`; like the tool-call filters it holds text that may be
the start of a tag until that is decided, so the result never depends on how the text was
split, and `split_reasoning` on the whole text gives the same answer.

Rules for tag pairs:

* a block opens only at the start of the output (after whitespace); with
  `start_in_reasoning` (the generation prompt already opened it, e.g. it ends with
  `<think>\\n`) the output starts inside the block, and a repeated open tag is skipped;
* reasoning is trimmed of surrounding whitespace, and so is the start of the content after
  the close tag; a block that never closes is all reasoning;
* output that does not start with the open tag is content, untouched.

Harmony output is split by `harmony.HarmonyFilter`, which also yields tool calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel.engine.chat.tool_calls.base import (
    ContentDelta,
    Delta,
    ReasoningDelta,
    StreamFilter,
    collect,
    partial_suffix_len,
    trailing_space_len,
)
from mlxcel.engine.chat.tool_calls.harmony import HarmonyFilter


@dataclass(frozen=True)
class ReasoningConfig:
    """How a model marks its reasoning: a tag pair, or Harmony channels."""

    open_tag: str = "<think>"
    close_tag: str = "</think>"
    harmony: bool = False


THINK = ReasoningConfig()
HARMONY = ReasoningConfig(open_tag="", close_tag="", harmony=True)

# Tag pairs in templates, most specific first.
_TAG_PAIRS: tuple[tuple[str, str], ...] = (
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<seed:think>", "</seed:think>"),
    ("<think>", "</think>"),
)


def detect_reasoning(chat_template_source: str | None) -> ReasoningConfig | None:
    """The reasoning markup a chat template uses, or None if it shows none."""
    source = chat_template_source or ""
    if "<|channel|>" in source and "<|message|>" in source:
        return HARMONY
    for open_tag, close_tag in _TAG_PAIRS:
        if open_tag in source and close_tag in source:
            return ReasoningConfig(open_tag, close_tag)
    return None


def prompt_opens_reasoning(prompt: str, config: ReasoningConfig | None) -> bool:
    """True if the rendered prompt ends inside an open reasoning block (so the output
    starts with reasoning and only its close tag will appear)."""
    if config is None or config.harmony or not config.open_tag:
        return False
    return prompt.rstrip().endswith(config.open_tag)


class ThinkFilter:
    """`StreamFilter` splitting one tag-delimited reasoning block off the output."""

    def __init__(self, config: ReasoningConfig = THINK, *, start_in_reasoning: bool = False):
        self._open = config.open_tag
        self._close = config.close_tag
        self._state = "first" if start_in_reasoning else "start"
        self._buf = ""
        self._out: list[Delta] = []
        self._finished = False
        self._started_reasoning = False

    def feed(self, text: str) -> list[Delta]:
        if text and not self._finished:
            self._buf += text
            self._run(False)
        return self._take()

    def finish(self) -> list[Delta]:
        if not self._finished:
            self._finished = True
            self._run(True)
        return self._take()

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    def _run(self, final: bool) -> None:
        while True:
            state = self._state
            if state in ("start", "first"):
                stripped = self._buf.lstrip()
                if not stripped:
                    if final:
                        if state == "start":
                            self._content(self._buf)
                        self._buf = ""
                    return
                if stripped.startswith(self._open):
                    self._buf = stripped[len(self._open) :]
                    self._state = "reasoning"
                    continue
                if not final and self._open.startswith(stripped):
                    return
                self._state = "content" if state == "start" else "reasoning"
                if self._state == "reasoning":
                    self._buf = stripped
                continue
            if state == "reasoning":
                if not self._reason(final):
                    return
                continue
            if state == "after":
                stripped = self._buf.lstrip()
                self._buf = stripped
                if not stripped:
                    return
                self._state = "content"
                continue
            self._content(self._buf)
            self._buf = ""
            return

    def _reason(self, final: bool) -> bool:
        buf = self._buf
        at = buf.find(self._close)
        if at >= 0:
            self._reasoning(buf[:at].rstrip())
            self._buf = buf[at + len(self._close) :]
            self._state = "after"
            return True
        if final:
            self._reasoning(buf.rstrip())
            self._buf = ""
            return False
        keep = partial_suffix_len(buf, (self._close,))
        keep += trailing_space_len(buf, len(buf) - keep)
        self._reasoning(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        return False

    def _reasoning(self, text: str) -> None:
        if not self._started_reasoning:
            text = text.lstrip()
        if text:
            self._started_reasoning = True
            self._out.append(ReasoningDelta(text))

    def _content(self, text: str) -> None:
        if text:
            self._out.append(ContentDelta(text))


def reasoning_filter(
    config: ReasoningConfig | None, *, start_in_reasoning: bool = False
) -> StreamFilter | None:
    """The filter for `config` (None when there is no reasoning markup)."""
    if config is None:
        return None
    if config.harmony:
        return HarmonyFilter()
    return ThinkFilter(config, start_in_reasoning=start_in_reasoning)


def split_reasoning(
    text: str, config: ReasoningConfig | None = THINK, *, start_in_reasoning: bool = False
) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output; what the filter streams, collected.

    For Harmony, content excludes call messages (use the harmony format to get them).
    """
    stream = reasoning_filter(config, start_in_reasoning=start_in_reasoning)
    if stream is None:
        return None, text
    result = collect([*stream.feed(text), *stream.finish()])
    return result.reasoning, result.content
