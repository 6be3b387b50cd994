"""The official ``openai`` client against a running app, the way users call it: every neutral
field of docs/api.md's "Request fields" table, an unknown field, an assistant message with
``content: null``, text parts, streaming with usage and logprobs, penalties, n, the vLLM
extensions through ``extra_body``, and the model route. Exits non-zero on the first answer
that is not what docs/api.md promises.

    python -m load_tests.client_compat [--base-url http://127.0.0.1:8000/v1] [--model NAME]
"""

from __future__ import annotations

import argparse

from openai import OpenAI

NEUTRAL = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"},
           "store": False, "metadata": {"a": "b"}, "user": "u", "parallel_tool_calls": True,
           "service_tier": "auto"}


def check(client: OpenAI, model: str) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=model, max_tokens=8, temperature=0, top_logprobs=None,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": None},
                  {"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
        extra_body={"frobnicate": 1}, **NEUTRAL)
    assert raw.headers.get("x-ignored-fields") == "frobnicate", raw.headers
    assert raw.headers.get("x-request-id")
    chat = raw.parse()
    assert chat.choices[0].message.content and chat.usage.prompt_tokens_details is not None
    print("chat:", repr(chat.choices[0].message.content), chat.usage)

    chunks = list(client.chat.completions.create(
        model=model, max_tokens=8, stream=True, seed=3, logprobs=True, top_logprobs=2,
        presence_penalty=0.5, frequency_penalty=0.5, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Hi"}], **NEUTRAL))
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 8, usage
    scored = [c for c in chunks if c.choices and c.choices[0].logprobs]
    assert scored and len(scored[0].choices[0].logprobs.content[0].top_logprobs) == 2
    print("stream:", len(chunks), "chunks;", usage)

    comp = client.completions.create(
        model=model, prompt="The sky is", max_tokens=6, logprobs=2, n=2, seed=1,
        extra_body={"min_tokens": 3, "min_p": 0.05, "ignore_eos": True})
    assert len(comp.choices) == 2 and all(len(c.logprobs.tokens) == 6 for c in comp.choices)
    print("completions:", [c.text for c in comp.choices])

    assert client.models.retrieve(model).id == model
    print("ok")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--api-key", default="none")
    args = ap.parse_args()
    check(OpenAI(base_url=args.base_url, api_key=args.api_key), args.model)


if __name__ == "__main__":
    main()
