"""`RenderedPrompt`: a chat request rendered by the model's chat template, once.

`render_prompt` picks the tools to render (`tool_choice`), turns each `ChatTurn` into the
message the template gets, places media, strips old reasoning, adds the tool directive,
handles a trailing assistant prefill and renders and tokenizes the result off the event
loop. Every 400 names the client's own field (`ChatTurn.where`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool

from mlxcel.engine.chat.messages import TEXT_PARTS, strip_think_blocks
from mlxcel.engine.prompting import PromptError, render_chat
from mlxcel.engine.vision.inputs import VisionInputs
from mlxcel.server.errors import APIError, bad_request, scrub_paths
from mlxcel.server.json_body import decode_json_body
from mlxcel.server.media import MediaError
from mlxcel.server.media.parts import collect_media, has_media

if TYPE_CHECKING:
    from mlxcel.server.chat.request import ChatRequest, ChatTurn
    from mlxcel.server.state import ServerState

REQUIRED_TOOL_DIRECTIVE = "You must call at least one of the provided functions."
NAMED_TOOL_DIRECTIVE = "You must call the function `{name}`."


@dataclass(frozen=True)
class RenderedPrompt:
    """A request's prompt: the text and token ids the model reads, the tools rendered into
    it, its decoded media (vision models), and the thinking budget it was rendered for
    (-1: unlimited; 0 renders with thinking off)."""

    text: str
    tokens: list[int]
    tools: list[dict[str, Any]] | None
    media: VisionInputs | None
    thinking_budget: int


def _flatten_content(where: str, content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in content:
        kind = part.get("type")
        if kind in TEXT_PARTS:
            text = part.get(TEXT_PARTS[kind])
            if not isinstance(text, str):
                raise bad_request(
                    f"{where}.content: a {kind} part needs a string '{TEXT_PARTS[kind]}'"
                )
            texts.append(text)
        else:
            raise bad_request(
                f"{where}.content: '{kind}' content parts are not supported by this "
                "model (text only)"
            )
    return "\n".join(texts)


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call with its JSON `arguments` as an object (templates expect one, as
    transformers gives it); arguments that are not a JSON object stay text."""
    call = dict(call)
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        function = dict(function)
        try:  # too deep or a lone surrogate: kept as text, as non-JSON is
            parsed = decode_json_body(function["arguments"].encode(), "arguments")
        except APIError:
            parsed = None
        if isinstance(parsed, dict):
            function["arguments"] = parsed
        call["function"] = function
    return call


def template_message(turn: ChatTurn, content: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The turn as a chat template gets it; `content`: its parts with media placeholders."""
    out = dict(turn.message)
    out["content"] = (
        content if content is not None else _flatten_content(turn.where, out.get("content"))
    )
    if out.get("tool_calls"):
        out["tool_calls"] = [_template_call(call) for call in out["tool_calls"]]
    else:
        out.pop("tool_calls", None)
    return out


def select_tools(request: ChatRequest) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(tools to render, directive to add) for `tools` + `tool_choice`."""
    tools = request.tools or None
    choice = request.tool_choice
    if choice is None or choice == "auto":
        return tools, None
    if choice == "none":
        return None, None
    if choice == "required":
        if not tools:
            raise bad_request("tool_choice 'required' needs at least one tool in 'tools'")
        return tools, REQUIRED_TOOL_DIRECTIVE
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str) or not name:
            raise bad_request("tool_choice must name a function: {'type': 'function', ...}")
        chosen = [
            t
            for t in tools or []
            if isinstance(t.get("function"), dict) and t["function"].get("name") == name
        ]
        if not chosen:
            raise bad_request(f"tool_choice names '{name}', which is not declared in 'tools'")
        return chosen, NAMED_TOOL_DIRECTIVE.format(name=name)
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or a function object")


def add_directive(messages: list[dict[str, Any]], directive: str) -> None:
    """Put a tool directive into the first system message, else the last user message."""
    for message in messages:
        if message["role"] == "system":
            message["content"] = f"{message['content']}\n\n{directive}".lstrip()
            return
    for message in reversed(messages):
        if message["role"] == "user":
            message["content"] = f"{message['content']}\n\n{directive}".lstrip()
            return
    messages.insert(0, {"role": "system", "content": directive})


def assistant_prefill(
    request: ChatRequest, messages: list[dict[str, Any]]
) -> tuple[bool, str | None]:
    """(add_generation_prompt, prefill text) for rendering `messages`.

    As llama-server: a trailing assistant message (text, no tool calls) is a prefill the
    model continues (where the family continues one): it is taken off `messages`, the rest
    is rendered with the generation prompt and its text is appended.
    `continue_final_message` (vLLM) asks for the same and 400s without a final assistant
    message; `add_generation_prompt: false` renders the messages as they are. Two trailing
    assistant messages, or both switches set, are 400.
    """
    options = request.options
    wants_prompt = options.add_generation_prompt
    if options.continue_final_message and wants_prompt:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true")
    last = messages[-1] if messages else None
    continues = (
        last is not None
        and last["role"] == "assistant"
        and not last.get("tool_calls")
        and (
            options.continue_final_message
            or (wants_prompt is not False and request.continue_assistant)
        )
    )
    if options.continue_final_message and not continues:
        raise bad_request("continue_final_message needs a final assistant message to continue")
    if not continues:
        return wants_prompt is not False, None
    if len(messages) > 1 and messages[-2]["role"] == "assistant":
        raise bad_request("Cannot have 2 or more assistant messages at the end of the list.")
    assert last is not None
    messages.pop()
    original = request.turns[-1].message.get("content")
    if isinstance(original, list):
        # llama.cpp joins the text parts of the message it continues with a blank line.
        texts = [p.get("text") for p in original if p.get("type") in ("text", "input_text")]
        return True, "\n\n".join(t for t in texts if isinstance(t, str))
    return True, str(last["content"])


def template_kwargs(state: ServerState, request: ChatRequest, budget: int) -> dict[str, Any]:
    """Server `--chat-template-kwargs` merged with the request's (the request's keys win).

    A thinking `budget` of 0 renders with `enable_thinking: false` unless that key is
    given; under `--reasoning auto` a template with an `enable_thinking` switch renders
    with `true` unless that key is given (llama-server's auto: thinking on where the
    template can).
    """
    merged = {**dict(state.settings.chat_template_kwargs or {}), **request.template_kwargs}
    if budget == 0:
        merged.setdefault("enable_thinking", False)
    if state.settings.reasoning == "auto" and template_has_thinking_switch(state):
        merged.setdefault("enable_thinking", True)
    return merged


def template_has_thinking_switch(state: ServerState) -> bool:
    """Whether the loaded chat template reads `enable_thinking` (llama-server's `--reasoning
    auto` then renders it with thinking on; a template without the switch is unchanged)."""
    template = state.tokenizer.chat_template if state.tokenizer is not None else None
    return isinstance(template, str) and "enable_thinking" in template


async def _media_parts(
    state: ServerState, request: ChatRequest
) -> tuple[list[list[dict[str, Any]] | None], VisionInputs | None]:
    """Per turn, its content parts with media placeholders (None: plain text), and the
    decoded media — only on a vision model; text models refuse media parts (400)."""
    contents = [{"content": turn.message.get("content")} for turn in request.turns]
    if state.media is None or not has_media(contents):
        return [None] * len(contents), None
    try:
        placed, inputs = await collect_media(contents, state.media_policy, state.media)
    except MediaError as exc:
        raise bad_request(str(exc)) from None
    parts = [m["content"] if isinstance(m["content"], list) else None for m in placed]
    return parts, inputs


async def render_prompt(state: ServerState, request: ChatRequest) -> RenderedPrompt:
    """`request` rendered by the loaded chat template and tokenized; 400 on errors."""
    tokenizer = state.tokenizer
    assert tokenizer is not None
    budget = request.thinking_budget
    if budget is None:
        budget = int(state.settings.reasoning_budget)
    tools, directive = select_tools(request)
    kwargs = template_kwargs(state, request, budget)
    contents, media = await _media_parts(state, request)
    messages = [template_message(turn, contents[i]) for i, turn in enumerate(request.turns)]
    if kwargs.get("preserve_thinking") is not True:
        messages = strip_think_blocks(messages)
    if directive:
        add_directive(messages, directive)
    generation_prompt, prefill = assistant_prefill(request, messages)

    def render() -> tuple[str, list[int]]:
        text = render_chat(
            tokenizer,
            messages,
            add_generation_prompt=generation_prompt,
            tools=tools,
            template_kwargs=kwargs,
        )
        if prefill:
            text += prefill
        return text, tokenizer.encode(text, add_special=False)

    try:
        text, tokens = await run_in_threadpool(render)
    except PromptError as exc:
        raise bad_request(scrub_paths(str(exc))) from None
    return RenderedPrompt(text, tokens, tools, media, budget)
