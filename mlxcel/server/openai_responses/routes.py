"""Routes (filled in by the feature work)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
