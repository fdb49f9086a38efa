"""The scheduler -> runner seam on the host (no model): one SchedulerOutput says everything a step needs, and
the scheduler owns each sequence's lifecycle (admit, advance, fork, preempt, finish)."""
import numpy as np

from jaxserve.cache.kv_cache_manager import KVCacheManager
from jaxserve.config import EngineConfig
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import PENDING, Sequence, SequenceStatus, next_seq_id

BS = 4


def make(num_blocks=64, **knobs):
    cfg = EngineConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 32, "min_prefill_chunk": 8,
                          "max_model_len": 128, "block_size": BS, **knobs})
    return Scheduler(cfg, KVCacheManager(num_blocks, BS, watermark=0))


def seq(n_prompt, n=1, **params):
    sp = SamplingParams(temperature=1.0, n=n, max_tokens=params.pop("max_tokens", 50), seed=1, **params)
    seq_id = next_seq_id()
    first = 1000 * (seq_id + 1)   # distinct prompts: no prefix-cache hits between them
    return Sequence(seq_id, str(seq_id), 0, list(range(first, first + n_prompt)), n_prompt, sp, seed=1,
                    num_forks_pending=n - 1)


def land(out):
    """What the engine does when the step's samples reach the host: fill each PENDING token."""
    for row in out.rows:
        if row.samples:
            assert row.seq.token_ids[-1] == PENDING
            row.seq.token_ids[-1] = 7


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
