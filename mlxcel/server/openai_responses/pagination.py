"""OpenAI's cursor-paginated item lists (a response's input items, a conversation's items).

`{"object": "list", "data", "first_id", "last_id", "has_more"}`: `order` `asc` or `desc`
(the default: newest first), at most `limit` items (1 to 100, default 20) after the item
whose id is `after`. Each item is shown as `items.listed` shapes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlxcel.server.openai_responses.items import invalid_request, listed

DEFAULT_LIMIT = 20
MAX_LIMIT = 100


@dataclass
class PageQuery:
    """A list route's query (`include` and other parameters are ignored); a route takes it
    as `page: PageQuery = Depends()`."""

    limit: int = DEFAULT_LIMIT
    order: str = "desc"
    after: str | None = None


def list_page(items: Sequence[dict[str, Any]], query: PageQuery | None = None) -> dict[str, Any]:
    """One page of `items` (stored oldest first); 400 for a bad `limit`, `order` or `after`."""
    query = query or PageQuery()
    limit, order, after = query.limit, query.order, query.after
    if order not in ("asc", "desc"):
        raise invalid_request("order must be 'asc' or 'desc'", "order")
    if not 1 <= limit <= MAX_LIMIT:
        raise invalid_request(f"limit must be between 1 and {MAX_LIMIT}", "limit")
    ordered = list(items) if order == "asc" else list(reversed(items))
    start = 0
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise invalid_request(f"after: no item with id '{after}' in this list", "after")
        start = ids.index(after) + 1
    page = [listed(item) for item in ordered[start : start + limit]]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": start + limit < len(ordered),
    }
