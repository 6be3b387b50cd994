"""``n > 1`` where the decode side prefills (the colocated app, and prompts under
``local_prefill_threshold`` on a decode replica): one prefill, and each answer's stream reads
its package (``generate([ref], k)``), giving exactly the tokens of that answer prefilled on
its own (seed + k). The real server classes on the tiny model, without Ray: the node id and
the metrics are stubbed, and a resolved future stands in for the ObjectRef."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.messages import PrefillRequest, StreamStart
from app.sampling import SamplingParams
from deployments.colocated_server import ColocatedServer
from deployments.decode_server import DecodeServer
from deployments.retries import choice_request


@pytest.fixture
def make_server(rayless_replicas):
    def make(server_cls: Any) -> Any:
        # the class as written, under the one that @serve.deployment makes
        args: dict[str, Any] = {"engine": {"prefix_cache_mb": 0}}
        if server_cls is ColocatedServer:
            args["colocated"] = {}
        return server_cls.func_or_class(args)
    return make


def _ref(value: Any) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


@pytest.mark.parametrize("server_cls", [DecodeServer, ColocatedServer])
async def test_n_answers_share_one_prefill_and_equal_answers_prefilled_alone(
        make_server, server_cls):
    server = make_server(server_cls)
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    preq = PrefillRequest("req", tuple(range(300, 340)), sp, n=3)
    try:
        package = await server.make_kv_package(preq)
        assert len(package.choice_first_tokens) == 3

        async def tokens(stream) -> list[int]:
            items = [item async for item in stream]
            assert isinstance(items[0], StreamStart)
            return [e.token_id for e in items[1:]]

        shared = await asyncio.gather(*(tokens(server.generate([_ref(package)], k))
                                        for k in range(3)))
        alone = [await tokens(server.generate_local(choice_request(preq, k)))
                 for k in range(3)]
        assert shared == alone  # answer k: seed + k, the same tokens as on its own
        assert len({tuple(t) for t in shared}) > 1  # and the answers differ
        assert all(len(t) == 8 for t in shared)
    finally:
        await server.loop.close()
        if server._stats_task is not None:
            server._stats_task.cancel()
    if server_cls is DecodeServer:
        assert server.local_prefills == 4  # the shared prefill, then 3 answers alone
    else:
        assert server.batcher.requests_total == 4
