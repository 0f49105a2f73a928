"""The one error type of media access."""

from __future__ import annotations


class MediaError(ValueError):
    """Media named by a request cannot be used; the message is fit for the client (HTTP 400)."""
