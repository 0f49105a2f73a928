"""OpenAI's Conversations API over the conversation store.

A conversation holds items (the Responses item shapes, each with an id) and metadata. It is
created by POST /v1/conversations, or by a response that names an id not stored yet;
responses naming it with `conversation` append their input and output items. It lives in
the bounded conversation store (`--conversation-store-max-entries`, LRU, and
`--conversation-store-ttl-secs` after its last write): an evicted or expired conversation
is gone (404).
"""

from __future__ import annotations

from typing import Any

from mlxcel.server.errors import APIError
from mlxcel.server.openai_common import new_id, now
from mlxcel.server.openai_responses.items import input_items, invalid_request, listed, with_ids
from mlxcel.server.openai_responses.pagination import PageQuery, list_page
from mlxcel.server.openai_responses.protocol import (
    ConversationCreate,
    ConversationItemsCreate,
    ConversationUpdate,
)
from mlxcel.server.openai_responses.store import Conversation, ResponseStores

DISABLED = "conversations are disabled (--conversation-store-max-entries 0)"
MAX_ADDED_ITEMS = 20
"""Items one request may add (OpenAI's limit)."""
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def not_found(what: str, ident: str, param: str) -> APIError:
    """404 for a conversation (or item) that is not (or no longer) stored."""
    return APIError(
        404, f"{what} with id '{ident}' not found.", "not_found_error", extra={"param": param}
    )


def checked_metadata(value: dict[str, Any] | None) -> dict[str, str]:
    """`metadata` as OpenAI allows it (16 string pairs, keys of 64 characters at most,
    values of 512); 400 otherwise."""
    metadata = value or {}
    if len(metadata) > MAX_METADATA_KEYS:
        raise invalid_request(f"metadata: at most {MAX_METADATA_KEYS} keys", "metadata")
    for key, text in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise invalid_request(
                f"metadata: keys are at most {MAX_METADATA_KEY_CHARS} characters", "metadata"
            )
        if not isinstance(text, str) or len(text) > MAX_METADATA_VALUE_CHARS:
            raise invalid_request(
                f"metadata.{key}: values are strings of at most "
                f"{MAX_METADATA_VALUE_CHARS} characters",
                f"metadata.{key}",
            )
    return dict(metadata)


def new_items(items: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Items a request adds: checked as Responses input items, with ids; 400 past 20."""
    if items is not None and len(items) > MAX_ADDED_ITEMS:
        raise invalid_request(f"items: at most {MAX_ADDED_ITEMS} items at a time", "items")
    return with_ids(input_items(items, "items"))


class ConversationsServing:
    """Runs the /v1/conversations routes against the server's stores."""

    def __init__(self, stores: ResponseStores) -> None:
        self.stores = stores

    def _get(self, conversation_id: str) -> Conversation:
        if not self.stores.conversations.enabled:
            raise invalid_request(DISABLED, "conversation_id")
        conversation = self.stores.conversations.get(conversation_id)
        if conversation is None:
            raise not_found("Conversation", conversation_id, "conversation_id")
        return conversation

    def _item_index(self, conversation: Conversation, item_id: str) -> int:
        for index, item in enumerate(conversation.items):
            if item.get("id") == item_id:
                return index
        raise not_found("Item", item_id, "item_id")

    def create(self, body: ConversationCreate) -> dict[str, Any]:
        """POST /v1/conversations."""
        if not self.stores.conversations.enabled:
            raise invalid_request(DISABLED)
        conversation = Conversation(
            new_id("conv_"), now(), checked_metadata(body.metadata), new_items(body.items)
        )
        self.stores.conversations.put(conversation.id, conversation)
        return conversation.object()

    def retrieve(self, conversation_id: str) -> dict[str, Any]:
        """GET /v1/conversations/{id}."""
        return self._get(conversation_id).object()

    def update(self, conversation_id: str, body: ConversationUpdate) -> dict[str, Any]:
        """POST /v1/conversations/{id}: replace its metadata."""
        conversation = self._get(conversation_id)
        conversation.metadata = checked_metadata(body.metadata)
        self.stores.conversations.put(conversation_id, conversation)
        return conversation.object()

    def delete(self, conversation_id: str) -> dict[str, Any]:
        """DELETE /v1/conversations/{id}."""
        self._get(conversation_id)
        self.stores.conversations.pop(conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    def list_items(self, conversation_id: str, query: PageQuery) -> dict[str, Any]:
        """GET /v1/conversations/{id}/items: one page of its items."""
        return list_page(self._get(conversation_id).items, query)

    def add_items(self, conversation_id: str, body: ConversationItemsCreate) -> dict[str, Any]:
        """POST /v1/conversations/{id}/items: append items; the list of those added."""
        conversation = self._get(conversation_id)
        added = new_items(body.items)
        conversation.items.extend(added)
        self.stores.conversations.put(conversation_id, conversation)
        return list_page(added, PageQuery(limit=max(len(added), 1), order="asc"))

    def retrieve_item(self, conversation_id: str, item_id: str) -> dict[str, Any]:
        """GET /v1/conversations/{id}/items/{item_id}."""
        conversation = self._get(conversation_id)
        return listed(conversation.items[self._item_index(conversation, item_id)])

    def delete_item(self, conversation_id: str, item_id: str) -> dict[str, Any]:
        """DELETE /v1/conversations/{id}/items/{item_id}: the conversation object."""
        conversation = self._get(conversation_id)
        del conversation.items[self._item_index(conversation, item_id)]
        self.stores.conversations.put(conversation_id, conversation)
        return conversation.object()
