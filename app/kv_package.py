"""The KV package: what prefill hands to decode through the object store.

Layout: one contiguous array ``kv`` of shape ``[layers, 2, kv_heads, seq_len, head_dim]``
(index 0 of the second axis holds keys after rotary embedding, 1 values), in the KV dtype.
Arrays are numpy so that Ray's serializer (pickle protocol 5) places them in shared memory
out of band, without copying; bfloat16 travels as its uint16 bit pattern. The rest is a few
hundred bytes of plain metadata: no pickled transformers objects.

On a GPU the KV leaves through pinned host memory (one DMA at full link bandwidth, then the
object store copies it into shared memory); decode copies it from the object store straight
onto its own GPU.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from app.config import dtype_name, parse_dtype
from app.errors import KVPackageMismatchError
from app.sampling import SamplingParams, TokenLogprobs

# numpy cannot hold bfloat16; those tensors travel as their raw 16-bit pattern.
_WIRE_DTYPES: dict[str, type[np.generic]] = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape facts a decoder checks before it accepts a package."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _itemsize(self.kv_dtype)


def _itemsize(dtype: str) -> int:
    return torch.tensor([], dtype=parse_dtype(dtype)).element_size()


def device_to_host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor with the values of ``t``: ``t`` itself on the CPU (no copy);
    from a GPU, a pinned copy that is complete when this returns."""
    if t.device.type != "cuda":
        return t.to("cpu").contiguous()
    return stage_to_host(t, pin=True)


def stage_to_host(t: torch.Tensor, *, pin: bool) -> torch.Tensor:
    """Copy ``t`` into a new host buffer, page-locked when ``pin``.

    From page-locked memory the GPU's copy engine writes at full link bandwidth, where a copy
    to pageable memory goes through the driver's own staging buffer. The buffer comes from
    torch's caching host allocator, so a prefill replica in steady state pins no new memory.
    The copy is issued asynchronously and waited for here: Ray reads the buffer as soon as the
    package is returned.
    """
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    host.copy_(t, non_blocking=pin)
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()
    return host


@dataclass(slots=True)
class KVPackage:
    """One request's prefill result: its KV cache, first token and sampling state."""

    request_id: str
    fingerprint: str
    layout: KVLayout
    kv: np.ndarray  # [layers, 2, kv_heads, seq_len, head_dim], wire dtype
    prompt_token_ids: np.ndarray  # [seq_len], uint16 when the vocabulary fits, else int32
    first_token: int
    sampling: SamplingParams
    created_at: float  # time.time() when prefill returned it (KV-hop timing)
    prefill_s: float = 0.0  # compute time of the passes this request was prefilled in
    output_offset: int = 0  # output index of first_token (non-zero for a resumed stream)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # n > 1: answer k's first token (sampled with sampling.for_choice(k)); () for n = 1
    choice_first_tokens: tuple[int, ...] = ()
    first_logprobs: TokenLogprobs | None = None  # when the request asked for logprobs
    choice_first_logprobs: tuple[TokenLogprobs | None, ...] = ()  # n > 1, as the tokens

    @property
    def seq_len(self) -> int:
        return int(self.kv.shape[3])

    @property
    def prompt_ids(self) -> list[int]:
        return [int(t) for t in self.prompt_token_ids]

    @property
    def kv_nbytes(self) -> int:
        return int(self.kv.nbytes)

    @classmethod
    def from_tensor(
        cls,
        *,
        request_id: str,
        fingerprint: str,
        kv: torch.Tensor,
        prompt_token_ids: list[int],
        first_token: int,
        sampling: SamplingParams,
        vocab_size: int,
        created_at: float,
        prefill_s: float = 0.0,
        output_offset: int = 0,
        cached_tokens: int = 0,
        choice_first_tokens: tuple[int, ...] = (),
        first_logprobs: TokenLogprobs | None = None,
        choice_first_logprobs: tuple[TokenLogprobs | None, ...] = (),
    ) -> KVPackage:
        # kv: [layers, 2, kv_heads, seq_len, head_dim], contiguous, on any device
        assert kv.dim() == 5 and kv.shape[1] == 2, f"bad KV shape {tuple(kv.shape)}"
        assert kv.shape[3] == len(prompt_token_ids), "KV length != prompt length"
        kv_dtype = dtype_name(kv.dtype)
        host = device_to_host(kv.detach())
        if kv.dtype == torch.bfloat16:
            host = host.view(torch.uint16)
        ids_dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
        return cls(
            request_id=request_id,
            fingerprint=fingerprint,
            layout=KVLayout(int(kv.shape[0]), int(kv.shape[2]), int(kv.shape[4]), kv_dtype),
            kv=host.numpy(),
            prompt_token_ids=np.asarray(prompt_token_ids, dtype=ids_dtype),
            first_token=first_token,
            sampling=sampling,
            created_at=created_at,
            prefill_s=prefill_s,
            output_offset=output_offset,
            cached_tokens=cached_tokens,
            choice_first_tokens=choice_first_tokens,
            first_logprobs=first_logprobs,
            choice_first_logprobs=choice_first_logprobs,
        )

    def for_choice(self, k: int) -> KVPackage:
        """Answer ``k`` of a package made for several: its own request id, first token (and
        its logprobs) and seed, the same KV (shared, not copied)."""
        if not self.choice_first_tokens:
            if k != 0:
                raise ValueError(f"package {self.request_id} holds one answer, not answer {k}")
            return self
        return dataclasses.replace(
            self, request_id=f"{self.request_id}/{k}", first_token=self.choice_first_tokens[k],
            first_logprobs=self.choice_first_logprobs[k], sampling=self.sampling.for_choice(k),
            choice_first_tokens=(), choice_first_logprobs=())

    def kv_tensor(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """The KV as a torch tensor on ``device`` (zero-copy on CPU);
        [layers, 2, kv_heads, seq, head_dim].

        To a GPU it is one copy from the object store's (pageable) memory. Staging it through
        pinned memory first would add a host copy of the same size as the driver's own
        staging and only buy an asynchronous transfer, which the decode loop cannot use: the
        step that reads the KV runs right after, on the same stream.
        ``load_tests/gpu_check.py`` measures both ways.
        """
        with warnings.catch_warnings():
            # object-store buffers are read-only; the tensor is only ever read (copied from)
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy(self.kv)
        if self.layout.kv_dtype == "bfloat16":
            t = t.view(torch.bfloat16)
        return t.to(device, non_blocking=True)

    def check_compatible(self, fingerprint: str, layout: KVLayout) -> None:
        """Raise :class:`KVPackageMismatchError` unless this package fits the given engine."""
        if self.fingerprint != fingerprint:
            raise KVPackageMismatchError(
                f"KV package {self.request_id} was made by model {self.fingerprint}, "
                f"this decoder runs {fingerprint}"
            )
        if self.layout != layout:
            raise KVPackageMismatchError(
                f"KV package {self.request_id} has layout {self.layout}, decoder expects {layout}"
            )
        expected = (layout.num_layers, 2, layout.num_kv_heads, self.seq_len, layout.head_dim)
        wire = _WIRE_DTYPES[layout.kv_dtype]
        if tuple(self.kv.shape) != expected or self.kv.dtype != wire:
            raise KVPackageMismatchError(
                f"KV package {self.request_id} holds {self.kv.dtype}{tuple(self.kv.shape)}, "
                f"expected {np.dtype(wire)}{expected}"
            )
        if len(self.prompt_token_ids) != self.seq_len or self.seq_len < 1:
            raise KVPackageMismatchError(f"KV package {self.request_id} has inconsistent lengths")


def serialized_sizes(obj: object) -> tuple[int, int]:
    """(in-band bytes, out-of-band buffer bytes) of ``obj`` under pickle protocol 5.

    This is how Ray serializes: out-of-band buffers go to shared memory without a copy, the
    in-band part is the metadata.
    """
    buffers: list[pickle.PickleBuffer] = []
    inband = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return len(inband), sum(memoryview(b).nbytes for b in buffers)
