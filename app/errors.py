"""Typed engine errors. The HTTP layer maps each class to a status code and an OpenAI error body."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""

    #: OpenAI error ``type`` field.
    error_type: str = "internal_error"
    #: HTTP status the ingress answers with.
    status_code: int = 500

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(EngineError):
    """The client's request cannot be served as sent (HTTP 400)."""

    error_type = "invalid_request_error"
    status_code = 400


class ContextLengthError(InvalidRequestError):
    """Prompt, or prompt plus ``max_tokens``, does not fit in the model context (HTTP 400)."""

    def __init__(self, message: str, *, param: str | None = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class ModelNotFoundError(EngineError):
    """The request names a model this server does not serve (HTTP 404)."""

    error_type = "invalid_request_error"
    status_code = 404

    def __init__(self, message: str, *, param: str | None = "model") -> None:
        super().__init__(message, param=param, code="model_not_found")


class QueueFullError(EngineError):
    """A bounded queue is full; the client should retry later (HTTP 429 with Retry-After)."""

    error_type = "rate_limit_error"
    status_code = 429

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message, code="queue_full")
        self.retry_after_s = retry_after_s


class KVPackageMismatchError(EngineError):
    """A KV package was made by another model, dtype or layout than this engine's."""

    error_type = "server_error"
    status_code = 500

    def __init__(self, message: str) -> None:
        super().__init__(message, code="kv_package_mismatch")


class ModelLoadError(EngineError):
    """The configured model cannot be resolved or loaded; the message says what to do."""

    error_type = "server_error"
    status_code = 500
