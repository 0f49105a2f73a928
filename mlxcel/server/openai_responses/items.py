"""Responses input items: normalized, checked, and turned into chat messages.

`input_items` accepts a request's `input` (a string or a list of items) and returns the
normalized items (each with its `type`; a role without a type is a message), raising 400
for anything this server cannot replay. `items_to_messages` turns normalized items
(an earlier exchange's stored history included) into the chat messages the chat template
renders:

* `message` → a chat message (`developer` reads as `system`); text parts (`input_text`,
  `output_text`, `refusal`) become chat text parts, `input_image` an `image_url` part;
* `function_call` → a `tool_calls` entry of an assistant message (consecutive calls share
  one message, which also takes the assistant text right before them);
* `function_call_output` → a `tool` message;
* `reasoning` → the `reasoning_content` of the next assistant message (dropped if none);
* `compaction` → the messages `compaction.compaction_item_messages(item)` replays.

Stored items (a response's input, a conversation's items) get ids (`with_ids`) and are
listed with text parts (`listed`), the shapes OpenAI's item lists have.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxcel.engine.chat.messages import TEXT_PARTS
from mlxcel.server.chat.request import ChatTurn
from mlxcel.server.errors import APIError
from mlxcel.server.openai_common import new_id

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning", "compaction")
ITEM_ID_PREFIXES = {
    "message": "msg_",
    "function_call": "fc_",
    "function_call_output": "fco_",
    "reasoning": "rs_",
    "compaction": "cmp_",
}
"""The id prefix of each item type, for items stored without an id."""


def invalid_request(message: str, param: str | None = None, *, code: str | None = None) -> APIError:
    """400 invalid_request_error naming the offending request field (`param`)."""
    return APIError(400, message, "invalid_request_error", code=code, extra={"param": param})


def _string(item: dict[str, Any], key: str, where: str, *, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not empty and not value):
        raise invalid_request(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    return value


def _check_parts(parts: list[Any], where: str) -> None:
    for index, part in enumerate(parts):
        here = f"{where}[{index}]"
        if not isinstance(part, dict):
            raise invalid_request(f"{here} must be a content part object", here)
        kind = part.get("type")
        if not isinstance(kind, str):
            raise invalid_request(f"{here}.type must be a string", f"{here}.type")
        if kind in TEXT_PARTS:
            key = TEXT_PARTS[kind]
            if not isinstance(part.get(key), str):
                raise invalid_request(f"{here}.{key} must be a string", f"{here}.{key}")
        elif kind == "input_image":
            if not isinstance(part.get("image_url"), str) or not part["image_url"]:
                raise invalid_request(
                    f"{here}: input_image needs an 'image_url' (file_id is not supported)", here
                )
        elif kind == "input_file":
            raise invalid_request(f"{here}: input_file content parts are not supported", here)
        else:
            raise invalid_request(f"{here}: unsupported content part type {kind!r}", here)


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise invalid_request(
            f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}", f"{where}.role"
        )
    content = item.get("content")
    if isinstance(content, list):
        _check_parts(content, f"{where}.content")
    elif not isinstance(content, str):
        raise invalid_request(
            f"{where}.content must be a string or a list of content parts", f"{where}.content"
        )
    return {**item, "type": "message"}


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    _string(item, "call_id", where)
    _string(item, "name", where)
    _string(item, "arguments", where, empty=True)
    return dict(item)


def _function_call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    _string(item, "call_id", where)
    output = item.get("output")
    if isinstance(output, list):
        _check_parts(output, f"{where}.output")
    elif not isinstance(output, str):
        raise invalid_request(
            f"{where}.output must be a string or a list of content parts", f"{where}.output"
        )
    return dict(item)


def _reasoning(item: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("content", "summary"):
        value = item.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(
            isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in value
        ):
            raise invalid_request(f"{where}.{key} must be a list of text parts", f"{where}.{key}")
    return dict(item)


def input_items(value: str | list[Any] | None, field: str = "input") -> list[dict[str, Any]]:
    """The request's `input` (or another `field` of items) as normalized items (a string is
    one user message); 400 on item types, content parts or shapes this server cannot
    replay."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    items: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        where = f"{field}[{index}]"
        if not isinstance(item, dict):
            raise invalid_request(f"{where} must be an item object", where)
        kind = item.get("type")
        if kind is None and "role" in item:
            kind = "message"
        if kind == "message":
            items.append(_message(item, where))
        elif kind == "function_call":
            items.append(_function_call(item, where))
        elif kind == "function_call_output":
            items.append(_function_call_output(item, where))
        elif kind == "reasoning":
            items.append(_reasoning(item, where))
        elif kind == "compaction":
            items.append(dict(item))
        elif kind is None:
            raise invalid_request(f"{where} needs a 'type' (or a 'role' for a message)", where)
        else:
            raise invalid_request(
                f"{where}: input items of type {kind!r} are not supported "
                f"(supported: {', '.join(ITEM_TYPES)})",
                f"{where}.type",
            )
    return items


def _chat_part(part: dict[str, Any]) -> dict[str, Any]:
    kind = part["type"]
    if kind in TEXT_PARTS:
        return {"type": "text", "text": part[TEXT_PARTS[kind]]}
    image: dict[str, Any] = {"url": part["image_url"]}
    if part.get("detail") is not None:
        image["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image}


def _chat_content(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    return [_chat_part(part) for part in content]


def _reasoning_text(item: dict[str, Any]) -> str:
    parts = item.get("content") or item.get("summary") or []
    return "".join(p.get("text", "") for p in parts if isinstance(p, dict))


def _compaction_messages(item: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        from mlxcel.server.openai_responses.compaction import compaction_item_messages
    except ImportError:
        raise invalid_request(
            "compaction items are not supported by this server", "input"
        ) from None
    return list(compaction_item_messages(item))


def items_to_turns(
    items: list[dict[str, Any]], where: Callable[[dict[str, Any]], str]
) -> list[ChatTurn]:
    """Chat turns replaying normalized `items` (see the module docstring); each names where
    the client sent the item that opened it (`where(item)`: `input[2]`...)."""
    turns: list[ChatTurn] = []
    reasoning: list[str] = []
    names: dict[str, str] = {}

    def add(message: dict[str, Any], item: dict[str, Any]) -> None:
        if message["role"] == "assistant" and reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        turns.append(ChatTurn(message, where(item)))

    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            add({"role": role, "content": _chat_content(item["content"])}, item)
        elif kind == "function_call":
            names[item["call_id"]] = item["name"]
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = turns[-1].message if turns else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                add({"role": "assistant", "content": "", "tool_calls": [call]}, item)
        elif kind == "function_call_output":
            message = {
                "role": "tool",
                "tool_call_id": item["call_id"],
                "content": _chat_content(item["output"]),
            }
            if item["call_id"] in names:
                message["name"] = names[item["call_id"]]
            add(message, item)
        elif kind == "reasoning":
            text = _reasoning_text(item)
            if text:
                reasoning.append(text)
        elif kind == "compaction":
            turns.extend(ChatTurn(m, where(item)) for m in _compaction_messages(item))
        else:  # input_items() lets nothing else through
            raise invalid_request(f"items of type {kind!r} cannot be replayed", "input")
    return turns


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages replaying normalized `items` (see the module docstring)."""
    return [turn.message for turn in items_to_turns(items, lambda _: "input")]


def output_text(items: list[dict[str, Any]]) -> str:
    """The concatenated `output_text` of the message items in `items`."""
    return "".join(
        part.get("text", "")
        for item in items
        if item.get("type") == "message"
        for part in item.get("content") or []
        if isinstance(part, dict) and part.get("type") == "output_text"
    )


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`items` (normalized), each with an `id`: its own, else a new one for its type."""
    return [
        item
        if isinstance(item.get("id"), str) and item["id"]
        else {"id": new_id(ITEM_ID_PREFIXES.get(item["type"], "item_")), **item}
        for item in items
    ]


def listed(item: dict[str, Any]) -> dict[str, Any]:
    """A stored item as an item list shows it: a message's string `content` becomes one
    text part (`output_text` for the assistant, `input_text` otherwise); others as is."""
    content = item.get("content")
    if item.get("type") != "message" or not isinstance(content, str):
        return item
    if item.get("role") == "assistant":
        part: dict[str, Any] = {"type": "output_text", "text": content, "annotations": []}
    else:
        part = {"type": "input_text", "text": content}
    return {**item, "content": [part]}
