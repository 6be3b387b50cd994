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


class NotFoundError(EngineError):
    """The route exists but what it serves is turned off or missing (HTTP 404)."""

    error_type = "invalid_request_error"
    status_code = 404


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


class ServiceUnavailableError(EngineError):
    """A phase is overloaded or unreachable right now (HTTP 503 with Retry-After)."""

    error_type = "service_unavailable_error"
    status_code = 503

    def __init__(self, message: str, *, retry_after_s: float = 1.0,
                 code: str = "service_unavailable") -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class RequestTimeoutError(EngineError):
    """The request ran past the server's request timeout; its work was stopped (HTTP 504)."""

    error_type = "timeout_error"
    status_code = 504

    def __init__(self, message: str) -> None:
        super().__init__(message, code="request_timeout")


class PayloadTooLargeError(InvalidRequestError):
    """The request body is over the size limit (HTTP 413)."""

    status_code = 413

    def __init__(self, message: str) -> None:
        super().__init__(message, code="payload_too_large")


class AuthenticationError(EngineError):
    """Missing or wrong API key (HTTP 401)."""

    error_type = "authentication_error"
    status_code = 401

    def __init__(self, message: str = "missing or invalid API key") -> None:
        super().__init__(message, code="invalid_api_key")


class ReplicaUnhealthyError(ServiceUnavailableError):
    """A replica found itself wedged and gave up its streams; the ingress re-runs them on
    another replica."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after_s=1.0, code="replica_unhealthy")
