"""The one error type of media decoding and access."""

from __future__ import annotations


class MediaError(ValueError):
    """Media cannot be used; the message is fit for the client (HTTP 400) or the CLI user."""
