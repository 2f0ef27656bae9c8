"""minillm: LLM inference from scratch, one lesson at a time."""

from .loading import ModelLoadError, load_model
from .model import ModelConfig, Transformer

__all__ = ["load_model", "ModelLoadError", "ModelConfig", "Transformer"]
