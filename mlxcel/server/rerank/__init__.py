"""Rerank routes: /v1/rerank, /v1/reranking, /rerank, /reranking (Jina/Cohere and TEI shapes)."""
