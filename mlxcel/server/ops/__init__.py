"""Observability routes: /props, /slots, /metrics, /v1/cache/*."""
