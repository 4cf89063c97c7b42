"""Exceptions raised for bad input. Each names what is wrong and what to do about it."""


class JaxInferError(Exception):
    """Base class of every error jaxinfer raises on purpose."""


class UnsupportedArchitectureError(JaxInferError, ValueError):
    """config.json names an architecture no registered model implements."""


class ConfigError(JaxInferError, ValueError):
    """config.json or generation_config.json is missing, malformed, or holds a value of the wrong type or
    range (or one the checkpoint's tensors contradict); or an engine option is."""


class CheckpointError(JaxInferError, ValueError):
    """The checkpoint's files or tensors are unusable: missing, unexpected, mis-shaped, duplicated,
    non-floating or non-finite tensors, malformed files, files outside the folder, pickles."""


class InvalidRequestError(JaxInferError, ValueError):
    """A prompt or sampling parameter the engine cannot serve."""


class TokenizerUnavailableError(JaxInferError, RuntimeError):
    """Text was given but there is no tokenizer, or the checkpoint's tokenizer cannot be loaded (malformed
    files, or code shipped with the checkpoint that it would need)."""


class CompilationAfterWarmupError(JaxInferError, RuntimeError):
    """Strict mode: something was traced or compiled after the start-up warm-up."""


class KernelNotSupportedError(JaxInferError, ValueError):
    """An implementation forced on an op (``jaxinfer.kernels.registry.force``) cannot take a call."""


class ExportError(JaxInferError, ValueError):
    """An export directory that cannot be used: missing, malformed or tampered manifest, program files
    that are missing, truncated or altered."""


class ExportMismatchError(ExportError):
    """An export made for something else: another checkpoint or config.json, other engine options,
    another jax / jaxlib version, device kind or device count."""
