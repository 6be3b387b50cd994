"""The capacity planner's simulator (one module a job: constants, workload, systems, engine,
replicas, split, colocated, metrics, run).

Discrete-event simulation of the split app and of the colocated baseline.

The simulated engine follows the app's code path by path:

* **Prefill replica** (``PrefillServer`` → ``PrefillQueue``, ``app.prefill.Prefiller``): a
  prompt joins its replica's queue starting from its cached prefix (``cached_len`` of its
  arrival: only the uncached suffix is computed). The replica runs pass after pass; each
  pass is planned by the engine's rule (``Prefiller.plan_pass``): shortest remaining first,
  except that every other pass is led by the longest-waiting prompt once one has waited
  ``prefill_fairness_s``; each row computes at most ``prefill_chunk_tokens`` of its prompt;
  rows share a pass while ``rows x longest chunk`` fits ``min(token_budget,
  prefill_chunk_tokens)``, padding stays within a quarter of the real tokens, the padded
  pasts within ``token_budget`` and rows within ``prefill_max_rows``, and none joins a pass
  that already holds ``prefill_batch_tokens``. A pass costs
  ``prefill_chunk_s(rows, longest chunk, longest past)``. A prompt that arrives while a
  long one is being computed joins the next pass. A prompt's package leaves when its own
  last chunk ends. An idle queue waits ``batch_wait_s`` after a prompt wakes it.
* **Where a prompt is prefilled** (``SplitPath._prefills_locally``): on a decode replica
  when it is shorter than ``local_prefill_threshold`` (default 0: none), or shorter than
  ``local_prefill_when_busy`` (default 128; 0: off) while the prefill phase is backed up
  (the prompt tokens sent to it whose streams have not started are at least
  ``prefill_busy_tokens``, by default one pass) and the decode side has fewer tokens ahead
  of it (its local prompts not yet streaming) than the prefill phase (its short prompts
  plus at most two passes of longer ones); otherwise on the prefill phase. A prompt's
  tokens count from its routing until its stream starts: a local one when its package is
  made, a remote one when the decode replica holds it (after the hop). An ``n > 1``
  request (``SplitPath.shared_prefill``) is routed the same way and counted nowhere. The
  counts are one ingress replica's (the app keeps them per ingress replica). A local
  prompt goes to the least loaded decode replica's prefill queue (``DecodeServer``), which
  runs as a colocated replica's (below; ``decode_policy``, ``mixed`` by default): its
  chunks ride in that replica's decode steps, no KV hop.
* **Routing to prefill** (``PrefixAffinityRouter``): each prompt has a home replica
  (rendezvous hashing of its first tokens: uniform over replicas here, drawn from a fixed
  seed) and goes there unless the home holds more than ``affinity_imbalance`` requests
  more than the least loaded, which then gets it. ``prefill_routing="least_loaded"`` sends
  every prompt to the least loaded replica instead.
* **KV hop**: ``hop_s(prompt tokens x KV bytes per token)``, the whole prompt (cached part
  included); decode yields the first token the moment it holds the package (TTFT).
* **Several answers** (``n``): one prefill, then each answer is its own decode sequence on
  the least loaded decode replica, each with its own hop and its own KV (the prompt's KV
  held once per answer), all of the request's ``output_len`` tokens. A decode replica's
  load is its sequences and its local prompts (what Serve's router counts).
* **Decode replica** (``Decoder``): continuous batching; before each step it admits waiting
  sequences in order while the batch has a free row and the KV pool has room for the head
  of the queue (which, when it does not fit, holds back every sequence behind it). A step
  gives every running sequence one token and costs ``decode_ctx_s(batch, positions)``,
  ``positions`` being the KV its attention works over. ``kv_layout`` picks the engine:

  - ``"paged"`` (this engine: ``app.kv_cache``, ``app.decode``, ``app.attention``):
    a pool of ``kv_budget_tokens // kv_block_tokens`` blocks (16 tokens, the engine's); a
    sequence reserves its prompt + max_tokens rounded up to whole blocks when it joins and
    gives them back when it ends. The step gathers each row's KV padded to the longest row
    (``rows x longest``) unless that would copy more than twice the positions the rows
    hold, and then exactly those (their sum): rows of alike lengths are charged as a padded
    batch, a long outlier row switches the step to the exact sum (whose one SDPA call also
    scores each row against the other rows' positions, masked: not charged).
  - ``"inplace"``: the same pool, every row attending exactly its own positions (a
    paged-attention kernel that reads blocks in place, as vLLM's does; the default of
    ``python -m planner search``, whose roofline GPU efficiencies are vLLM's).
  - ``"padded"``: the contiguous buffer the engine had before its paged pool, kept to replay
    runs of that engine: ``round_rows(rows) x round_capacity(capacity)`` tokens reserved
    (rows 1, 2, 4 then multiples of 4, positions in multiples of 128, capacity the longest
    prompt + max_tokens) and every row attending the longest row's positions.

  Not modelled: the engine's cap of a reservation at ``max_model_len``, and its refusal of a
  sequence whose reservation does not fit even an empty pool (here it runs alone).
* **Colocated replica** (``ColocatedServer``): one device does both, on one engine thread
  that runs one pass at a time in the order they were submitted; its prefill queue is the
  split's (same planner, same chunks). ``policy``:

  - ``"mixed"`` (this app, ``EngineConfig.mixed_batch``, the default; ``PrefillQueue``
    ``mix_into``/``take_chunks``, ``Prefiller.plan_chunks``, ``Decoder.step(plan)``):
    while the decode loop has sequences, each of its steps carries the queue's next chunks,
    planned before the step from the rows it may run (running + waiting, at most
    ``max_batch_size``): the step computes at most one pass's tokens (``min(token_budget,
    prefill_chunk_tokens)``) decode rows included, the chunks at least a quarter of that;
    prompts in ``plan_pass``'s order (fairness, then shortest remaining first), each up
    to ``prefill_chunk_tokens``, at most ``prefill_max_rows``, laid end to end. The step
    costs one pass (as ``chunked``'s): the chunks' prefill compute (their tokens, and
    attention pairs over each one's past) plus the decode step's, against the weights read
    once, the decode rows' KV read and the chunks' KV written; plus the serving stack's
    per-step cost (``decode_stack``) of the rows it streams.
    With nothing decoding the queue runs passes of its own, as the split's prefill replica
    does; when such a pass finishes a prompt and others wait, the queue plans its next pass
    at once, and the decode loop's first step (planned during that pass, from the prompts
    not in it) follows it; the sequences the loop held when it planned a step are the ones
    that step admits. A prompt finished by a step or pass joins the decode batch at the
    next step the loop plans (in the app, once its stream reaches the loop: that step or
    the one after). With a measured profile (compute only) a mixed step costs what the
    pass and the step cost apart; ``load_tests.mixed_bench`` measured 0.93x of that on
    this CPU (not modelled); a roofline profile reads the weights once.
  - ``"interleave"`` (this app with ``mixed_batch: false``): the queue's passes alternate
    with decode steps while both have work: every running stream waits for one prefill
    pass (one chunk) between two steps.
  - ``"chunked"`` (vLLM/Sarathi-style mixed passes, not what this app does): up to
    ``chunk_tokens`` tokens of the oldest prompt in every decode step, prompts one after
    another.

  An ``n > 1`` request is prefilled once; each answer decodes on the least loaded replica
  (a KV hop when that is another replica).

A request is good when every one of its answers meets every SLO: its record carries the
worst answer's TTFT and TPOT and the last answer's end (``SimRecord``).

Requests are routed to the replica with the least outstanding work (Serve's power-of-two
choice is close to that), prefill as above. Latencies are measured from the client's send
time and the metrics are the load generator's own (``load_tests.metrics``), so a simulated
run and a real one are summarized by the same code.
"""



from planner.sim.constants import (
    COLOCATED_POLICIES,
    EXACT_OVER_PADDED,
    KV_BLOCK_TOKENS,
    KV_LAYOUTS,
    PREFIX_BLOCK_TOKENS,
)
from planner.sim.engine import attended_positions, gathers_exact, kv_blocks, pool_blocks
from planner.sim.metrics import SimRecord, SimResult, meets_all_slos
from planner.sim.run import Simulation, simulate
from planner.sim.systems import ColocatedSystem, EngineLimits, SplitSystem, System
from planner.sim.workload import Arrival, Workload, cached_prefix, load_trace, trace_of_run

__all__ = [
    "COLOCATED_POLICIES", "EXACT_OVER_PADDED", "KV_BLOCK_TOKENS", "KV_LAYOUTS",
    "PREFIX_BLOCK_TOKENS", "Arrival", "ColocatedSystem", "EngineLimits", "SimRecord",
    "SimResult", "Simulation", "SplitSystem", "System", "Workload", "attended_positions",
    "cached_prefix", "gathers_exact", "kv_blocks", "load_trace", "meets_all_slos",
    "pool_blocks", "simulate", "trace_of_run",
]
