"""Embedding routes: OpenAI /v1/embeddings and llama-server's /embedding, /embeddings."""
