"""On a CUDA GPU, the engine's greedy tokens equal the model's own ``generate(do_sample=False)``
(SmolLM2 through the project's loader, bfloat16, each prompt's KV package shipped as Ray ships
it, then decoded alone). The correctness half of ``load_tests/gpu_check.py``, whose timings
stay a benchmark; skipped where no GPU exists."""

from __future__ import annotations

import pytest
import torch

from app.config import EngineConfig
from load_tests.gpu_check import CHAT_PROMPTS, check_greedy, load_greedy_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.smollm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_NEW_TOKENS = 32  # the GPU check's default length


@pytest.fixture(scope="module")
def gpu_greedy():
    from app.engine_core import EngineCore

    config = EngineConfig(device="cuda", dtype="bfloat16")
    model, prompts, eos = load_greedy_inputs(config, CHAT_PROMPTS)
    core = EngineCore(config, model=model)
    with torch.inference_mode():
        return check_greedy(core, prompts, MAX_NEW_TOKENS, eos)


def test_greedy_tokens_equal_generate_on_the_gpu(gpu_greedy):
    assert len(gpu_greedy) == len(CHAT_PROMPTS)
    for i, g in enumerate(gpu_greedy):
        assert g.expected, f"prompt {i}: generate() gave no tokens"
        # equal, or leaving generate() only where the two tokens tie within bf16's rounding
        # (a full forward's logits; load_tests.gpu_check.Divergence)
        assert g.agrees_alone, f"prompt {i} ({g.prompt_tokens} tokens) differs: {g.divergence}"
