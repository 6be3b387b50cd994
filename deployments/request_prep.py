"""The ingress's request preparation (``Ingress``'s share, a mixin): admission, the model
name, the prompt's tokens, the sampling settings and the length checks, so that every 4xx is
raised before any replica works; and the unknown fields a body carried (logged, and named in
``X-Ignored-Fields``).
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import quote

from pydantic import ValidationError

from app.chat import PromptBuilder
from app.errors import InvalidRequestError, ModelNotFoundError, QueueFullError
from app.messages import PrefillRequest
from app.model_loader import ModelShape
from app.sequence import validate_prompt
from app.tools import ToolMode
from deployments.admission import QueueWait
from deployments.args import AppArgs
from deployments.bodies import new_id
from deployments.metrics import IngressMetrics
from deployments.openai_api import IGNORED_FIELDS_HEADER, validation_error
from deployments.protocol import ChatCompletionRequest, Endpoint, GenerationRequest

logger = logging.getLogger(__name__)

MAX_IGNORED_REPORTED = 32  # unknown field names listed in X-Ignored-Fields


class RequestPrep:
    """Turns a validated body into a ``PrefillRequest`` (``prepare``). Stands on the
    ingress's ``args``, ``prompts``, ``shape``, ``model_name``, ``admission``, ``metrics``
    and ``in_flight``."""

    args: AppArgs
    prompts: PromptBuilder
    shape: ModelShape
    model_name: str
    admission: QueueWait | None
    metrics: IngressMetrics
    in_flight: int

    def parse(self, endpoint: Endpoint, body: Any) -> GenerationRequest:
        """A handle caller's body dict, validated like an HTTP body."""
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        try:
            return endpoint.request_model.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(
                f"model {model!r} is not served here; this server serves {self.model_name!r}")

    def ignored(self, body: Any, client_id: str) -> dict[str, str]:
        """Log the unknown fields of a body (once per request) and return the response header
        that reports them."""
        names = [quote(n, safe="._-~") for n in body.ignored_fields()]
        if not names:
            return {}
        # the names are the client's: percent-encoded, as a header must be ASCII and a log
        # line must stay one line; a header lists a bounded number of them
        logger.warning("request %s: ignored unknown fields: %s", client_id, ", ".join(names))
        shown = names[:MAX_IGNORED_REPORTED]
        if len(names) > len(shown):
            shown.append(f"...{len(names) - len(shown)} more")
        return {IGNORED_FIELDS_HEADER: ",".join(shown)}

    def prepare(self, endpoint: Endpoint, req: GenerationRequest,
                client_id: str) -> PrefillRequest:
        """Admit, tokenize and check a request against the model: every 4xx is raised here,
        before any replica is involved, and counted by its type. ``client_id``: the
        request's id to its client (``client_request_id``), which its internal id carries."""
        try:
            return self._prepare(endpoint, req, client_id)
        except Exception as exc:
            self.metrics.requests.inc(tags={"route": endpoint.value,
                                            "outcome": type(exc).__name__})
            raise

    def _prepare(self, endpoint: Endpoint, req: GenerationRequest,
                 client_id: str) -> PrefillRequest:
        if self.in_flight >= self.args.ingress.max_in_flight:
            raise QueueFullError(
                f"the server is at capacity ({self.in_flight} requests in flight); retry later",
                retry_after_s=1.0)
        if self.admission is not None:
            self.admission.admit()
        self.check_model(req.model)
        if isinstance(req, ChatCompletionRequest):
            ids = self.prompts.encode_chat(req.message_dicts(), tools=req.template_tools())
            default_max = self.args.default_max_tokens
        else:
            ids = self.prompts.encode_prompt(req.prompt)
            default_max = 16
        max_len = self.shape.max_model_len
        if req.max_tokens is None:
            # never let the default push a valid prompt over the context
            default_max = max(1, min(default_max, max_len - len(ids)))
        sampling = req.sampling_params(default_max, self.tool_parser(req)).with_seed()
        validate_prompt(ids, sampling, max_model_len=max_len, vocab_size=self.shape.vocab_size,
                        param=endpoint.prompt_param)
        return PrefillRequest(new_id(endpoint.id_prefix, client_id), tuple(ids), sampling,
                              n=req.n or 1)

    def tool_parser(self, req: GenerationRequest) -> str | None:
        return self.args.ingress.tool_call_parser if isinstance(req, ChatCompletionRequest) \
            else None

    def tool_mode(self, endpoint: Endpoint, req: GenerationRequest) -> ToolMode | None:
        """A chat answer's tool calls (``app.tools``), or None for text."""
        if endpoint is not Endpoint.CHAT or not isinstance(req, ChatCompletionRequest):
            return None
        return req.tool_mode(self.tool_parser(req))
