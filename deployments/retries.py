"""What a lost replica means for a request: the errors that a re-run on another replica can
fix (``RETRYABLE_ERRORS``, docs/architecture.md's failure policy), the engine error inside
Ray's wrapper (``unwrap_error``), the request that resumes a stream after the tokens it
delivered (``resume_request``) and the request of one answer of several, which a retry of
that answer prefills (``choice_request``). ``deployments.split_path.SplitPath`` uses them.
"""

from __future__ import annotations

import dataclasses

import ray
from ray import serve

from app.errors import ReplicaUnhealthyError, ServiceUnavailableError
from app.messages import PrefillRequest

# A replica, its worker or its node went away, or the KV object was lost with them: the
# request can be re-run elsewhere (docs/architecture.md, failure policy).
RETRYABLE_ERRORS: tuple[type[BaseException], ...] = (
    ray.exceptions.RayActorError,  # ActorDiedError, ActorUnavailableError
    ray.exceptions.ObjectLostError,  # OwnerDiedError, ObjectReconstructionFailedError...
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.NodeDiedError,
    serve.exceptions.DeploymentUnavailableError,
    ReplicaUnhealthyError,  # a decode replica found itself wedged and gave up its streams
)


def unwrap_error(exc: BaseException) -> BaseException:
    """The engine error inside a Ray task error, if there is one; Serve's back-pressure as
    the 503 it means."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, BaseException):
        return cause
    if isinstance(exc, serve.exceptions.BackPressureError):
        return ServiceUnavailableError(f"a phase is at capacity: {exc}", retry_after_s=1.0,
                                       code="backpressure")
    return exc


def is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, RETRYABLE_ERRORS) or isinstance(unwrap_error(exc), RETRYABLE_ERRORS)


def resume_request(preq: PrefillRequest, delivered: list[int], attempt: int) -> PrefillRequest:
    """The request that continues ``preq`` after ``delivered`` tokens: the prompt plus those
    tokens, sampling continuing at the same output index."""
    return PrefillRequest(
        f"{preq.request_id}-retry{attempt}",
        preq.prompt_token_ids + tuple(delivered),
        dataclasses.replace(preq.sampling, max_tokens=preq.sampling.max_tokens - len(delivered)),
        output_offset=preq.output_offset + len(delivered),
    )


def choice_request(preq: PrefillRequest, k: int) -> PrefillRequest:
    """Answer ``k`` of a request for several (``n``), as a request of its own: what a retry of
    that answer prefills again (its own id and seed, the same prompt)."""
    return PrefillRequest(f"{preq.request_id}/{k}", preq.prompt_token_ids,
                          preq.sampling.for_choice(k), output_offset=preq.output_offset)
