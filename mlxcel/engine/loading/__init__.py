"""Model loading: references → loaded models."""

from mlxcel.engine.loading.model import LoadedModel, ModelInfo
from mlxcel.engine.loading.resolve import load_model

__all__ = ["LoadedModel", "ModelInfo", "load_model"]
