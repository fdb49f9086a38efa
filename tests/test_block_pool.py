"""Host-side KV cache: free queue, block pool, prefix cache, copy-on-write, reclaim, block table."""
from collections import Counter

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxserve.cache.block_pool import Block, BlockPool, FreeBlockQueue, extend_block_hashes
from jaxserve.cache.block_table import BlockTable
from jaxserve.cache.kv_cache_manager import KVCacheManager
from jaxserve.engine.step_inputs import build_step_inputs

BS = 4


def ids(blocks):
    return [b.block_id for b in blocks]


# --- free queue and pool -------------------------------------------------------------------------------------


def test_free_queue_popleft_append_remove_keep_links():
    blocks = [Block(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[3])  # middle
    q.remove(blocks[0])  # head
    q.remove(blocks[5])  # tail
    assert ids(q) == [1, 2, 4] and len(q) == 3
    assert blocks[3].prev is None and blocks[3].next is None
    q.append(blocks[3])
    assert q.popleft() is blocks[1]
    assert ids(q) == [2, 4, 3] and len(q) == 3
    for _ in range(3):
        q.popleft()
    with pytest.raises(ValueError, match="no free KV blocks"):
        q.popleft()


def test_pool_never_hands_out_null_block_and_rejects_tiny_pool():
    pool = BlockPool(5)
    assert sorted(ids(pool.take(4))) == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        pool.take(1)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


def test_block_hashes_chain_salt_and_incremental_extension():
    toks = list(range(11))
    full = extend_block_hashes([], toks, BS)
    assert len(full) == 2  # partial tail block is not hashed
    part = extend_block_hashes([], toks[:5], BS)
    assert extend_block_hashes(part, toks, BS) is part and part == full
    assert extend_block_hashes([], toks, BS, "tenant") != full
    other = extend_block_hashes([], [99] + toks[1:], BS)
    assert other[0] != full[0] and other[1] != full[1]  # block 1 equal tokens, different parent
    assert extend_block_hashes([], toks, BS, max_blocks=1) == full[:1]


# --- manager: prefix cache ---------------------------------------------------------------------------------------


def test_prefix_hit_caps_at_last_token_and_counts_tokens():
    m = KVCacheManager(16, BS, watermark=0)
    toks = list(range(12))
    assert m.allocate("a", toks, 12) == (True, 0)
    assert m.lookup_prefix(toks) == 8  # 12 tokens: last one recomputed, so only 2 of 3 full blocks
    assert m.lookup_prefix(toks + [7]) == 12
    assert m.lookup_prefix(toks[:4] + [0] + toks[5:]) == 4  # stops at the first miss
    assert m.lookup_prefix(toks, cache_salt="s") == 0
    m.free("a")
    ok, cached = m.allocate("b", toks + [1, 2], 2)
    assert (ok, cached) == (True, 12) and m.block_ids("b")[:3] == [1, 2, 3]
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (12 + 14, 12)


def test_blocks_filled_by_decode_are_cached():
    m = KVCacheManager(16, BS, watermark=0)
    toks = list(range(6))
    m.allocate("a", toks, 6)
    for t in (6, 7):
        toks.append(t)
        m.allocate("a", toks, 1)
    m.free("a")
    assert m.lookup_prefix(toks + [0]) == 8


def test_salt_stays_with_the_seq_for_blocks_filled_later():
    m = KVCacheManager(16, BS, watermark=0)
    toks = [1, 2, 3]
    m.allocate("a", toks, 3, cache_salt="tenant")
    for t in (4, 5):
        toks.append(t)
        m.allocate("a", toks, 1)  # later calls take no salt: the seq's own is used
    m.free("a")
    assert m.lookup_prefix(toks, "tenant") == 4 and m.lookup_prefix(toks) == 0


def test_admission_counts_hit_blocks_taken_off_the_free_queue():
    m = KVCacheManager(5, BS, watermark=0)  # 4 usable
    toks = list(range(12))
    m.allocate("a", toks, 12)
    m.allocate("c", [50], 1)
    m.free("a")  # 3 free blocks, all cached
    assert m.allocate("b", toks + [1], 1) == (False, 0)  # 3 revived hits + 1 new > 3 free
    assert "b" not in m.seqs and m.num_free_blocks == 3 and m.prefix_cache_queries == 13
    m.free("c")
    assert m.allocate("b", toks + [1], 1) == (True, 12) and m.num_free_blocks == 0


def test_no_hits_when_prefix_caching_disabled():
    m = KVCacheManager(16, BS, enable_prefix_caching=False, watermark=0)
    toks = list(range(12))
    m.allocate("a", toks, 12)
    m.free("a")
    assert m.lookup_prefix(toks + [1]) == 0 and not m.pool.cached


def test_caller_owned_hash_memo_is_extended_once():
    m = KVCacheManager(16, BS, watermark=0)
    toks = list(range(9))
    memo = []
    assert m.lookup_prefix(toks, block_hashes=memo) == 0 and len(memo) == 2
    memo[0] = b"poisoned"  # a memo is trusted, not recomputed: proves lookup and allocate reuse it
    m.allocate("a", toks, 9, block_hashes=memo)
    assert b"poisoned" in m.pool.cached


def test_freed_blocks_keep_hash_until_reused_lru_tail_first():
    m = KVCacheManager(7, BS, watermark=0)  # 6 usable blocks
    a, b = list(range(12)), list(range(100, 112))
    m.allocate("a", a, 12)
    m.allocate("b", b, 12)
    m.free("a")
    m.free("b")
    assert ids(m.pool.free) == [3, 2, 1, 6, 5, 4]  # LRU order; each chain tail first
    m.allocate("c", list(range(200, 204)), 4)  # evicts a's tail block, the least valuable
    assert m.block_ids("c") == [3] and m.lookup_prefix(a + [0]) == 8 and m.lookup_prefix(b + [0]) == 12
    ok, cached = m.allocate("a2", a + [0], 5)  # hit blocks 1, 2 leave the middle of the queue in O(1)
    assert (ok, cached) == (True, 8) and m.block_ids("a2") == [1, 2, 6, 5]
    assert ids(m.pool.free) == [4]
    assert m.lookup_prefix(b + [0]) == 4  # b's tail blocks were evicted first: its head block still hits


def test_watermark_applies_to_admission_only():
    m = KVCacheManager(11, BS, watermark=0.2)  # 10 usable, watermark 2 blocks
    assert m.allocate("a", list(range(36)), 32) == (True, 0)  # 8 blocks, 2 left
    assert m.allocate("b", list(range(50, 54)), 4) == (False, 0)
    assert "b" not in m.seqs and m.num_free_blocks == 2
    assert m.allocate("a", list(range(36)), 4) == (True, 0)  # running seqs may dip into the watermark
    assert m.allocate("a", list(range(44)), 8) == (False, 0) and m.num_free_blocks == 1  # short: no change
    assert m.usage == pytest.approx(0.9)


def test_bad_arguments_raise_clear_errors():
    m = KVCacheManager(8, BS)
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate("a", [1, 2], 3)
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate("a", [1, 2], -1)
    with pytest.raises(KeyError, match="unknown seq_id"):
        m.free("nope")
    m.allocate("a", [1, 2], 2)
    with pytest.raises(ValueError, match="child_id"):
        m.fork("a", "a")
    with pytest.raises(ValueError, match="watermark"):
        KVCacheManager(8, BS, watermark=1.0)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(8, 0)


# --- manager: fork and copy-on-write ------------------------------------------------------------------------------


def test_fork_shares_partial_block_and_first_write_copies_it():
    m = KVCacheManager(16, BS, watermark=0)
    prompt = list(range(6))
    m.allocate("p", prompt, 6)
    m.fork("p", "c")
    shared = m.block_ids("p")
    assert m.block_ids("c") == shared and [m.pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    m.take_block_updates()
    assert m.allocate("p", prompt + [7], 1) == (True, 0)
    assert m.allocate("c", prompt + [8], 1) == (True, 0)  # now sole owner: writes in place
    src, dst = m.take_copies()
    new = m.block_ids("p")[1]
    assert src.tolist() == [shared[1]] and dst.tolist() == [new] and src.dtype == np.int32
    assert m.block_ids("c") == shared and m.pool.blocks[shared[1]].ref_cnt == 1
    assert m.pool.blocks[shared[0]].ref_cnt == 2  # full blocks stay shared
    assert m.take_block_updates() == [("p", 1, [new])]
    assert [a.size for a in m.take_copies()] == [0, 0]


def test_copies_of_one_step_come_out_as_one_batch():
    m = KVCacheManager(64, BS, watermark=0)
    m.allocate("p", list(range(6)), 6)
    for i in range(8):
        m.fork("p", i)
    for i in range(8):
        m.allocate(i, list(range(6)) + [i], 1)
    src, dst = m.take_copies()
    shared = m.block_ids("p")[1]
    assert src.tolist() == [shared] * 8 and dst.tolist() == [m.block_ids(i)[1] for i in range(8)]
    assert m.pool.blocks[shared].ref_cnt == 1 and len(set(dst.tolist())) == 8


# --- block table ----------------------------------------------------------------------------------------------


def test_block_table_incremental_rows_and_the_step_slot_mapping():
    t = BlockTable(max_num_seqs=4, max_blocks_per_seq=3)
    t.write(0, 0, [5, 6])
    t.write(2, 0, [7])
    t.write(2, 1, [9])  # new tail block: one cell
    t.write(0, 1, [8])  # copy-on-write replacement of the last block
    assert t.table[:3].tolist() == [[5, 8, 0], [0, 0, 0], [7, 9, 0]]
    # rows in slots 0 and 2, two tokens each at positions 3-4 and 5-6, padded to 6 tokens
    inp = build_step_inputs(num_tokens=6, num_seqs=4, block_size=BS, scratch_slot=4, block_tables=t.table[[0, 2]],
                            starts=[3, 5], counts=[2, 2], token_ids=[1, 2, 3, 4], slots=[0, 2])
    attn = inp.model.attn
    assert attn.slot_mapping.tolist() == [5 * BS + 3, 8 * BS + 0, 9 * BS + 1, 9 * BS + 2, 0, 0]
    assert inp.model.positions.tolist() == [3, 4, 5, 6, 0, 0] and attn.kv_lens.tolist() == [5, 7, 0, 0]
    assert attn.cu_q_lens.tolist() == [0, 2, 4, 4, 4] and inp.sampler.slot_ids.tolist() == [0, 2, 4, 4]
    t.clear_row(2)
    assert t.table[2].tolist() == [0, 0, 0] and t.num_blocks[2] == 0
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        t.write(3, 2, [1, 2])


def test_block_updates_drive_the_table_to_match_the_manager():
    m = KVCacheManager(32, BS, watermark=0)
    t = BlockTable(4, 8)
    row = {"a": 0, "b": 1}
    m.allocate("a", list(range(6)), 6)
    m.fork("a", "b")
    toks = {"a": list(range(6)), "b": list(range(6))}
    for step in range(10):
        for s in ("a", "b"):
            toks[s].append(step + (100 if s == "b" else 0))
            assert m.allocate(s, toks[s], 1)[0]
        for s, start, block_ids in m.take_block_updates():
            t.write(row[s], start, block_ids)
        for s in ("a", "b"):
            assert t.table[row[s], :t.num_blocks[row[s]]].tolist() == m.block_ids(s)


# --- stateful model --------------------------------------------------------------------------------------------

BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 5, 5, 5, 5], [7] * 12]


class ManagerMachine(RuleBasedStateMachine):
    """Random admit/append/fork/free/lookup; a shadow cache 'writes' each token's id into its slot after every
    step, so any mix-up of blocks (bad hit, missed copy-on-write, leak into a shared block) shows as wrong content."""

    @initialize(watermark=st.sampled_from([0.0, 0.1]))
    def setup(self, watermark):
        self.m = KVCacheManager(16, BS, watermark=watermark)
        self.tokens, self.computed, self.salt = {}, {}, {}
        self.shadow = {i: [None] * BS for i in range(16)}
        self.pending = []  # (seq, start, end) written when the step runs
        self.next_id = 0

    def run_step(self):
        src, dst = self.m.take_copies()
        copied = {d: list(self.shadow[s]) for s, d in zip(src.tolist(), dst.tolist())}  # all reads first
        self.shadow.update(copied)
        for seq, start, end in self.pending:
            blocks = self.m.block_ids(seq)
            for pos in range(start, end):
                self.shadow[blocks[pos // BS]][pos % BS] = self.tokens[seq][pos]
        self.pending.clear()

    @rule(base=st.integers(0, 2), keep=st.integers(1, 12), suffix=st.lists(st.integers(0, 3), max_size=6),
          salt=st.sampled_from([None, "x"]), frac=st.floats(0.1, 1.0))
    def admit(self, base, keep, suffix, salt, frac):
        toks = BASES[base][:keep] + suffix
        expect = self.m.lookup_prefix(toks, salt)
        num_new = max(1, int((len(toks) - expect) * frac))
        free_before = self.m.num_free_blocks
        seq, self.next_id = self.next_id, self.next_id + 1
        ok, cached = self.m.allocate(seq, toks, num_new, cache_salt=salt)
        if not ok:
            assert seq not in self.m.seqs and self.m.num_free_blocks == free_before
            return
        assert cached == expect and cached % BS == 0 and cached <= len(toks) - 1
        self.tokens[seq], self.computed[seq], self.salt[seq] = toks, cached + num_new, salt
        self.pending.append((seq, cached, cached + num_new))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 3), n=st.integers(1, 6))
    def append(self, data, token, n):
        busy = {p[0] for p in self.pending}  # one allocate per seq per step
        idle = sorted(set(self.tokens) - busy)
        if idle:
            self.extend(data.draw(st.sampled_from(idle)), token, n)

    def extend(self, seq, token, n):
        toks, start = self.tokens[seq], self.computed[seq]
        if start == len(toks):  # decode: the sampled token joins the sequence
            toks.append(token)
        num_new = min(n, len(toks) - start)
        free_before, blocks_before = self.m.num_free_blocks, self.m.block_ids(seq)
        ok, cached = self.m.allocate(seq, toks, num_new)
        if not ok:
            assert self.m.num_free_blocks == free_before and self.m.block_ids(seq) == blocks_before
            assert self.m.seqs[seq].num_computed == start
            return
        assert cached == 0
        self.computed[seq] = start + num_new
        self.pending.append((seq, start, start + num_new))

    @rule()
    def step(self):
        self.run_step()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 3))
    def fork(self, data, token):
        """n > 1 sampling: fork after the parent's step, then both decode a different token in one step."""
        self.run_step()
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child, self.next_id = self.next_id, self.next_id + 1
        self.m.fork(parent, child)
        self.tokens[child], self.computed[child] = list(self.tokens[parent]), self.computed[parent]
        self.salt[child] = self.salt[parent]
        self.extend(parent, token, 1)
        self.extend(child, (token + 1) % 4, 1)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        self.run_step()
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(seq)
        for d in (self.tokens, self.computed, self.salt):
            del d[seq]

    @rule(base=st.integers(0, 2), keep=st.integers(1, 12), suffix=st.lists(st.integers(0, 3), max_size=6),
          salt=st.sampled_from([None, "x"]))
    def lookup(self, base, keep, suffix, salt):
        self.run_step()
        toks = BASES[base][:keep] + suffix
        n = self.m.lookup_prefix(toks, salt)
        hashes = extend_block_hashes([], toks, BS, salt)
        for i in range(n // BS):  # every hit block holds exactly the prompt's tokens
            assert self.shadow[self.m.pool.cached[hashes[i]].block_id] == toks[i * BS:(i + 1) * BS]
        if n // BS < (len(toks) - 1) // BS:
            assert hashes[n // BS] not in self.m.pool.cached

    @invariant()
    def refcounts_match_ownership(self):
        owners = Counter(b for s in self.m.seqs for b in self.m.block_ids(s))
        blocks = self.m.pool.blocks
        assert 0 not in owners and blocks[0].ref_cnt == 0
        assert all(b.ref_cnt == owners[b.block_id] >= 0 for b in blocks)

    @invariant()
    def free_plus_used_is_total(self):
        free = ids(self.m.pool.free)
        assert len(free) == self.m.num_free_blocks == len(set(free))
        assert all(self.m.pool.blocks[i].ref_cnt == 0 for i in free) and 0 not in free
        assert len(free) + sum(b.ref_cnt > 0 for b in self.m.pool.blocks) == 15

    @invariant()
    def hash_map_consistent(self):
        cached = self.m.pool.cached
        assert all(b.block_hash == h for h, b in cached.items())
        assert all(cached[b.block_hash] is b for b in self.m.pool.blocks if b.block_hash is not None)

    @invariant()
    def seq_contents_match_tokens(self):
        if self.pending:
            return  # this step's tokens are not written yet
        for seq, toks in self.tokens.items():
            assert self.m.seqs[seq].num_computed == self.computed[seq]
            blocks = self.m.block_ids(seq)
            assert len(blocks) == -(-self.computed[seq] // BS)
            assert [self.shadow[blocks[p // BS]][p % BS] for p in range(self.computed[seq])] == \
                toks[:self.computed[seq]]

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for seq in list(self.tokens):
            self.m.free(seq)
        assert self.m.num_free_blocks == 15 and self.m.usage == 0.0
        # every block is reusable: one sequence can take them all (admission keeps the watermark free)
        toks = list(range(200, 200 + 15 * BS))
        first = (15 - self.m.watermark_blocks) * BS
        assert self.m.allocate("all", toks, first)[0] and self.m.allocate("all", toks, 15 * BS - first)[0]
        assert sorted(self.m.block_ids("all")) == list(range(1, 16)) and self.m.num_free_blocks == 0
        self.m.free("all")


ManagerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
test_manager_state_machine = ManagerMachine.TestCase
