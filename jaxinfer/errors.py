"""Exceptions raised for bad input. Each names what is wrong and what to do about it."""


class JaxInferError(Exception):
    """Base class of every error jaxinfer raises on purpose."""


class UnsupportedArchitectureError(JaxInferError, ValueError):
    """config.json names an architecture no registered model implements."""


class ConfigError(JaxInferError, ValueError):
    """config.json is missing a required value or holds one the model does not support."""


class CheckpointError(JaxInferError, ValueError):
    """The checkpoint's tensors do not match what the model expects (missing, unexpected, mis-shaped)."""


class InvalidRequestError(JaxInferError, ValueError):
    """A prompt or sampling parameter the engine cannot serve."""


class TokenizerUnavailableError(JaxInferError, RuntimeError):
    """Text was given but the checkpoint folder holds no tokenizer files."""


class CompilationAfterWarmupError(JaxInferError, RuntimeError):
    """Strict mode: something was traced or compiled after the start-up warm-up."""
