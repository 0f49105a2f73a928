"""OpenAI image routes: /v1/images/generations and /v1/images/edits (and /images/* aliases)."""

from mlxcel.server.images.routes import IMAGE_ROUTES, image_only_router, router

__all__ = ["IMAGE_ROUTES", "image_only_router", "router"]
