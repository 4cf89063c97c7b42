"""jaxinfer: a JAX/Pallas LLM inference engine with HuggingFace-identical model semantics."""

from jaxinfer.config import ModelConfig
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.llm import LLM, GenerationOutput
from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.errors import (
    CheckpointError,
    CompilationAfterWarmupError,
    ConfigError,
    ExportError,
    ExportMismatchError,
    InvalidRequestError,
    JaxInferError,
    TokenizerUnavailableError,
    UnsupportedArchitectureError,
)
from jaxinfer.loader import LoadedModel, load_model
from jaxinfer.registry import ModelRegistry

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "CompilationAfterWarmupError", "ConfigError", "EngineConfig", "ExportError",
    "ExportMismatchError", "GenerationOutput",
    "InvalidRequestError", "JaxInferError", "LLM", "LoadedModel", "ModelConfig", "ModelRegistry",
    "SamplingParams", "TokenizerUnavailableError", "UnsupportedArchitectureError", "load_model",
]
