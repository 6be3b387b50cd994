"""Prefix cache: longest cached prefix, LRU under a byte budget, and the same tokens with a
hit as without (partial blocks, evictions, multi-turn)."""

from __future__ import annotations

import asyncio
import random

import torch

from app.config import EngineConfig
from app.engine_core import EngineCore
from app.messages import PrefillRequest
from app.prefill import Prefiller
from app.prefix_cache import PrefixCache
from app.sampling import SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _kv(n: int, fill: float = 0.0) -> torch.Tensor:
    """A fake KV [layers=2, 2, kv_heads=1, n, head_dim=3] whose position p holds fill + p."""
    pos = torch.arange(n, dtype=torch.float32)[None, None, None, :, None]
    return (fill + pos).expand(2, 2, 1, n, 3).contiguous()


BLOCK_BYTES = _kv(BS).numel() * 4


def test_longest_cached_prefix_leaves_one_token_to_compute():
    cache = PrefixCache("m", max_bytes=1 << 20, block_size=BS)
    prompt = tuple(range(10, 22))  # 12 tokens: 3 full blocks
    assert cache.insert(prompt, _kv(12)) == 3
    # the whole prompt again: 2 blocks (the last block would leave nothing to compute)
    match = cache.match(prompt)
    assert match.tokens == 8 and torch.equal(match.kv(), _kv(8))
    # a longer prompt sharing it: all 3 blocks; a partial 4th block never matches
    assert cache.match((*prompt, 1, 2, 3)).tokens == 12
    # diverging inside block 2: block 1 only
    assert cache.match((*prompt[:5], 999, *prompt[6:], 1)).tokens == 4
    assert cache.match((0, *prompt)).tokens == 0
    assert cache.hit_tokens == 8 + 12 + 4 and cache.queried_tokens == 12 + 15 + 13 + 13
    # another model's cache holds the same tokens under other keys
    other = PrefixCache("other-model", max_bytes=1 << 20, block_size=BS)
    assert other.match((*prompt, 1)).tokens == 0


def test_a_colliding_key_is_never_served():
    cache = PrefixCache("m", max_bytes=1 << 20, block_size=BS)
    prompt = tuple(range(8))
    cache.insert(prompt, _kv(8))
    # make another prompt's first block key point at this entry (a forced collision)
    [(_key, entry)] = [(k, e) for k, e in cache._entries.items() if e.tokens == prompt[:BS]]
    victim = (50, 51, 52, 53, 54)
    cache._entries[hash((cache._root, victim[:BS]))] = entry
    assert cache.match(victim).tokens == 0


def test_lru_evicts_a_chains_end_first_within_the_budget():
    cache = PrefixCache("m", max_bytes=4 * BLOCK_BYTES, block_size=BS)
    a, b = tuple(range(100, 112)), tuple(range(200, 208))
    cache.insert(a, _kv(12))
    cache.insert(b, _kv(8, fill=50))
    assert len(cache) == 4 and cache.bytes == 4 * BLOCK_BYTES and cache.evictions == 1
    assert cache.match((*a, 0)).tokens == 8  # a's last block went, its start stays usable
    assert cache.match((*b, 0)).tokens == 8
    assert torch.equal(cache.match((*b, 0)).kv(), _kv(8, fill=50))
    cache.insert(tuple(range(300, 316)), _kv(16, fill=9))  # 4 new blocks push out the rest
    assert cache.bytes <= cache.max_bytes and cache.match((*a, 0)).tokens == 0
    off = PrefixCache("m", max_bytes=0, block_size=BS)
    assert off.insert(a, _kv(12)) == 0 and len(off) == 0


def _decode(core: EngineCore, packages) -> list[list[int]]:
    loop = core.make_decode_loop(frozenset())

    async def tokens(pkg):
        return [ev.token_id async for ev in loop.generate(pkg)]

    async def run():
        try:
            return await asyncio.gather(*(tokens(p) for p in packages))
        finally:
            await loop.close()

    return asyncio.run(run())


def test_cache_hits_give_the_cold_tokens_under_eviction_pressure(tiny_model):
    """Shared system prompts of lengths that end mid-block, several users, a cache that
    holds only a few blocks: every answer equals the one computed without a cache."""
    core = EngineCore(EngineConfig(max_batch_size=16), model=tiny_model)
    rng = random.Random(3)
    systems = [[rng.randrange(3, 49152) for _ in range(n)] for n in (37, 21)]
    prompts = [s + [rng.randrange(3, 49152) for _ in range(rng.randrange(1, 9))]
               for _ in range(4) for s in systems]
    reqs = [PrefillRequest(f"p{i}", tuple(p), GREEDY) for i, p in enumerate(prompts)]
    cold = Prefiller(core.runner, core.fingerprint, None)
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # layers x K/V x kv_heads x block x head_dim x fp32
    cache = PrefixCache(core.fingerprint, max_bytes=2 * block_bytes, block_size=16)
    warm = Prefiller(core.runner, core.fingerprint, cache)
    cold_pkgs = cold.make_packages(reqs)
    warm_pkgs = [warm.make_packages([r])[0] for r in reqs]  # one by one: later ones hit
    assert sum(p.cached_tokens for p in warm_pkgs) >= 16 * 3 and cache.evictions >= 3
    assert cache.bytes <= cache.max_bytes
    for c, w in zip(cold_pkgs, warm_pkgs, strict=True):
        assert w.first_token == c.first_token
        torch.testing.assert_close(w.kv_tensor(), c.kv_tensor(), atol=1e-5, rtol=0)
    assert _decode(core, warm_pkgs) == _decode(core, cold_pkgs)


def test_multi_turn_chat_computes_only_the_new_tokens(tiny_model):
    core = EngineCore(EngineConfig(), model=tiny_model)
    prefiller = core.make_prefiller()  # the default cache (prefix_cache_mb)
    assert prefiller.prefix_cache is not None
    rng = random.Random(9)
    conversation: list[int] = []
    computed = []
    for turn in range(4):
        conversation += [rng.randrange(3, 49152) for _ in range(20)]  # the user's message
        req = PrefillRequest(f"t{turn}", tuple(conversation), GREEDY)
        [pkg] = prefiller.make_packages([req])
        computed.append(len(conversation) - pkg.cached_tokens)
        [answer] = _decode(core, [pkg])
        conversation += answer
    # turn 0 computes its 20 tokens; later turns their 8 + 20 new ones plus at most the
    # partial block the previous prompt ended in
    assert computed[0] == 20
    assert all(28 <= n < 28 + 16 for n in computed[1:])
