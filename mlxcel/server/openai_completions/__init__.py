"""OpenAI text completions: POST /v1/completions."""
