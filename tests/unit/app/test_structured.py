"""Structured outputs (app.structured, app.structured_fields): on the default model, what a
constraint allows is what comes out (a JSON schema's object, a regex, a choice), greedy and
sampled; a constrained row in a batch leaves the other rows' tokens as they were; the decode
side rebuilt from the first token and a resumed stream continue token for token; n > 1 gives
each answer its own matcher; the request fields map to one constraint or a 400."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from app.config import EngineConfig
from app.engine_core import LocalEngine
from app.errors import InvalidRequestError
from app.messages import PrefillRequest
from app.sampling import SamplingParams
from app.structured import Constraint
from app.structured_fields import StructuredFields

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name, an age and ok."}]


@pytest.fixture(scope="module")
def engine():
    eng = LocalEngine(EngineConfig(max_batch_size=8))
    yield eng
    asyncio.run(eng.close())


def _run(engine, sampling, messages=ASK):
    async def go():
        return await engine.generate(engine.make_request(sampling, messages=messages))
    return asyncio.run(go())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_json_schema_answer_is_an_object_of_the_schema(engine, temperature):
    c = Constraint.json_schema(SCHEMA, "response_format")
    out = _run(engine, SamplingParams(max_tokens=120, temperature=temperature, seed=3,
                                      constraint=c))
    assert out.finish_reason == "stop", out.text
    obj = json.loads(out.text)
    assert set(obj) == {"name", "age", "ok"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 20
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 120 and type(obj["ok"]) is bool


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_regex_and_choice_answers_match(engine, temperature):
    sp = dict(max_tokens=30, temperature=temperature, seed=11)
    out = _run(engine, SamplingParams(**sp, constraint=Constraint("regex", r"[0-9]{3}-[0-9]{4}")))
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.text) and out.finish_reason == "stop"
    options = ["red", "green", "blue"]
    out = _run(engine, SamplingParams(**sp, constraint=Constraint.choice(options, "x")))
    assert out.text in options and out.finish_reason == "stop"
    out = _run(engine, SamplingParams(**sp, constraint=Constraint(
        "grammar", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[1-9]/')))
    assert re.fullmatch(r"\([1-9](,[1-9])*\)", out.text), out.text


def test_a_constrained_row_leaves_its_batch_alone(engine):
    """Sent together, the unconstrained answer is token for token what it is alone."""
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    constrained = SamplingParams(max_tokens=60, temperature=0.0,
                                 constraint=Constraint.json_schema(SCHEMA, "response_format"))
    alone = _run(engine, plain).token_ids

    async def both():
        reqs = [engine.make_request(plain, messages=ASK),
                engine.make_request(constrained, messages=ASK)]
        return await asyncio.gather(*(engine.generate(r) for r in reqs))
    together, json_out = asyncio.run(both())
    assert together.token_ids == alone
    json.loads(json_out.text)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_resumed_constrained_stream_continues_exactly(engine, temperature):
    """The ingress re-prefills prompt + delivered tokens when a decode replica dies: the
    matcher rebuilt past the delivered tokens gives the same rest of the answer."""
    c = Constraint.json_schema(SCHEMA, "response_format")
    sp = SamplingParams(max_tokens=80, temperature=temperature, seed=5, constraint=c)
    req = engine.make_request(sp, messages=ASK)
    full = asyncio.run(engine.generate(req)).token_ids
    cut = 7
    assert len(full) > cut + 2
    resumed = PrefillRequest("resumed", req.prompt_token_ids + tuple(full[:cut]),
                             SamplingParams(max_tokens=80 - cut, temperature=temperature,
                                            seed=req.sampling.seed, constraint=c),
                             output_offset=cut)
    rest = asyncio.run(engine.generate(resumed)).token_ids
    assert full[cut:] == rest


def test_each_of_n_answers_has_its_own_matcher(engine):
    options = ["alpha", "beta", "gamma", "delta"]
    sp = SamplingParams(max_tokens=10, temperature=1.5, seed=2,
                        constraint=Constraint.choice(options, "guided_choice"))
    req = engine.make_request(sp, messages=ASK)
    [pkg] = engine.prefiller.make_packages([PrefillRequest(req.request_id, req.prompt_token_ids,
                                                           req.sampling, n=4)])
    texts = []

    async def answer(k):
        tokens = [e.token_id async for e in engine.decode_loop.generate(pkg.for_choice(k))]
        return engine.tokenizer.decode(tokens, skip_special_tokens=True)
    for k in range(4):
        texts.append(asyncio.run(answer(k)))
    assert all(t in options for t in texts), texts


@pytest.mark.parametrize(("body", "kind", "param"), [
    ({"response_format": {"type": "json_object"}}, "json", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA,
                                                                 "strict": True}}},
     "json", "response_format"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", "structured_outputs"),
    ({"structured_outputs": {"json_object": True}}, "json", "structured_outputs"),
    ({"guided_json": json.dumps(SCHEMA)}, "json", "guided_json"),
    ({"guided_regex": "a+"}, "regex", "guided_regex"),
    ({"guided_grammar": 'root ::= "x" | "y"'}, "grammar", "guided_grammar"),
    ({"response_format": {"type": "text"}}, None, None),
])
def test_request_fields_map_to_one_constraint(body, kind, param):
    c = StructuredFields(**body).constraint()
    assert (c and c.kind, c and c.param) == (kind, param)
    if c is not None:
        assert c.grammar()


def test_a_bad_constraint_is_a_400_naming_the_field():
    with pytest.raises(InvalidRequestError, match="guided_grammar: not a valid grammar") as e:
        StructuredFields(guided_grammar="start: (").constraint()
    assert e.value.param == "guided_grammar"


def test_the_cli_takes_the_same_constraints(tmp_path, capsys):
    from app.__main__ import main

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    assert main(["generate", "--chat", "--prompt", "A person, as JSON.", "--json-schema",
                 str(schema), "--max-tokens", "120", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(json.loads(result["text"])) == {"name", "age", "ok"}
    assert main(["generate", "--prompt", "Yes or no?", "--choice", "yes", "--choice", "no",
                 "--temperature", "1", "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] in ("yes", "no")
    assert main(["generate", "--prompt", "x", "--regex", "("]) == 2
    assert "guided_regex: not a valid regex" in capsys.readouterr().err


def test_warming_converts_the_tokenizer_once_before_any_request():
    from app.structured import Grammars

    loads = []

    def load():
        from app.model_loader import load_tokenizer
        loads.append(1)
        return load_tokenizer(EngineConfig())
    grammars = Grammars(load)
    grammars.warm(frozenset({2}))
    assert loads == [1] and grammars._ll  # converted before any request
    matcher = grammars.matcher(Constraint.choice(["a"], "x"), (), frozenset({2}))
    assert loads == [1] and not matcher.stopped


def test_a_constraint_that_fails_on_the_decode_replica_fails_only_its_answer(engine):
    """A constraint the ingress would refuse, reaching a decode replica anyway: its answer
    ends with an error, the other row of the batch decodes as it does alone."""
    from dataclasses import replace

    from app.decode import Decoder
    from app.messages import FinishReason
    from app.sequence import Sequence

    core, eos = engine.core, engine.eos_token_ids
    decoder = Decoder(core.runner, eos_token_ids=eos, max_batch_size=4, max_kv_tokens=4096,
                      grammars=core.grammars)
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ids = tuple(engine.prompts.encode_chat(ASK))
    pkgs = engine.prefiller.make_packages([PrefillRequest("ok", ids, plain),
                                           PrefillRequest("bad", ids, plain)])
    seqs = []
    for pkg in pkgs:
        sp = pkg.sampling if pkg.request_id == "ok" else replace(
            pkg.sampling, constraint=Constraint("regex", "(unclosed", "guided_regex"))
        seq = Sequence(pkg.request_id, list(pkg.prompt_ids), sp)
        seq.append(pkg.first_token, eos_token_ids=eos, max_model_len=2048)
        decoder.add(seq, pkg)
        seqs.append(seq)
    while not all(s.is_finished for s in seqs):
        decoder.step()
    ok, bad = seqs
    assert bad.finish_reason is FinishReason.ERROR and len(bad.output_token_ids) == 1
    alone = _run(engine, plain).token_ids
    assert ok.output_token_ids == alone and ok.finish_reason is FinishReason.LENGTH
