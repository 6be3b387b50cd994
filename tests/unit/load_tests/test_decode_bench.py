"""decode_bench's count of the bytes a decode step reads (its floor's size)."""

from __future__ import annotations

import pytest

from app.cpu_kernels import kernel_unavailable
from app.packed_linear import pack_linears
from load_tests.decode_bench import step_weight_bytes
from tests.conftest import make_tiny_model


@pytest.mark.skipif(kernel_unavailable() is not None, reason="the panel kernel does not build")
@pytest.mark.parametrize("weights, per_weight", [("float32", 4), ("bfloat16", 2)])
def test_a_step_reads_the_panels_and_a_tied_head_once(weights, per_weight):
    """Every linear is read as its panels, the tied LM head once (as its panels, not as the
    float32 embedding it shares), the embedding not at all, the norms as they are."""
    model = make_tiny_model(vocab_size=1024)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    linear = sum(m.weight.numel() for m in model.modules()
                 if type(m).__name__ == "Linear")  # the head included
    norms = sum(p.numel() * 4 for name, p in model.named_parameters() if "norm" in name)
    pack_linears(model, layout="panels", weights=weights)
    # the test shapes are whole panels of 16 columns: no padding to count
    assert step_weight_bytes(model) == linear * per_weight + norms
