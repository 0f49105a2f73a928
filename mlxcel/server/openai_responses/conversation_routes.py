"""Routes: /v1/conversations (create, retrieve, update, delete) and its items (list, add,
retrieve, delete), also without /v1. `conversations.py` holds the logic."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from mlxcel.server.openai_common import parse_body
from mlxcel.server.openai_responses.conversations import ConversationsServing
from mlxcel.server.openai_responses.pagination import PageQuery
from mlxcel.server.openai_responses.protocol import (
    ConversationCreate,
    ConversationItemsCreate,
    ConversationUpdate,
)
from mlxcel.server.openai_responses.store import stores_for
from mlxcel.server.state import ServerState, get_state

router = APIRouter()

ONE = ("/v1/conversations/{conversation_id}", "/conversations/{conversation_id}")
ITEMS = tuple(f"{path}/items" for path in ONE)
ITEM = tuple(f"{path}/{{item_id}}" for path in ITEMS)


def serving_for(raw: Request, state: ServerState) -> ConversationsServing:
    """The Conversations serving layer of the app handling `raw` (its stores live on the app)."""
    return ConversationsServing(stores_for(raw.app, state.settings))


@router.post("/v1/conversations")
@router.post("/conversations")
async def create_conversation(
    raw: Request, state: ServerState = Depends(get_state)
) -> dict[str, Any]:
    """A new conversation, with its first `items` and `metadata`."""
    return serving_for(raw, state).create(await parse_body(raw, ConversationCreate))


@router.get(ONE[0])
@router.get(ONE[1])
async def retrieve_conversation(
    conversation_id: str, raw: Request, state: ServerState = Depends(get_state)
) -> dict[str, Any]:
    """A stored conversation."""
    return serving_for(raw, state).retrieve(conversation_id)


@router.post(ONE[0])
@router.post(ONE[1])
async def update_conversation(
    conversation_id: str, raw: Request, state: ServerState = Depends(get_state)
) -> dict[str, Any]:
    """Replace a conversation's metadata."""
    body = await parse_body(raw, ConversationUpdate)
    return serving_for(raw, state).update(conversation_id, body)


@router.delete(ONE[0])
@router.delete(ONE[1])
async def delete_conversation(
    conversation_id: str, raw: Request, state: ServerState = Depends(get_state)
) -> dict[str, Any]:
    """Delete a conversation and its items."""
    return serving_for(raw, state).delete(conversation_id)


@router.get(ITEMS[0])
@router.get(ITEMS[1])
async def list_conversation_items(
    conversation_id: str,
    raw: Request,
    state: ServerState = Depends(get_state),
    page: PageQuery = Depends(),
) -> dict[str, Any]:
    """One page of a conversation's items (`limit`, `order`, `after`)."""
    return serving_for(raw, state).list_items(conversation_id, page)


@router.post(ITEMS[0])
@router.post(ITEMS[1])
async def add_conversation_items(
    conversation_id: str, raw: Request, state: ServerState = Depends(get_state)
) -> dict[str, Any]:
    """Append items to a conversation."""
    body = await parse_body(raw, ConversationItemsCreate)
    return serving_for(raw, state).add_items(conversation_id, body)


@router.get(ITEM[0])
@router.get(ITEM[1])
async def retrieve_conversation_item(
    conversation_id: str, item_id: str, raw: Request, state: ServerState = Depends(get_state)
) -> dict[str, Any]:
    """One item of a conversation."""
    return serving_for(raw, state).retrieve_item(conversation_id, item_id)


@router.delete(ITEM[0])
@router.delete(ITEM[1])
async def delete_conversation_item(
    conversation_id: str, item_id: str, raw: Request, state: ServerState = Depends(get_state)
) -> dict[str, Any]:
    """Remove one item; the conversation object."""
    return serving_for(raw, state).delete_item(conversation_id, item_id)
