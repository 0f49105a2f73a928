"""An Anthropic Messages request as the chat core's `ChatRequest`.

The chat path renders, constrains and parses; this module only translates:

* `system` (string or text blocks) becomes a leading system message;
* consecutive turns of one role are merged (as Anthropic does), then each user turn becomes
  `tool` messages for its `tool_result` blocks and user messages for its text, image and
  plain-text document blocks, in order; an assistant turn becomes one assistant message
  (text → content, `thinking` → reasoning_content, `tool_use` → tool_calls);
* function tools (`input_schema`) become chat functions; server tools (web search, code
  execution, ... anything typed without an `input_schema`) and their history blocks are
  dropped, since a local server cannot run them;
* `tool_choice` auto/any/tool/none becomes auto/required/named function/none, and
  `disable_parallel_tool_use` becomes `parallel_tool_calls: false`;
* `thinking` enabled/adaptive/disabled sets `enable_thinking` for the template, and
  `budget_tokens` the thinking budget;
* `output_config.format` (JSON schema) becomes a json_schema `response_format`.

Tool-use ids map both ways: a chat call id `call_X` (or a format's own id `X`) is sent as
`toolu_X`, and `toolu_X` comes back as `X`, so id-shape rules of templates still hold.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import AliasChoices, ValidationError

from mlxcel.server.anthropic_messages.protocol import CountTokensRequest, MessagesRequest
from mlxcel.server.chat.request import ChatOptions, ChatRequest, ChatTurn
from mlxcel.server.errors import bad_request
from mlxcel.server.sampling_fields import SamplingFields

TOOL_ID_PREFIX = "toolu_"
CHAT_ID_PREFIX = "call_"

_MAPPED_FIELDS = frozenset(
    {"max_tokens", "stop", "n", "extra_body", "temperature", "top_p", "top_k"}
)
_EXTRA_FIELDS = (
    "reasoning_format",
    "thinking_budget_tokens",
    "thinking_token_budget",
    "thinking_budget",
)


def _passthrough_fields() -> frozenset[str]:
    names: set[str] = set()
    for name, info in SamplingFields.model_fields.items():
        if name in _MAPPED_FIELDS:
            continue
        names.add(name)
        if isinstance(info.validation_alias, AliasChoices):
            names.update(str(choice) for choice in info.validation_alias.choices)
    return frozenset(names).union(_EXTRA_FIELDS)


PASSTHROUGH_FIELDS = _passthrough_fields()
"""mlxcel sampling extensions (min_p, seed, repetition_penalty, ...) sent on as they are."""

_SERVER_BLOCKS = frozenset(
    {"server_tool_use", "mcp_tool_use", "mcp_tool_result", "container_upload", "redacted_thinking"}
)


def anthropic_tool_id(chat_id: str) -> str:
    """The `toolu_...` id a client sees for the chat call id `chat_id`."""
    return TOOL_ID_PREFIX + chat_id.removeprefix(CHAT_ID_PREFIX)


def chat_call_id(tool_use_id: str) -> str:
    """The chat call id (as the template sees it) of a client's tool-use id."""
    return tool_use_id.removeprefix(TOOL_ID_PREFIX)


def _ignored_block(kind: Any) -> bool:
    """History blocks of server tools (and redacted thinking): nothing to render locally."""
    return isinstance(kind, str) and (
        kind in _SERVER_BLOCKS or (kind.endswith("_tool_result") and kind != "tool_result")
    )


def _text_of(where: str, block: dict[str, Any]) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}: a text block needs a string 'text'")
    return text


def system_text(system: str | list[dict[str, Any]] | None) -> str:
    """The top-level `system` as one string (text blocks joined by blank lines)."""
    if system is None or isinstance(system, str):
        return system or ""
    texts: list[str] = []
    for i, block in enumerate(system):
        if block.get("type") != "text":
            raise bad_request(f"system[{i}]: system blocks must be text blocks")
        texts.append(_text_of(f"system[{i}]", block))
    return "\n\n".join(t for t in texts if t)


def _image_part(where: str, block: dict[str, Any]) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad_request(f"{where}: an image block needs a 'source' object")
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise bad_request(f"{where}: a base64 image needs 'media_type' and 'data' strings")
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        given = source.get("url")
        if not isinstance(given, str) or not given:
            raise bad_request(f"{where}: a url image needs a 'url' string")
        url = given
    else:
        raise bad_request(f"{where}: image source type '{kind}' is not supported (base64, url)")
    return {"type": "image_url", "image_url": {"url": url}}


def _document_part(where: str, block: dict[str, Any]) -> dict[str, Any]:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text" and isinstance(source, dict) and isinstance(source.get("data"), str):
        return {"type": "text", "text": source["data"]}
    if kind == "content" and isinstance(source, dict):
        inner = source.get("content")
        if isinstance(inner, str):
            return {"type": "text", "text": inner}
        if isinstance(inner, list):
            if not all(isinstance(b, dict) for b in inner):
                raise bad_request(f"{where}: a document's content blocks must be objects")
            texts = [_text_of(f"{where}.source", b) for b in inner if b.get("type") == "text"]
            return {"type": "text", "text": "\n".join(texts)}
    raise bad_request(f"{where}: only plain-text documents are supported, not '{kind}' sources")


def _content_part(where: str, block: dict[str, Any], images: bool) -> dict[str, Any]:
    """A user (or tool result) block as a chat content part (`images`: the model takes
    images; else an image block is a 400 naming it)."""
    if not isinstance(block, dict):
        raise bad_request(f"{where}: a content block must be an object")
    kind = block.get("type")
    if kind == "text":
        return {"type": "text", "text": _text_of(where, block)}
    if kind == "image":
        if not images:
            raise bad_request(
                f"{where}: image input is not supported by the loaded model "
                "('image' content block; serve a vision model to send images)"
            )
        return _image_part(where, block)
    if kind == "document":
        return _document_part(where, block)
    raise bad_request(f"{where}: '{kind}' content blocks are not supported here")


def _tool_message(where: str, block: dict[str, Any], images: bool) -> dict[str, Any]:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise bad_request(f"{where}: a tool_result block needs a 'tool_use_id' string")
    content = block.get("content")
    parts: str | list[dict[str, Any]]
    if content is None or isinstance(content, str):
        parts = content or ""
    elif isinstance(content, list):
        parts = [_content_part(f"{where}.content[{j}]", b, images) for j, b in enumerate(content)]
    else:
        raise bad_request(f"{where}: tool_result 'content' must be a string or a list of blocks")
    return {"role": "tool", "tool_call_id": chat_call_id(tool_use_id), "content": parts}


Located = tuple[str, dict[str, Any]]  # (where the block is, the block)


def _turns(body: CountTokensRequest) -> Iterator[tuple[str, str, list[Located]]]:
    """(role, where the turn starts, located blocks) per turn, consecutive messages of one
    role merged."""
    role: str | None = None
    start = ""
    blocks: list[Located] = []
    for i, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, str):
            items: list[Located] = [(f"messages[{i}].content", {"type": "text", "text": content})]
        else:
            items = []
            for j, block in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                    raise bad_request(f"{where}: a content block needs a 'type'")
                items.append((where, block))
        if message.role != role:
            if role is not None:
                yield role, start, blocks
            blocks, start = [], f"messages[{i}]"
        role = message.role
        blocks.extend(items)
    if role is not None:
        yield role, start, blocks


def _user_messages(blocks: list[Located], images: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for where, block in blocks:
        kind = block["type"]
        if kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            out.append(_tool_message(where, block, images))
        elif not _ignored_block(kind):
            parts.append(_content_part(where, block, images))
    if parts or not out:
        out.append({"role": "user", "content": parts or ""})
    return out


def _assistant_message(blocks: list[Located]) -> dict[str, Any]:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for where, block in blocks:
        kind = block["type"]
        if kind == "text":
            texts.append(_text_of(where, block))
        elif kind == "thinking":
            thought = block.get("thinking")
            if not isinstance(thought, str):
                raise bad_request(f"{where}: a thinking block needs a string 'thinking'")
            reasoning.append(thought)
        elif kind == "tool_use":
            calls.append(_tool_call(where, block))
        elif not _ignored_block(kind):
            raise bad_request(f"{where}: '{kind}' blocks are not supported in assistant turns")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_call(where: str, block: dict[str, Any]) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{where}: a tool_use block needs an 'id' string")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}: a tool_use block needs a 'name' string")
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}: a tool_use block's 'input' must be an object")
    return {
        "id": chat_call_id(call_id),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def chat_turns(body: CountTokensRequest, *, images: bool = True) -> list[ChatTurn]:
    """The chat turns of `body` (system first, when there is one); `images`: whether the
    model takes image blocks (else they are a 400)."""
    turns: list[ChatTurn] = []
    system = system_text(body.system)
    if system:
        turns.append(ChatTurn({"role": "system", "content": system}, "system"))
    for role, where, blocks in _turns(body):
        if role == "user":
            turns.extend(ChatTurn(m, where) for m in _user_messages(blocks, images))
        else:
            turns.append(ChatTurn(_assistant_message(blocks), where))
    return turns


def function_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The client's own tools as chat functions; server tools are left out."""
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            continue  # a server tool (web_search_..., code_execution_..., bash_...)
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}]: a tool needs a 'name' string")
        if not isinstance(schema, dict):
            raise bad_request(f"tools[{i}]: a custom tool needs an 'input_schema' object")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool]:
    """(chat `tool_choice`, whether parallel calls are allowed) for Anthropic's."""
    if choice is None:
        return None, True
    parallel = choice.get("disable_parallel_tool_use") is not True
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("tool_choice: type 'tool' needs a 'name' string")
        return {"type": "function", "function": {"name": name}}, parallel
    raise bad_request("tool_choice.type must be 'auto', 'any', 'tool' or 'none'")


def thinking(config: dict[str, Any] | None) -> tuple[bool | None, int | None]:
    """(`enable_thinking` for the template, thinking budget) of `thinking`; None: unset."""
    if config is None:
        return None, None
    kind = config.get("type")
    if kind == "disabled":
        return False, None
    if kind == "adaptive":
        return True, None
    if kind == "enabled":
        budget = config.get("budget_tokens")
        if budget is not None and (type(budget) is not int or budget < 0):
            raise bad_request("thinking.budget_tokens must be a non-negative integer")
        return True, budget
    raise bad_request("thinking.type must be 'enabled', 'adaptive' or 'disabled'")


def response_format(body: CountTokensRequest) -> dict[str, Any] | None:
    """`output_config.format` (or the beta `output_format`) as a chat `response_format`."""
    config = body.output_config or {}
    fmt = config.get("format")
    if fmt is None:
        fmt = (body.model_extra or {}).get("output_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad_request("output_config.format: only {'type': 'json_schema', ...} is supported")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise bad_request("output_config.format: a json_schema format needs a 'schema' object")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def to_chat_request(body: CountTokensRequest, *, images: bool = True) -> ChatRequest:
    """`body` as the chat core's request (400 for what cannot be translated, and for image
    blocks unless `images`: the loaded model takes them). A streamed answer asks for the
    prompt progress (`message_start` reports the cached tokens from it)."""
    extra = body.model_extra or {}
    fields: dict[str, Any] = {k: v for k, v in extra.items() if k in PASSTHROUGH_FIELDS}
    turns = chat_turns(body, images=images)
    choice, parallel = tool_choice(body.tool_choice)
    kwargs = extra.get("chat_template_kwargs")
    template_kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
    enable, budget = thinking(body.thinking)
    if enable is not None:
        template_kwargs["enable_thinking"] = enable
    if template_kwargs:
        fields["chat_template_kwargs"] = template_kwargs
    if isinstance(body, MessagesRequest):
        fields["max_tokens"] = body.max_tokens
        if body.stop_sequences:
            fields["stop"] = body.stop_sequences
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(body, name)
            if value is not None:
                fields[name] = value
        if body.stream:
            fields["return_progress"] = True
    try:
        options = ChatOptions.model_validate(fields)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_input=False)) from None
    return ChatRequest.build(
        turns,
        options,
        thinking_budget=budget,
        tools=function_tools(body.tools) or None,
        tool_choice=choice,
        parallel_tool_calls=False if not parallel else None,
        response_format=response_format(body),
    )
