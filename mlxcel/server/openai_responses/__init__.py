"""OpenAI Responses API: /v1/responses and its store, compaction and SSE events."""
