"""The engine's constants the simulator mirrors (each names its home in app/)."""

from __future__ import annotations

# The prefix cache's block (``app.prefix_cache.DEFAULT_BLOCK_TOKENS``): a prompt's cached
# prefix is a whole number of blocks and leaves at least one token to compute.
PREFIX_BLOCK_TOKENS = 16
# ``app.kv_cache.DEFAULT_BLOCK_SIZE``: tokens per block of the decode replica's KV pool.
KV_BLOCK_TOKENS = 16
# ``app.attention._EXACT_OVER_PADDED``: a decode step gathers exactly (no padding) when
# the padded block would copy more than this many times the positions the rows hold.
EXACT_OVER_PADDED = 2
KV_LAYOUTS = ("paged", "inplace", "padded")
# How a colocated replica shares its engine between prompts and decode steps: this app
# (mixed_batch on, off), then the vLLM-style approximation (the module docstring).
COLOCATED_POLICIES = ("mixed", "interleave", "chunked")
# A prefill replica's extra lane runs at nice ``app.engine_core.LANE_NICE`` (19) beside threads
# at Ray's worker niceness (15); Linux's scheduler weighs a thread 1.25x less per nice level,
# so where they compete for a core the lane gets this much of a normal thread's share.
LANE_WEIGHT = 1.25 ** -(19 - 15)
