"""``python -m app generate``: JSON output equal to the model's greedy decode; clean errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.chat import PromptBuilder
from tests.conftest import hf_greedy

ROOT = Path(__file__).resolve().parents[3]


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "app", "generate", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )


@pytest.mark.smollm
def test_generate_json_matches_greedy(smollm_model, smollm_tokenizer):
    prompt = "What is the capital of France?"
    proc = _cli("--prompt", prompt, "--chat", "--max-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    ids = result["token_ids"]
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    assert 1 <= len(ids) <= 8
    assert isinstance(result["text"], str) and result["text"]
    assert result["finish_reason"] in ("stop", "length")
    if result["finish_reason"] == "length":
        assert len(ids) == 8
    else:
        assert ids[-1] == 2

    prompt_ids = PromptBuilder(smollm_tokenizer).encode_chat([{"role": "user", "content": prompt}])
    assert result["prompt_token_ids"] == prompt_ids
    assert ids == hf_greedy(smollm_model, prompt_ids, 8, eos=2)
    assert result["text"] == smollm_tokenizer.decode(ids, skip_special_tokens=True)
    assert result["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                               "total_tokens": len(prompt_ids) + len(ids)}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-tokens", "0"], "max_tokens must be >= 1, got 0"),
        (["--threads", "0", "--top-p", "0.5"], "num_threads must be >= 1, got 0"),
        (["--model", "/nonexistent/splitserve-model"], "neither a .gguf file nor a model"),
    ],
)
def test_invalid_arguments_exit_with_message(args, message):
    proc = _cli("--prompt", "hi", *args, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert proc.stderr.lstrip().startswith("error:")
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
