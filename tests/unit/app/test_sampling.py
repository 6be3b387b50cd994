"""SamplingParams validation and the batched sampler (greedy, top-k/p, min-p, seeds, penalties,
min_tokens, logit_bias, logprobs)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from app.errors import InvalidRequestError
from app.sampling import (
    SamplingParams,
    greedy_tokens,
    process_logits,
    sample_tokens,
    token_logprobs,
)

V = 1000


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("max_tokens", 2.5),
        ("max_tokens", True),
        ("temperature", -0.1),
        ("temperature", 100.5),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("seed", -1),
        ("seed", 2**63),
        ("stop", ("",)),
        ("stop", tuple(f"s{i}" for i in range(17))),
        ("stop_token_ids", (3, -1)),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 10.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("min_tokens", -1),
        ("min_tokens", 1.5),
        ("logit_bias", ((5, 100.5),)),
        ("logit_bias", ((-1, 1.0),)),
        ("logit_bias", tuple((i, 1.0) for i in range(301))),
        ("logprobs", 21),
        ("logprobs", -1),
    ],
)
def test_invalid_params_name_the_param(param, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{param: value})
    assert info.value.param == param
    assert info.value.message.startswith(param)
    assert info.value.status_code == 400


def test_valid_boundaries_accepted():
    p = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, seed=2**63 - 1,
                       stop=tuple(f"s{i}" for i in range(16)), repetition_penalty=10.0)
    assert p.greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_with_seed_and_check_vocab():
    p = SamplingParams()
    assert p.seed is None
    seeded = p.with_seed()
    assert seeded.seed is not None and 0 <= seeded.seed < 2**63
    assert seeded.with_seed() is seeded  # a given seed is kept
    assert {p.with_seed().seed for _ in range(5)} != {seeded.seed}  # random when not given
    SamplingParams(stop_token_ids=(0, 99)).check_vocab(100)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(stop_token_ids=(0, 100)).check_vocab(100)
    assert info.value.param == "stop_token_ids" and "100" in info.value.message
    SamplingParams(logit_bias=((99, 1.0),)).check_vocab(100)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logit_bias=((3, 1.0), (100, -1.0))).check_vocab(100)
    assert info.value.param == "logit_bias" and "100" in info.value.message


def test_greedy_is_argmax_per_row():
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0)] * 6
    assert sample_tokens(logits, params, [0] * 6) == logits.argmax(-1).tolist()
    # bfloat16 logits are accepted too
    half = logits.to(torch.bfloat16)
    assert sample_tokens(half, params, [0] * 6) == half.float().argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_are_argmax():
    logits = _logits(8, seed=1)
    argmax = logits.argmax(-1).tolist()
    for step in range(5):
        k1 = [SamplingParams(temperature=1.5, top_k=1, seed=s) for s in range(8)]
        assert sample_tokens(logits, k1, [step] * 8) == argmax
        p_tiny = [SamplingParams(temperature=1.5, top_p=1e-6, seed=s) for s in range(8)]
        assert sample_tokens(logits, p_tiny, [step] * 8) == argmax


def test_mixed_batch_greedy_rows_unaffected_by_sampled_rows():
    logits = _logits(4, seed=2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=2)]
    out = sample_tokens(logits, params, [3] * 4)
    argmax = logits.argmax(-1).tolist()
    assert out[0] == argmax[0] and out[2] == argmax[2]
    # sampled rows equal what they would draw alone
    assert out[1] == sample_tokens(logits[1:2], [params[1]], [3])[0]
    assert out[3] == sample_tokens(logits[3:4], [params[3]], [3])[0]


def test_seed_and_step_determine_the_token():
    flat = torch.zeros(1, V)  # uniform: every token equally likely
    p = SamplingParams(temperature=1.0, seed=1234)
    stream = [sample_tokens(flat, [p], [t])[0] for t in range(40)]
    again = [sample_tokens(flat, [p], [t])[0] for t in range(40)]
    assert stream == again
    # different steps draw from unrelated streams: 40 draws from 1000 tokens nearly all differ
    assert len(set(stream)) >= 35
    other = [sample_tokens(flat, [SamplingParams(temperature=1.0, seed=1235)], [t])[0]
             for t in range(40)]
    assert sum(a == b for a, b in zip(stream, other, strict=True)) <= 3


def test_sampling_follows_temperature_and_top_k():
    # two tokens with probabilities 0.8 / 0.2 at temperature 1
    row = torch.full((1, V), -1e9)
    row[0, 10] = math.log(0.8)
    row[0, 20] = math.log(0.2)
    p = SamplingParams(temperature=1.0, seed=7)
    counts = Counter(sample_tokens(row, [p], [t])[0] for t in range(2000))
    assert set(counts) == {10, 20}
    assert 0.76 < counts[10] / 2000 < 0.84

    logits = _logits(1, seed=3)
    top5 = set(torch.topk(logits[0], 5).indices.tolist())
    pk = SamplingParams(temperature=5.0, top_k=5, seed=11)  # hot: would spread widely
    drawn = {sample_tokens(logits, [pk], [t])[0] for t in range(300)}
    assert drawn <= top5 and len(drawn) >= 3


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = torch.zeros(V)
    probs[[1, 2, 3]] = torch.tensor([0.5, 0.3, 0.2])
    row = torch.log(probs.clamp_min(1e-30)).unsqueeze(0)
    p = SamplingParams(temperature=1.0, top_p=0.75, seed=5)  # 0.5 < 0.75 <= 0.8: keep 1, 2
    drawn = Counter(sample_tokens(row, [p], [t])[0] for t in range(500))
    assert set(drawn) == {1, 2}


def test_repetition_penalty_lowers_seen_tokens():
    row = torch.full((1, V), -5.0)
    row[0, 5] = 2.0  # the argmax, already seen
    row[0, 7] = 1.5
    row[0, 9] = -1.0  # negative logits are multiplied: seen -> less likely still
    plain = SamplingParams(temperature=0.0)
    penal = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample_tokens(row, [plain], [0], history=[[5, 9]]) == [5]
    assert sample_tokens(row, [penal], [0], history=[[5, 9]]) == [7]
    assert sample_tokens(row, [penal], [0], history=[[3]]) == [5]  # 5 not seen: unchanged
    assert sample_tokens(row, [penal], [0], history=None) == [5]

    # sampled rows: the seen token's share drops
    two = torch.full((1, V), -1e9)
    two[0, 5], two[0, 7] = 2.0, 0.0
    base = SamplingParams(temperature=1.0, seed=3)
    pen = SamplingParams(temperature=1.0, seed=3, repetition_penalty=4.0)
    n = 600
    plain_share = sum(sample_tokens(two, [base], [t], [[5]])[0] == 5 for t in range(n)) / n
    pen_share = sum(sample_tokens(two, [pen], [t], [[5]])[0] == 5 for t in range(n)) / n
    # e^2/(1+e^2) = 0.88 without the penalty; e^0.5/(1+e^0.5) = 0.62 with it
    assert plain_share > 0.8 and pen_share < 0.72
    # the negative branch: -1 * 2 = -2 is further below token 9's unseen rival at -1.5
    neg = torch.full((1, V), -50.0)
    neg[0, 9], neg[0, 11] = -1.0, -1.5
    assert sample_tokens(neg, [penal], [0], history=[[9]]) == [11]


def test_vanishing_temperature_is_greedy_not_nan():
    """Found by fuzzing the API: temperature 1e-82 divided logits to inf and softmax to NaN."""
    import torch

    from app.sampling import SamplingParams, sample_tokens

    logits = torch.tensor([[0.1, 3.0, -2.0, 2.9]])
    for t in (1e-82, 1e-6):
        sp = SamplingParams(temperature=t, seed=1)
        assert sp.greedy
        assert sample_tokens(logits, [sp], [0]) == [1]
    assert not SamplingParams(temperature=1e-4, seed=1).greedy


def test_presence_and_frequency_penalties_match_a_hand_computation():
    """OpenAI's definition: logit - frequency x count - presence x (count > 0), over the
    output tokens only (the prompt does not count)."""
    row = _logits(1, seed=4)[0]
    p = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=-0.3)
    out = process_logits(row, p, 3, seen=[1, 2, 3], output=[5, 5, 7, 5], eos_token_ids=frozenset())
    expected = row.clone()
    expected[5] -= 0.5 * 3 - 0.3
    expected[7] -= 0.5 * 1 - 0.3
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert torch.equal(row, _logits(1, seed=4)[0])  # the caller's logits are left alone
    # nothing output yet: no change
    assert torch.equal(process_logits(row, p, 0, None, [], frozenset()), row)


def test_penalties_steer_greedy_and_sampled_rows():
    row = torch.full((1, V), -5.0)
    row[0, 5], row[0, 7] = 2.0, 1.5
    pres = SamplingParams(temperature=0.0, presence_penalty=0.6)
    assert sample_tokens(row, [pres], [1], outputs=[[9]]) == [5]
    assert sample_tokens(row, [pres], [1], outputs=[[5]]) == [7]  # 2.0 - 0.6 < 1.5
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.2)
    assert sample_tokens(row, [freq], [2], outputs=[[5, 5]]) == [5]  # 2.0 - 0.4 > 1.5
    assert sample_tokens(row, [freq], [3], outputs=[[5, 5, 5]]) == [7]  # 2.0 - 0.6 < 1.5
    # a negative penalty favours what was said
    assert sample_tokens(row, [SamplingParams(temperature=0.0, presence_penalty=-1.0)], [1],
                         outputs=[[7]]) == [7]
    two = torch.full((1, V), -1e9)
    two[0, 5], two[0, 7] = 2.0, 0.0
    pen = SamplingParams(temperature=1.0, seed=3, presence_penalty=2.0)
    share = sum(sample_tokens(two, [pen], [t], outputs=[[5]])[0] == 5 for t in range(400)) / 400
    assert 0.35 < share < 0.65  # e^0 / (e^0 + e^0): even


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    row = torch.full((1, V), -5.0)
    row[0, 2], row[0, 9], row[0, 4] = 3.0, 2.5, 1.0  # EOS 2, then stop token 9, then 4
    eos = frozenset({2})
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(9,))
    assert [sample_tokens(row, [p], [t], eos_token_ids=eos)[0] for t in range(5)] == [
        4, 4, 4, 2, 2]
    # steps count the whole stream: a resumed request at output index 3 may stop
    assert sample_tokens(row, [p], [3], eos_token_ids=eos) == [2]
    # ignore_eos: EOS is no stop token, so it is not masked
    ign = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=(9,))
    assert sample_tokens(row, [ign], [0], eos_token_ids=eos) == [2]
    hot = SamplingParams(temperature=2.0, seed=1, min_tokens=2, stop_token_ids=(9,))
    drawn = {sample_tokens(row, [hot], [t % 2], eos_token_ids=eos)[0] for t in range(200)}
    assert not drawn & {2, 9}


def test_min_p_drops_tokens_below_its_share_of_the_top():
    probs = torch.zeros(V)
    probs[[1, 2, 3, 4]] = torch.tensor([0.5, 0.3, 0.15, 0.05])
    row = torch.log(probs.clamp_min(1e-30)).unsqueeze(0)
    p = SamplingParams(temperature=1.0, min_p=0.25, seed=5)  # keeps p >= 0.125
    drawn = Counter(sample_tokens(row, [p], [t])[0] for t in range(600))
    assert set(drawn) == {1, 2, 3}
    assert 0.12 < drawn[3] / 600 < 0.2  # renormalized: 0.15 / 0.95 = 0.16
    assert {sample_tokens(row, [SamplingParams(temperature=1.0, min_p=1.0, seed=5)], [t])[0]
            for t in range(50)} == {1}


def test_logit_bias_forces_and_bans_tokens():
    logits = _logits(3, seed=6)
    argmax = logits.argmax(-1).tolist()
    force = SamplingParams(temperature=0.0, logit_bias=((17, 100.0),))
    ban = SamplingParams(temperature=0.0, logit_bias=((argmax[1], -100.0),))
    hot = SamplingParams(temperature=1.0, seed=2, logit_bias=((17, 100.0),))
    out = sample_tokens(logits, [force, ban, hot], [0, 0, 0])
    assert out[0] == 17 and out[2] == 17
    assert out[1] != argmax[1] and out[1] == logits[1].topk(2).indices[1]
    torch.testing.assert_close(
        process_logits(logits[0], force, 0, None, None, frozenset()) - logits[0],
        torch.zeros(V).index_fill_(0, torch.tensor([17]), 100.0))


def test_processed_rows_keep_the_plain_rows_exact_and_batch_independent():
    logits = _logits(4, seed=8)
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, presence_penalty=2.0, min_tokens=4),
              SamplingParams(temperature=0.8, seed=3, frequency_penalty=1.0, min_p=0.05,
                             logit_bias=((3, 5.0),)),
              SamplingParams(temperature=0.0, logprobs=2)]
    outputs = [[1], [int(logits[1].argmax())], [3, 3], []]
    out = sample_tokens(logits, params, [2] * 4, outputs=outputs, eos_token_ids=frozenset({2}))
    assert out[0] == int(logits[0].argmax()) and out[3] == int(logits[3].argmax())
    for i in (1, 2):
        assert out[i] == sample_tokens(logits[i:i + 1], [params[i]], [2], outputs=[outputs[i]],
                                       eos_token_ids=frozenset({2}))[0]


def test_token_logprobs_are_the_raw_log_softmax(monkeypatch):
    logits = _logits(3, seed=9)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.5, seed=1, logprobs=0, presence_penalty=2.0)]
    tokens = [int(logits[0].argmax()), 5, 11]
    lp = torch.log_softmax(logits, -1)
    first, none, third = token_logprobs(logits, params, tokens)
    assert none is None
    assert first.token_id == tokens[0] and first.logprob == pytest.approx(lp[0, tokens[0]].item())
    top = lp[0].topk(3)
    assert [t for t, _ in first.top] == top.indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(top.values.tolist())
    # not the processed (hot, penalized) distribution: the model's own
    assert third.logprob == pytest.approx(lp[2, 11].item()) and third.top == ()

    def no_log_softmax(*_a, **_k):
        raise AssertionError("log_softmax ran for rows that did not ask for logprobs")

    monkeypatch.setattr(torch, "log_softmax", no_log_softmax)
    assert token_logprobs(logits, [SamplingParams()] * 3, tokens) == [None] * 3


def test_greedy_tokens_pick_as_torch_argmax_does():
    # ties go to the first maximum, a NaN counts as the maximum, an all -inf row gives 0
    rows = torch.randn(6, 49152)
    rows[1, 7] = rows[1, 9000] = 50.0
    rows[2, 123] = float("nan")
    rows[2, 40000] = float("nan")
    rows[3] = float("-inf")
    rows[4, -1] = 1e9
    rows[5, 0] = 1e9
    expected = rows.argmax(dim=-1).tolist()
    assert expected[1:] == [7, 123, 0, 49151, 0]
    assert greedy_tokens(rows) == expected
    assert greedy_tokens(rows[2:3]) == [123]
    # a non-contiguous view (the rows a batch picked) and bf16 logits made float32
    assert greedy_tokens(rows[::2]) == rows[::2].argmax(dim=-1).tolist()
    half = rows[4:].bfloat16()
    assert sample_tokens(half, [SamplingParams(max_tokens=4, temperature=0.0)] * 2, [0, 0]) \
        == half.float().argmax(dim=-1).tolist()
