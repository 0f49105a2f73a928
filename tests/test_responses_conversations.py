"""GET /v1/responses/{id}/input_items and the Conversations routes, through the `openai` SDK.

The stand-in engine and helpers of test_responses_api run the real HTTP stack without a
socket; the last test drives a real `mlxcel serve` on the tiny random-weight model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from server_harness import API_KEY, main_server_args, shared_server
from test_responses_api import dump, make_app, prompts, run

INPUT: Any = [
    {"role": "developer", "content": "Use metric units."},
    {"role": "user", "content": [{"type": "input_text", "text": "first"}]},
    {"role": "assistant", "content": "earlier answer"},
    {"role": "user", "content": "second"},
]


def texts(items: Any) -> list[str]:
    """The text of each message item (its one part), in order."""
    return [dump(item)["content"][0]["text"] for item in items]


def test_input_items_list_and_paginate(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, ["ok"])

    async def call(client: AsyncOpenAI, http: httpx.AsyncClient) -> None:
        made = await client.responses.create(model="m", input=INPUT)
        page = await client.responses.input_items.list(made.id)
        # Newest first by default, each with an id; string contents as text parts.
        assert texts(page.data) == ["second", "earlier answer", "first", "Use metric units."]
        assert all(item.id.startswith("msg_") for item in page.data)
        assert dump(page.data[0])["content"] == [{"type": "input_text", "text": "second"}]
        assert dump(page.data[1])["content"][0]["type"] == "output_text"
        assert page.has_more is False
        raw = (await http.get(f"/v1/responses/{made.id}/input_items?order=asc&limit=3")).json()
        assert raw["object"] == "list" and raw["has_more"] is True
        assert [i["id"] for i in raw["data"]] == [i.id for i in reversed(page.data)][:3]
        assert (raw["first_id"], raw["last_id"]) == (raw["data"][0]["id"], raw["data"][2]["id"])
        rest = await client.responses.input_items.list(
            made.id, order="asc", limit=3, after=raw["last_id"]
        )
        assert texts(rest.data) == ["second"] and rest.has_more is False
        walked = [i async for i in client.responses.input_items.list(made.id, limit=1)]
        assert [i.id for i in walked] == [i.id for i in page.data]  # the SDK's auto-paging
        bare = await http.get(f"/responses/{made.id}/input_items")  # the alias without /v1
        assert bare.status_code == 200 and len(bare.json()["data"]) == 4
        with pytest.raises(openai.NotFoundError):
            await client.responses.input_items.list("resp_missing")
        for query in ("order=up", "limit=0", "limit=101", "after=msg_nope", "limit=x"):
            bad = await http.get(f"/v1/responses/{made.id}/input_items?{query}")
            assert bad.status_code == 400, query
            assert bad.json()["error"]["type"] == "invalid_request_error"

    run(app, call)


def test_conversation_lifecycle_and_responses(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, ["reply"])

    async def call(client: AsyncOpenAI, http: httpx.AsyncClient) -> None:
        conv = await client.conversations.create(
            items=[{"type": "message", "role": "user", "content": "remember: blue"}],
            metadata={"topic": "colors"},
        )
        assert conv.id.startswith("conv_") and conv.object == "conversation"
        assert conv.metadata == {"topic": "colors"} and conv.created_at > 0
        assert dump(await client.conversations.retrieve(conv.id)) == dump(conv)
        # A response in the conversation sees its items and appends its input and output.
        answer = await client.responses.create(model="m", input="and now?", conversation=conv.id)
        assert answer.conversation is not None and answer.conversation.id == conv.id
        assert "remember: blue" in prompts(hf_tokenizer, engine)[0]
        items = [i async for i in client.conversations.items.list(conv.id, order="asc")]
        assert texts(items) == ["remember: blue", "and now?", "reply"]
        assert [i.type for i in items] == ["message"] * 3 and items[2].id == answer.output[0].id
        assert [i.id for i in (await client.conversations.items.list(conv.id)).data] == [
            i.id for i in reversed(items)
        ]
        added = await client.conversations.items.create(
            conv.id, items=[{"type": "message", "role": "user", "content": "later"}]
        )
        assert texts(added.data) == ["later"] and added.first_id == added.data[0].id
        got = await client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
        assert dump(got) == dump(added.data[0])
        await client.responses.create(model="m", input="last", conversation={"id": conv.id})
        prompt = prompts(hf_tokenizer, engine)[1]
        assert all(word in prompt for word in ("blue", "and now?", "reply", "later", "last"))
        after = await client.conversations.items.delete(items[0].id, conversation_id=conv.id)
        assert after.id == conv.id
        left = await client.conversations.items.list(conv.id, order="asc")
        assert texts(left.data) == ["and now?", "reply", "later", "last", "reply"]
        with pytest.raises(openai.NotFoundError):
            await client.conversations.items.retrieve(items[0].id, conversation_id=conv.id)
        updated = await client.conversations.update(conv.id, metadata={"topic": "shapes"})
        assert updated.metadata == {"topic": "shapes"}
        deleted = await client.conversations.delete(conv.id)
        assert (deleted.id, deleted.deleted, deleted.object) == (
            conv.id,
            True,
            "conversation.deleted",
        )
        with pytest.raises(openai.NotFoundError):
            await client.conversations.retrieve(conv.id)
        with pytest.raises(openai.NotFoundError):
            await client.conversations.items.list(conv.id)
        bare = await http.post("/conversations", json={})  # the alias without /v1
        assert bare.status_code == 200 and bare.json()["metadata"] == {}

    run(app, call)


def test_conversation_store_is_bounded(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, ["ok"], conversation_store_max_entries=2)

    async def call(client: AsyncOpenAI, _: Any) -> None:
        made = [await client.conversations.create() for _ in range(3)]
        with pytest.raises(openai.NotFoundError):  # the least recently used is gone
            await client.conversations.retrieve(made[0].id)
        for conv in made[1:]:
            assert (await client.conversations.retrieve(conv.id)).id == conv.id

    run(app, call)
    app, _ = make_app(hf_tokenizer, ["ok"], conversation_store_max_entries=0)

    async def disabled(client: AsyncOpenAI, _: Any) -> None:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.conversations.create()
        assert "conversation-store-max-entries" in caught.value.message

    run(app, disabled)


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/conversations", {"items": "x"}, "items"),
        ("/v1/conversations", {"items": [{"type": "web_search_call"}]}, "items[0]"),
        ("/v1/conversations", {"items": [{"role": "user", "content": "x"}] * 21}, "at most 20"),
        ("/v1/conversations", {"metadata": {str(i): "v" for i in range(17)}}, "16 keys"),
        ("/v1/conversations", {"metadata": {"k": 1}}, "metadata.k"),
        ("/v1/conversations", {"metadata": {"k": "v" * 513}}, "metadata.k"),
        ("/v1/conversations", b"{nope", "JSON"),
    ],
)
def test_bad_conversation_bodies_are_400(
    hf_tokenizer: Any, path: str, body: Any, needle: str
) -> None:
    app, _ = make_app(hf_tokenizer, ["ok"])

    async def call(_: Any, http: httpx.AsyncClient) -> None:
        if isinstance(body, bytes):
            answer = await http.post(path, content=body)
        else:
            answer = await http.post(path, json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and needle in error["message"], error

    run(app, call)


def test_real_server_conversations_and_input_items(tiny_llama_dir: Path) -> None:
    server = shared_server(main_server_args(tiny_llama_dir))
    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    conv = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "Hi"}], metadata={"k": "v"}
    )
    answer = client.responses.create(
        model="tiny", input="Hello", conversation=conv.id, max_output_tokens=3, temperature=0
    )
    (given,) = client.responses.input_items.list(answer.id).data
    assert texts([given]) == ["Hello"] and given.id.startswith("msg_")
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert texts(items[:2]) == ["Hi", "Hello"] and items[-1].id == answer.output[-1].id
    added = client.conversations.items.create(
        conv.id, items=[{"type": "message", "role": "user", "content": "More"}]
    )
    assert client.conversations.items.list(conv.id, limit=1).data[0].id == added.data[0].id
    assert client.conversations.retrieve(conv.id).metadata == {"k": "v"}
    client.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
