"""GPU check: the engine on one accelerator, in one process, no Ray. Under 5 minutes on a GPU.

Run: ``python -m load_tests.gpu_check [--device cuda] [--dtype bfloat16] [--json out.json]``;
``--device cpu --quick`` is the smoke run that works anywhere.

1. Greedy equality: a few chat prompts, each prefilled, its KV package shipped as Ray ships it
   (pickle protocol 5, buffers out of band) and decoded; the tokens must equal the model's own
   ``generate(do_sample=False)`` on the same device and dtype. Also reported, not required:
   the same prompts decoded together in one batch (rows of different lengths attend under a
   mask, another kernel, and in bfloat16 a near-tie may flip).
2. Step timings at batch 1, 8, 32 and 64: one prefill forward over B prompts of
   ``--prompt-len`` tokens, and one decode step (forward + greedy pick) of B rows at that
   context; median of several, each synchronized.
3. The KV package of one ``--prompt-len`` prompt: bytes, bytes per token, in-band metadata.
4. Its transfers: device -> host through pinned memory (``KVPackage.from_tensor``, what
   prefill does) and to pageable memory for comparison; host -> device from pageable memory
   (``kv_tensor``, what decode does) and through pinned staging for comparison.

Prints a table; exits 1 when a prompt's greedy tokens differ from ``generate()``. The greedy
equality alone is also a test, ``tests/gpu/test_engine_gpu.py`` (marker ``gpu``, skipped
without CUDA); the timings are this benchmark's own.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from app.config import EngineConfig
from app.decode import Decoder
from app.engine_core import EngineCore
from app.kv_cache import DEFAULT_BLOCK_SIZE, contiguous_tables
from app.kv_package import KVPackage, serialized_sizes, stage_to_host
from app.messages import PrefillRequest
from app.sampling import SamplingParams
from app.sequence import Sequence

BATCH_SIZES = (1, 8, 32, 64)
CHAT_PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "What is the capital of France, and what river runs through it?",
)


@dataclass
class Divergence:
    """Where the engine's greedy tokens first leave generate()'s, and whether that is a tie
    within the dtype's rounding: the two tokens' logits in one full forward of the model over
    the common prefix (a third computation, neither the engine's nor generate()'s cache)."""
    at: int  # first output index that differs
    engine_token: int
    generate_token: int
    logit_gap: float  # |logit(engine's) - logit(generate()'s)|
    tolerance: float  # 2 x eps(dtype) x the larger |logit|: two roundings of the dtype

    @property
    def near_tie(self) -> bool:
        return self.logit_gap <= self.tolerance


@dataclass
class GreedyResult:
    prompt_tokens: int
    expected: list[int]  # generate()
    alone: list[int]  # this engine, the request decoded on its own
    batched: list[int]  # this engine, all greedy prompts in one batch
    divergence: Divergence | None = None  # of ``alone``, where it differs

    @property
    def equal_alone(self) -> bool:
        return self.alone == self.expected

    @property
    def agrees_alone(self) -> bool:
        """Equal to generate(), or equal up to a token where the two are tied within the
        dtype's rounding (after which the texts go their own ways)."""
        return self.equal_alone or (self.divergence is not None and self.divergence.near_tie)

    @property
    def equal_batched(self) -> bool:
        return self.batched == self.expected


@dataclass
class StepTiming:
    phase: str  # "prefill" | "decode"
    batch: int
    tokens_per_step: int  # prompt tokens (prefill) or rows (decode) per forward
    ms: float  # median per step

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / (self.ms / 1000) if self.ms > 0 else float("inf")


@dataclass
class Transfer:
    name: str
    nbytes: int
    ms: float  # median
    used: bool  # the path the engine takes

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / (self.ms / 1000) / 1e9 if self.ms > 0 else float("inf")


@dataclass
class CheckReport:
    device: str
    device_name: str
    dtype: str
    kv_dtype: str
    greedy: list[GreedyResult] = field(default_factory=list)
    steps: list[StepTiming] = field(default_factory=list)
    kv_tokens: int = 0
    kv_bytes: int = 0
    kv_inband_bytes: int = 0
    transfers: list[Transfer] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.greedy) and all(g.agrees_alone for g in self.greedy)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["ok"] = self.ok
        for g, d in zip(self.greedy, out["greedy"], strict=True):
            d.update(equal_alone=g.equal_alone, equal_batched=g.equal_batched,
                     agrees_alone=g.agrees_alone)
        for s, d in zip(self.steps, out["steps"], strict=True):
            d["tokens_per_s"] = s.tokens_per_s
        for t, d in zip(self.transfers, out["transfers"], strict=True):
            d["gb_per_s"] = t.gb_per_s
        return out


def _devices(core: EngineCore) -> list[torch.device]:
    runner = core.runner
    return sorted({runner.device, runner.output_device, *runner.layer_devices}, key=str)


def _sync(devices: list[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], object], devices: list[torch.device], repeats: int,
              warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    _sync(devices)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(devices)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ship(package: KVPackage) -> KVPackage:
    """The package as a decode replica receives it: pickle protocol 5, out-of-band buffers."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(package, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=[bytes(b.raw()) for b in buffers])


def _decode(core: EngineCore, packages: list[KVPackage], eos: frozenset[int]) -> list[list[int]]:
    """Greedy-decode the packages together in one batch; their output tokens."""
    runner = core.runner
    decoder = Decoder(runner, eos_token_ids=eos, max_batch_size=max(1, len(packages)),
                      max_kv_tokens=core.config.max_kv_tokens)
    seqs = []
    for pkg in packages:
        seq = Sequence(pkg.request_id, pkg.prompt_ids, pkg.sampling)
        seq.append(pkg.first_token, eos_token_ids=eos, max_model_len=runner.max_model_len)
        if not seq.is_finished:
            decoder.add(seq, pkg)
        seqs.append(seq)
    while decoder.has_work:
        decoder.step()
    return [s.output_token_ids for s in seqs]


def _generate(model: torch.nn.Module, device: torch.device, prompt: list[int], n: int,
              eos: frozenset[int]) -> list[int]:
    """The model's own greedy generate(), stopping at the same EOS ids as the engine."""
    assert eos, "give the model's EOS ids: generate() would otherwise use its own config's"
    ids = torch.tensor([prompt], device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # generation-config notes about sampling fields
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, eos_token_id=sorted(eos),
                             pad_token_id=min(eos))
    return out[0, len(prompt):].tolist()


def divergence(core: EngineCore, prompt: list[int], got: list[int],
               expected: list[int]) -> Divergence | None:
    """The first token where ``got`` leaves ``expected`` and the two tokens' logits there
    (:class:`Divergence`); None where they are equal or one merely stops early."""
    at = next((j for j, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    if at is None:
        return None
    ids = torch.tensor([prompt + expected[:at]], device=core.runner.device)
    logits = core.model(ids).logits[0, -1].float()
    a, b = logits[got[at]].item(), logits[expected[at]].item()
    eps = torch.finfo(core.runner.dtype).eps
    return Divergence(at, got[at], expected[at], abs(a - b), 2 * eps * max(abs(a), abs(b)))


def check_greedy(core: EngineCore, prompts: list[list[int]], max_new_tokens: int,
                 eos: frozenset[int]) -> list[GreedyResult]:
    sampling = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    reqs = [PrefillRequest(f"g{i}", tuple(p), sampling) for i, p in enumerate(prompts)]
    packages = [_ship(p) for p in core.make_prefiller().make_packages(reqs)]
    alone = [_decode(core, [p], eos)[0] for p in packages]
    batched = _decode(core, packages, eos)
    out = []
    for p, a, b in zip(prompts, alone, batched, strict=True):
        expected = _generate(core.model, core.runner.device, p, max_new_tokens, eos)
        out.append(GreedyResult(len(p), expected, a, b, divergence(core, p, a, expected)))
    return out


def time_steps(core: EngineCore, batch_sizes: list[int], prompt_len: int, decode_steps: int,
               repeats: int, rng: random.Random) -> list[StepTiming]:
    runner = core.runner
    devices = _devices(core)
    prompts = [[rng.randrange(3, runner.vocab_size) for _ in range(prompt_len)]
               for _ in range(max(batch_sizes))]
    _, [one_kv] = runner.forward_prefill(prompts[:1])  # [layers, 2, kv_heads, prompt_len, head_dim]
    out = []
    for bsz in batch_sizes:
        batch = prompts[:bsz]
        prefill_s = _median_s(lambda b=batch: runner.forward_prefill(b), devices, repeats)
        out.append(StepTiming("prefill", bsz, bsz * prompt_len, prefill_s * 1000))

        warmup = 2
        tables = contiguous_tables(bsz, prompt_len + warmup + decode_steps + 1,
                                   DEFAULT_BLOCK_SIZE)
        cache = runner.make_kv_cache(bsz * len(tables[0]), DEFAULT_BLOCK_SIZE)
        for table in tables:
            cache.write(table, one_kv)
        state = {"tokens": [prompts[0][-1]] * bsz, "pos": prompt_len}

        def step(cache=cache, tables=tables, bsz=bsz, state=state) -> None:
            logits = runner.decode(cache, tables, state["tokens"], [state["pos"]] * bsz)
            state["tokens"] = logits.argmax(dim=-1).tolist()  # a real step needs them
            state["pos"] += 1

        decode_s = _median_s(step, devices, decode_steps, warmup=warmup)
        out.append(StepTiming("decode", bsz, bsz, decode_s * 1000))
        del cache
    return out


def measure_kv(core: EngineCore, report: CheckReport, prompt_len: int, repeats: int,
               rng: random.Random) -> None:
    """KV package size and its trips off and onto the device."""
    runner = core.runner
    devices = _devices(core)
    prompt = [rng.randrange(3, runner.vocab_size) for _ in range(prompt_len)]
    _, [kv] = runner.forward_prefill([prompt])  # on runner.kv_device

    def package() -> KVPackage:
        return KVPackage.from_tensor(
            request_id="kv", fingerprint=core.fingerprint, kv=kv, prompt_token_ids=prompt,
            first_token=0, sampling=SamplingParams(max_tokens=1, temperature=0.0),
            vocab_size=runner.vocab_size, created_at=time.time())

    pkg = _ship(package())
    inband, oob = serialized_sizes(pkg)
    report.kv_tokens, report.kv_bytes, report.kv_inband_bytes = prompt_len, oob, inband
    nbytes = pkg.kv_nbytes
    target = runner.kv_device
    host = pkg.kv_tensor("cpu")  # pageable, as an object-store buffer is
    transfers = [
        ("device->host, pinned (from_tensor)", lambda: package(), True),
        ("device->host, pageable", lambda: kv.to("cpu"), False),
        ("host->device, pageable (kv_tensor)", lambda: pkg.kv_tensor(target), True),
        ("host->device, pinned staging",
         lambda: stage_to_host(host, pin=target.type == "cuda").to(target, non_blocking=True),
         False),
    ]
    for name, fn, used in transfers:
        ms = _median_s(fn, devices, repeats) * 1000
        report.transfers.append(Transfer(name, nbytes, ms, used))


def run_check(model: torch.nn.Module, config: EngineConfig, *, greedy_prompts: list[list[int]],
              max_new_tokens: int, eos_token_ids: frozenset[int], batch_sizes: list[int],
              prompt_len: int, decode_steps: int, repeats: int, seed: int = 0) -> CheckReport:
    """Everything above on an already loaded model; the CLI and the unit test call this."""
    start = time.perf_counter()
    core = EngineCore(config, model=model)
    device = core.runner.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = CheckReport(device=str(device), device_name=name, dtype=config.dtype,
                         kv_dtype=core.runner.layout.kv_dtype)
    rng = random.Random(seed)
    with torch.inference_mode():
        report.greedy = check_greedy(core, greedy_prompts, max_new_tokens, eos_token_ids)
        report.steps = time_steps(core, batch_sizes, prompt_len, decode_steps, repeats, rng)
        measure_kv(core, report, prompt_len, repeats, rng)
    report.wall_s = time.perf_counter() - start
    return report


def format_report(report: CheckReport, model_name: str) -> str:
    lines = [f"GPU check: {model_name} on {report.device} ({report.device_name}), "
             f"weights {report.dtype}, KV {report.kv_dtype}, torch {torch.__version__}", ""]
    alone = sum(g.equal_alone for g in report.greedy)
    batched = sum(g.equal_batched for g in report.greedy)
    lines.append(f"greedy == generate(): {alone}/{len(report.greedy)} prompts decoded alone "
                 f"(required), {batched}/{len(report.greedy)} decoded as one batch")
    agree = sum(g.agrees_alone for g in report.greedy)
    lines.append(f"  alone, equal or leaving it only at a tie within {report.dtype}'s rounding: "
                 f"{agree}/{len(report.greedy)}")
    for i, g in enumerate(report.greedy):
        if not g.equal_alone:
            pairs = zip(g.alone, g.expected, strict=False)
            at = next((j for j, (a, b) in enumerate(pairs) if a != b),
                      min(len(g.alone), len(g.expected)))
            lines.append(f"  prompt {i} ({g.prompt_tokens} tokens) differs at output {at}: "
                         f"{g.alone[at:at + 4]} vs generate {g.expected[at:at + 4]}")
            if g.divergence:
                d = g.divergence
                lines.append(f"    full-forward logit gap {d.logit_gap:.4f} "
                             f"({'within' if d.near_tie else 'beyond'} the tolerance "
                             f"{d.tolerance:.4f})")
    lines += ["", f"{'phase':<8} {'batch':>5} {'tokens/step':>11} {'ms/step':>9} "
                  f"{'tokens/s':>10}"]
    for s in report.steps:
        lines.append(f"{s.phase:<8} {s.batch:>5} {s.tokens_per_step:>11} {s.ms:>9.2f} "
                     f"{s.tokens_per_s:>10.0f}")
    per_token = report.kv_bytes / report.kv_tokens if report.kv_tokens else 0
    lines += ["", f"KV package: {report.kv_tokens} tokens, {report.kv_bytes / 2**20:.2f} MiB "
                  f"({per_token:.0f} B/token), metadata in band {report.kv_inband_bytes} B", "",
              f"{'transfer of the KV package':<38} {'MiB':>8} {'ms':>8} {'GB/s':>7}"]
    for t in report.transfers:
        mark = " *" if t.used else ""
        lines.append(f"{t.name:<38} {t.nbytes / 2**20:>8.2f} {t.ms:>8.3f} "
                     f"{t.gb_per_s:>7.2f}{mark}")
    lines += ["(* the path the engine takes)", "", f"wall time {report.wall_s:.1f} s"]
    return "\n".join(lines)


def load_greedy_inputs(config: EngineConfig, texts: tuple[str, ...] | list[str]
                       ) -> tuple[torch.nn.Module, list[list[int]], frozenset[int]]:
    """The model through the project's loader, the chat prompts of ``texts`` as token ids and
    the model's EOS ids: what :func:`check_greedy` needs (the CLI and tests/gpu use this)."""
    from app.chat import PromptBuilder
    from app.model_loader import load_model, load_tokenizer

    model = load_model(config)
    prompts = PromptBuilder(load_tokenizer(config))
    eos = prompts.eos_token_ids(getattr(model, "generation_config", None))
    return model, [prompts.encode_chat([{"role": "user", "content": t}]) for t in texts], eos


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m load_tests.gpu_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=EngineConfig().model)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="weights dtype; default bfloat16 on a GPU, float32 on the cpu")
    p.add_argument("--kv-dtype", default=None, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device-map", default=None,
                   help="spread the model over --num-gpus GPUs (auto, balanced, ...)")
    p.add_argument("--num-gpus", type=int, default=1)
    p.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--repeats", type=int, default=5, help="timed prefills / transfers")
    p.add_argument("--max-new-tokens", type=int, default=32, help="greedy check length")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: batches 1 and 8, 32-token prompts, few repeats")
    p.add_argument("--json", default=None, help="also write the report here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.batch_sizes, args.prompt_len, args.decode_steps = "1,8", 32, 3
        args.repeats, args.max_new_tokens = 2, 8
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    config = EngineConfig(model=args.model, dtype=dtype, kv_dtype=args.kv_dtype,
                          device=args.device, device_map=args.device_map,
                          num_gpus=args.num_gpus,
                          max_kv_tokens=max(65536, 64 * (args.prompt_len + 64)))
    texts = CHAT_PROMPTS[:2] if args.quick else CHAT_PROMPTS
    model, greedy_prompts, eos = load_greedy_inputs(config, texts)
    report = run_check(
        model, config, greedy_prompts=greedy_prompts, max_new_tokens=args.max_new_tokens,
        eos_token_ids=eos, batch_sizes=[int(b) for b in args.batch_sizes.split(",")],
        prompt_len=args.prompt_len, decode_steps=args.decode_steps, repeats=args.repeats)
    print(format_report(report, args.model))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, **report.as_dict()}, f, indent=2)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
