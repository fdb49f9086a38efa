"""The scheduler on the host (no model), over a real KV manager: one SchedulerOutput says everything a step needs,
and the scheduler owns each sequence's lifecycle (admit, advance, fork, preempt, finish). Decodes first, prefill in
chunks of what they leave of the budget, seats capped at max_num_seqs, preemption by recompute, priorities, prefix
hits, forks placed once their prompt is done."""
import numpy as np
import pytest

from jaxserve.cache.kv_cache_manager import KVCacheManager
from jaxserve.config import EngineConfig
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import PENDING, Sequence, SequenceStatus, next_seq_id

BS = 4


def make(num_blocks=64, prefix_caching=True, **knobs):
    """A scheduler over a real KV manager: budget 32 tokens a step, 8 seats, blocks of BS tokens (one is null)."""
    cfg = EngineConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 32, "min_prefill_chunk": 8,
                          "max_model_len": 128, "block_size": BS, **knobs})
    return Scheduler(cfg, KVCacheManager(num_blocks, BS, watermark=0, enable_prefix_caching=prefix_caching))


def seq(n_prompt=0, n=1, *, tokens=None, priority=0, arrival_time=None, **params):
    """A request's first sequence: n_prompt distinct tokens (or `tokens`), n - 1 siblings to fork."""
    sp = SamplingParams(temperature=1.0, n=n, max_tokens=params.pop("max_tokens", 50), seed=1, **params)
    seq_id = next_seq_id()
    first = 1000 * (seq_id + 1)   # distinct prompts: no prefix-cache hits between them
    prompt = list(range(first, first + n_prompt)) if tokens is None else list(tokens)
    when = {} if arrival_time is None else {"arrival_time": arrival_time}
    return Sequence(seq_id, str(seq_id), 0, prompt, len(prompt), sp, seed=1, priority=priority,
                    num_forks_pending=n - 1, **when)


def land(out):
    """What the engine does when the step's samples reach the host: fill each PENDING token."""
    for row in out.rows:
        if row.samples:
            assert row.seq.token_ids[-1] == PENDING
            row.seq.token_ids[-1] = 7


def rows(out):
    """(sequence, first position, tokens) of each row of a step."""
    return [(r.seq, r.start, r.count) for r in out.rows]


def run_to_end(s, target, max_steps=50):
    """Schedule (landing each sample) until target has no prompt left to compute; the outputs of those steps."""
    outs = []
    while target.is_prefill or target.status is not SequenceStatus.RUNNING:
        outs.append(s.schedule())
        land(outs[-1])
        assert len(outs) < max_steps
    return outs


def test_one_output_carries_placements_rows_and_block_table_deltas():
    s = make()
    a, b = seq(6), seq(40)                  # b needs two chunks of the 32-token budget
    s.add(a), s.add(b)
    out = s.schedule()
    assert out.placed == [a, b] and [(r.seq, r.start, r.count) for r in out.rows] == [(a, 0, 6), (b, 0, 26)]
    assert [r.samples for r in out.rows] == [True, False]
    assert {u[0]: u[1:] for u in out.block_updates} == {a.seq_id: (0, s.kv.block_ids(a.seq_id)),
                                                        b.seq_id: (0, s.kv.block_ids(b.seq_id))}
    assert a.num_computed_tokens == 6 and a.token_ids[-1] == PENDING     # advanced when scheduled
    land(out)
    out = s.schedule()
    assert out.placed == [] and [(r.seq, r.start, r.count) for r in out.rows] == [(a, 6, 1), (b, 26, 14)]
    assert out.rows[0].num_generated == 1 and out.rows[1].samples
    grown = [u for u in out.block_updates if u[0] == b.seq_id]       # only the new tail blocks of b
    assert grown == [(b.seq_id, 7, s.kv.block_ids(b.seq_id)[7:])]


def test_forks_are_placed_share_blocks_and_sample_their_parents_logits():
    s = make()
    parent = seq(6, n=3)     # 6 tokens: the last block is partial and shared, so the first write copies it
    s.add(parent)
    out = s.schedule()
    children = out.forks
    assert [c.index for c in children] == [1, 2] and out.placed == [parent, *children]
    assert [(r.seq, r.count, r.logits_from, r.samples) for r in out.rows[1:]] == [(c, 0, 0, True) for c in children]
    assert all(s.kv.block_ids(c.seq_id) == s.kv.block_ids(parent.seq_id) for c in children)
    assert len({c.seed for c in [parent, *children]}) == 3
    land(out)
    out = s.schedule()
    src, dst = out.copies
    # three share the partial block: the first two to write copy it, the last then owns it alone
    assert len(set(src.tolist())) == 1 and len(set(dst.tolist())) == 2
    assert [u[:2] for u in out.block_updates] == [(parent.seq_id, 1), (children[0].seq_id, 1)]   # the copies


def test_preempted_and_finished_ids_reach_the_runner_once():
    s = make(num_blocks=6)                  # 5 usable blocks of 4 tokens
    a, b = seq(8), seq(8)
    s.add(a), s.add(b)
    land(s.schedule())
    preempted = []
    for _ in range(8):                       # decodes grow until b (the newest) is preempted
        out = s.schedule()
        preempted += out.preempted
        land(out)
        if preempted:
            break
    assert preempted == [b.seq_id] and b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b not in [r.seq for r in out.rows]
    s.finish(a)
    out = s.schedule()
    assert out.finished == [a.seq_id] and a.seq_id not in s.kv.seqs and a.finished
    assert out.placed == [b]                 # resumed into the room a left
    assert s.schedule().finished == []


def test_admission_reserves_slots_for_pending_forks():
    """Two n=3 requests need 6 slots: with 4, the second waits until the first has finished (it used to be
    admitted beside the first and its forks found no free slot)."""
    s = make(max_num_seqs=4)
    first, second = seq(5, n=3, max_tokens=2), seq(5, n=3, max_tokens=2)
    s.add(first), s.add(second)
    out = s.schedule()
    assert out.placed == [first, *out.forks] and second.status is SequenceStatus.WAITING
    for sq in s.running[:]:
        s.finish(sq)
    out = s.schedule()
    assert out.placed == [second, *out.forks] and len(out.forks) == 2
    assert len(s.running) == 3 <= s.cfg.max_num_seqs
    assert np.all([r.seq.status is SequenceStatus.RUNNING for r in out.rows])


def test_decodes_get_their_token_before_any_prefill_chunk():
    """A parent's fork (placed last, so newer than the long prompt admitted beside it) decodes in the next step
    ahead of that older prompt's chunk: decodes first, the prefill gets what they leave of the budget."""
    s = make()
    parent, long = seq(5, n=2), seq(60)
    s.add(parent), s.add(long)
    out = s.schedule()
    (child,) = out.forks
    assert rows(out) == [(parent, 0, 5), (long, 0, 27), (child, 5, 0)] and s.running == [parent, long, child]
    land(out)
    out = s.schedule()
    assert rows(out) == [(parent, 5, 1), (child, 5, 1), (long, 27, 30)]
    assert [r.samples for r in out.rows] == [True, True, False]


@pytest.mark.parametrize("num_decodes", [0, 1, 2, 3])
def test_prefill_gets_the_budget_the_decodes_leave(num_decodes):
    """Prefill tokens per step: max(min_prefill_chunk, budget - decodes), which the config keeps at budget - decodes
    (it refuses a budget below max_num_seqs + min_prefill_chunk)."""
    knobs = dict(max_num_seqs=4, max_num_batched_tokens=12, min_prefill_chunk=8)
    s = make(**knobs)
    decoding = [seq(2) for _ in range(num_decodes)]
    for sq in decoding:
        s.add(sq)
    if decoding:
        land(s.schedule())
    long = seq(100)
    s.add(long)
    for _ in range(2):   # admission, then the next chunk
        out = s.schedule()
        land(out)
        assert [r.seq for r in out.rows] == [*decoding, long] and all(r.count == 1 for r in out.rows[:-1])
        assert out.rows[-1].count == max(knobs["min_prefill_chunk"], knobs["max_num_batched_tokens"] - num_decodes)
    assert long.num_computed_tokens == 2 * (12 - num_decodes)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(**{**knobs, "max_num_batched_tokens": 11})


def test_a_long_prompt_is_chunked_across_steps_then_decodes():
    s = make()
    long = seq(70)
    s.add(long)
    outs = run_to_end(s, long)
    assert [rows(o) for o in outs] == [[(long, 0, 32)], [(long, 32, 32)], [(long, 64, 6)]]
    assert [o.rows[0].samples for o in outs] == [False, False, True]     # only the last chunk samples
    assert [o.placed for o in outs] == [[long], [], []]
    assert len(s.kv.block_ids(long.seq_id)) == -(-70 // BS)
    assert long.num_computed_tokens == 70 and long.num_output_tokens == 1
    out = s.schedule()
    assert rows(out) == [(long, 70, 1)] and out.rows[0].samples and out.rows[0].num_generated == 1


def test_no_more_than_max_num_seqs_run_at_once():
    s = make(max_num_seqs=3)
    seqs = [seq(4, max_tokens=3) for _ in range(5)]
    for sq in seqs:
        s.add(sq)
    out = s.schedule()
    assert out.placed == seqs[:3] and s.waiting == seqs[3:] and len(out.rows) == 3
    land(out)
    out = s.schedule()                      # budget to spare, seats none
    assert out.placed == [] and len(s.running) == 3 and s.waiting == seqs[3:]
    land(out)
    s.finish(seqs[1])
    out = s.schedule()
    assert out.placed == [seqs[3]] and out.finished == [seqs[1].seq_id] and s.waiting == [seqs[4]]
    assert len(s.running) == 3


def test_short_of_blocks_the_newest_is_preempted_and_recomputed():
    """The newest running sequence gives its blocks back and waits at the queue's front with nothing computed; it
    keeps its generated tokens and, resumed, recomputes prompt and outputs in one prefill (prefix caching off: no
    hit can shorten it)."""
    s = make(num_blocks=7, prefix_caching=False)     # 6 usable blocks of 4 tokens
    old, new, queued = seq(8), seq(8), seq(4)
    s.add(old), s.add(new)
    land(s.schedule())
    s.add(queued)                            # no room for it: it waits behind the preempted one
    for _ in range(8):
        out = s.schedule()
        land(out)
        if out.preempted:
            break
    assert out.preempted == [new.seq_id] and s.num_preemptions == 1
    assert [r.seq for r in out.rows] == [old] and new.seq_id not in s.kv.seqs
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and s.waiting[:2] == [new, queued]
    generated = new.token_ids[8:]
    assert len(generated) > 1 and PENDING not in generated
    s.finish(old)
    out = s.schedule()
    assert out.placed[0] is new and rows(out)[0] == (new, 0, 8 + len(generated))
    assert new.token_ids[8:-1] == generated and new.token_ids[-1] == PENDING   # recomputed, then sampling on


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = make(max_num_seqs=1)
    order = [(2, 0.0), (0, 1.0), (1, 2.0), (0, 3.0)]   # (priority, arrival): lower priority values first
    seqs = [seq(4, max_tokens=1, priority=p, arrival_time=t) for p, t in order]
    for sq in seqs:
        s.add(sq)
    assert s.waiting == [seqs[1], seqs[3], seqs[2], seqs[0]]
    admitted = []
    while s.has_work():
        out = s.schedule()
        admitted += out.placed
        land(out)
        for sq in list(s.running):
            if not sq.is_prefill:
                s.finish(sq)
    assert admitted == [seqs[1], seqs[3], seqs[2], seqs[0]]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_cache_hits_shorten_a_prefill(prefix_caching):
    """A finished request's full blocks stay cached: a prompt sharing its first 17 tokens computes only its tail
    (four whole blocks hit; the hit stops at a block boundary)."""
    s = make(prefix_caching=prefix_caching)
    first = seq(18)
    s.add(first)
    run_to_end(s, first)
    s.finish(first)
    shared = first.token_ids[:17]
    second = seq(tokens=shared + [5, 6, 7])
    s.add(second)
    out = s.schedule()
    cached = 16 if prefix_caching else 0
    assert rows(out) == [(second, cached, 20 - cached)] and out.rows[0].samples
    assert s.kv.prefix_cache_hits == cached


def test_forks_are_placed_once_their_parents_prompt_is_done():
    """n = 3 over a prompt of two chunks: the siblings appear in the step of its last chunk (placed, sampling the
    parent's row, sharing its blocks); admission counted their seats before they were placed."""
    s = make(max_num_seqs=3)
    parent, other = seq(40, n=3), seq(4)
    s.add(parent), s.add(other)
    out = s.schedule()
    assert out.forks == [] and out.placed == [parent] and rows(out) == [(parent, 0, 32)]
    assert parent.num_forks_pending == 2 and other.status is SequenceStatus.WAITING
    land(out)
    out = s.schedule()
    children = out.forks
    assert [c.index for c in children] == [1, 2] and out.placed == [parent, *children][1:]
    assert rows(out) == [(parent, 32, 8), (children[0], 40, 0), (children[1], 40, 0)]
    assert [r.logits_from for r in out.rows] == [-1, 0, 0] and all(r.samples for r in out.rows)
    assert parent.num_forks_pending == 0 and s.running == [parent, *children]
    assert all(s.kv.block_ids(c.seq_id) == s.kv.block_ids(parent.seq_id) for c in children)
    assert other.status is SequenceStatus.WAITING    # budget to spare, but the siblings' seats were reserved
