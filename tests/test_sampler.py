"""The in-graph sampler against numpy references, on CPU with small vocabularies."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special, stats

from jaxserve.engine.sampler import (SUPPRESS_WIDTH, SamplingTensors, apply_penalties, effective_top_k, filter_min_p,
                                     filter_top_k_top_p, init_penalty_state, make_sampling_tensors, mode_for,
                                     reset_slots, sample)
from jaxserve.engine.sampling_params import SamplingParams

V = 256
MAX_SEQS = 8
sample_jit = jax.jit(sample, static_argnames=("num_logprobs", "mode"))


def tensors(params, seeds=None, gen=None, num_rows=None, eos=()):
    seeds = list(range(len(params))) if seeds is None else seeds
    gen = [0] * len(params) if gen is None else gen
    return make_sampling_tensors(params, seeds, gen, num_rows=num_rows or len(params), eos_token_ids=eos)


def run(logits, params, *, seeds=None, gen=None, state=None, slots=None, mask=None, num_logprobs=0, eos=()):
    s = logits.shape[0]
    state = init_penalty_state(MAX_SEQS, logits.shape[1]) if state is None else state
    slots = np.full(s, MAX_SEQS, np.int32) if slots is None else np.asarray(slots, np.int32)
    mask = np.ones(s, bool) if mask is None else np.asarray(mask)
    return sample_jit(jnp.asarray(logits), tensors(params, seeds, gen, s, eos), state, slots, mask,
                      num_logprobs=num_logprobs)


def random_logits(rng, rows, vocab=V, scale=3.0):
    return (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)


def allowed_reference(logits, temperature, top_k, top_p, min_p):
    """float64 numpy: top-k (ties kept), then top-p on the renormalised rest, then min-p on the full row."""
    x = logits.astype(np.float64) / temperature
    k = len(x) if top_k <= 0 else min(top_k, len(x))
    keep = x >= np.sort(x)[::-1][k - 1]
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    mass_above = np.array([p[p > pi].sum() for pi in p])
    keep &= (mass_above < top_p) | (top_p >= 1.0)
    return keep & (x - x.max() >= np.log(min_p) if min_p > 0 else keep)


def test_greedy_is_argmax_also_beside_random_rows():
    rng = np.random.default_rng(0)
    logits = random_logits(rng, 16)
    greedy = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.3)] * 8
    out, _ = run(logits[:8], greedy)
    np.testing.assert_array_equal(out.tokens, logits[:8].argmax(-1))
    mixed = greedy + [SamplingParams(temperature=2.0, top_p=0.9)] * 8
    out, _ = run(logits, mixed, seeds=list(range(16)))
    np.testing.assert_array_equal(out.tokens[:8], logits[:8].argmax(-1))
    assert (out.tokens[8:] != logits[8:].argmax(-1)).any()  # the random rows really sampled


def chi_square_pvalue(tokens, probs):
    counts = np.bincount(tokens, minlength=len(probs))
    return stats.chisquare(counts, probs * len(tokens)).pvalue


def test_temperature_sampling_matches_softmax():
    draws, temperature = 4000, 0.7
    row = np.linspace(-1.5, 2.0, 8).astype(np.float32)
    out, _ = run(np.tile(row, (draws, 1)), [SamplingParams(temperature=temperature, seed=1)] * draws,
                 seeds=list(range(draws)))
    softmax = lambda t: np.exp(row.astype(np.float64) / t) / np.exp(row.astype(np.float64) / t).sum()  # noqa: E731
    assert chi_square_pvalue(np.asarray(out.tokens), softmax(temperature)) > 1e-3
    assert chi_square_pvalue(np.asarray(out.tokens), softmax(1.0)) < 1e-6  # the test can tell temperatures apart


@pytest.mark.parametrize("top_k, top_p, min_p", [(5, 1.0, 0.0), (0, 0.8, 0.0), (-1, 1.0, 0.2), (12, 0.7, 0.05),
                                                 (3, 0.3, 0.0), (1, 1.0, 0.0)])
def test_filters_keep_exactly_the_allowed_tokens(top_k, top_p, min_p):
    draws, temperature = 3000, 1.3
    row = np.random.default_rng(top_k + 7).normal(size=32).astype(np.float32) * 1.5
    allowed = allowed_reference(row, temperature, top_k, top_p, min_p)
    p = np.where(allowed, np.exp(row / temperature), 0.0)
    assert (p / p.sum())[allowed].min() > 3e-3  # every allowed token is likely enough to show up
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * draws
    out, _ = run(np.tile(row, (draws, 1)), params, seeds=list(range(draws)))
    assert set(np.asarray(out.tokens).tolist()) == set(np.flatnonzero(allowed).tolist())


def test_filter_functions_match_reference_on_random_rows():
    rng = np.random.default_rng(1)
    rows = 64
    logits = random_logits(rng, rows, 128)
    top_k = rng.choice([0, 1, 2, 10, 50, 127, 128, 500], rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.99, 0.9, 0.5, 0.1, 1e-4], rows).astype(np.float32)
    min_p = rng.choice([0.0, 0.01, 0.1, 0.5, 1.0], rows).astype(np.float32)
    k_eff = np.where((top_k <= 0) | (top_k > 128), 128, top_k)
    kept = jax.jit(filter_top_k_top_p)(logits, k_eff, top_p)
    kept = np.isfinite(np.asarray(jax.jit(filter_min_p)(kept, min_p)))
    ref = np.stack([allowed_reference(logits[i], 1.0, top_k[i], top_p[i], min_p[i]) for i in range(rows)])
    np.testing.assert_array_equal(kept, ref)


def sort_top_k_top_p(logits, top_k, top_p):
    """The sort-based top-k / top-p that the library's sort-free filter replaced, as the pure-JAX reference:
    renormalise over the top-k set (ties with the k-th value included), keep ranks until the mass before reaches
    top_p, cut at the last kept value."""
    ranked = -jnp.sort(-logits, axis=-1)
    in_top_k = ranked >= jnp.take_along_axis(ranked, top_k[:, None] - 1, axis=-1)
    probs = jax.nn.softmax(jnp.where(in_top_k, ranked, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    cutoff = jnp.take_along_axis(ranked, keep.sum(axis=-1, keepdims=True) - 1, axis=-1)
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


def mixed_rows(rng, rows, vocab):
    """Rows of every awkward kind: spread and flat normals, heavy ties, one value throughout, bf16-rounded,
    signed zeros, some with -inf entries (suppressed ids). Each row keeps at least one finite value."""
    kinds = [lambda: rng.normal(size=vocab) * rng.choice([0.3, 3.0, 40.0]),
             lambda: rng.choice(rng.normal(size=3) * 4, vocab),
             lambda: np.full(vocab, rng.normal()),
             lambda: np.asarray(jnp.asarray(rng.normal(size=vocab) * 3, jnp.bfloat16), np.float64),
             lambda: rng.choice([-0.0, 0.0, 1.0, -1.0], vocab)]
    logits = np.stack([kinds[rng.integers(len(kinds))]() for _ in range(rows)]).astype(np.float32)
    suppressed = (rng.random((rows, vocab)) < rng.choice([0.0, 0.05, 0.9], (rows, 1))) & (np.arange(vocab) > 0)
    return np.where(suppressed, -np.inf, logits).astype(np.float32)


def kept_mass(row, cutoff, kth):
    """float64: the share of the top-k set's mass (cut at kth) in the values >= cutoff."""
    x = row.astype(np.float64)
    w = np.where(x >= kth, np.exp(x - x.max()), 0.0)
    return w[x >= cutoff].sum() / w.sum()


@pytest.mark.parametrize("pivots", [1, 2, 3, 7, 31])
@pytest.mark.parametrize("seed", range(3))
def test_filter_matches_sort_reference(seed, pivots):
    """Exactly the sort's cut, but where the two cuts' kept mass lies within 1e-5 of top_p (float32 sums in
    another order may round either way there); then the smaller kept set must be that near-tie."""
    rng = np.random.default_rng([seed, pivots])
    rows, vocab = int(rng.integers(1, 24)), int(rng.choice([rng.integers(1, 300), rng.integers(4000, 9000)]))
    logits = mixed_rows(rng, rows, vocab)
    top_k = effective_top_k(rng.choice([0, -1, 1, 3, vocab, int(rng.integers(1, vocab + 1))], rows), vocab)
    top_p = rng.choice([1.0, 0.9, 0.5, 1e-6, rng.uniform(0.05, 1.0)], rows).astype(np.float32)
    got = np.asarray(jax.jit(filter_top_k_top_p, static_argnames="pivots")(logits, top_k, top_p, pivots=pivots))
    want = np.asarray(jax.jit(sort_top_k_top_p)(logits, top_k, top_p))
    assert not np.isnan(got).any() and ((got == logits) | (got == -np.inf)).all()
    for i in np.flatnonzero((got != want).any(axis=-1)):
        assert top_p[i] < 1.0, f"row {i}: the top-k cut differs"
        kth = np.sort(logits[i])[::-1][top_k[i] - 1]
        smaller = max(got[i][got[i] > -np.inf].min(), want[i][want[i] > -np.inf].min())
        assert abs(kept_mass(logits[i], smaller, kth) - top_p[i]) < 1e-5, f"row {i}: the top-p cut differs"


def test_filter_counts_nan_as_neg_inf_and_keeps_inf():
    row = np.array([1.0, np.nan, 3.0, np.inf, 2.0, np.inf, -np.inf, np.nan], np.float32)
    rows = np.stack([row, row, row, np.full(8, np.nan, np.float32), np.full(8, -np.inf, np.float32)])
    top_k, top_p = np.array([8, 8, 3, 8, 8]), np.array([1.0, 0.5, 1.0, 0.5, 0.5], np.float32)
    got = np.asarray(jax.jit(filter_top_k_top_p)(rows, top_k, top_p))
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[0], np.where(np.isnan(row), -np.inf, row))   # NaN is never kept
    np.testing.assert_array_equal(got[1], np.where(row == np.inf, np.inf, -np.inf))  # the infs hold all the mass
    np.testing.assert_array_equal(got[2], np.where(row >= 3.0, row, -np.inf))
    assert (got[3:] == -np.inf).all()


def test_top_k_keeps_ties():
    row = np.array([[5.0, 3.0, 3.0, 1.0, 0.0]], np.float32)
    kept = filter_top_k_top_p(jnp.asarray(row), jnp.array([2]), jnp.array([1.0]))
    np.testing.assert_array_equal(np.isfinite(kept[0]), [True, True, True, False, False])


def numpy_penalties(logits, prompt_mask, counts, rep, freq, pres):
    seen = prompt_mask | (counts > 0)
    out = np.where(seen, np.where(logits > 0, logits / rep[:, None], logits * rep[:, None]), logits)
    return out - freq[:, None] * counts - pres[:, None] * (counts > 0)


def test_penalties_match_numpy():
    rng = np.random.default_rng(2)
    rows = 4
    state = init_penalty_state(MAX_SEQS, V)
    prompts = np.where(rng.random((rows, 40)) < 0.8, rng.integers(0, V, (rows, 40)), -1).astype(np.int32)
    outputs = np.where(rng.random((rows, 60)) < 0.8, rng.integers(0, 30, (rows, 60)), -1).astype(np.int32)
    slots = np.array([3, 0, 6, 1], np.int32)
    state = reset_slots(state, slots, prompts, outputs)
    params = [SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
              for r, f, p in [(1.3, 0.0, 0.0), (0.7, 0.5, 0.0), (1.0, -0.4, 1.5), (1.2, 1.0, -1.0)]]
    t = tensors(params)
    logits = random_logits(rng, rows)
    got = jax.jit(apply_penalties)(logits, t, state, slots)
    prompt_mask = np.zeros((rows, V), bool)
    counts = np.zeros((rows, V), np.int64)
    for i in range(rows):
        prompt_mask[i, prompts[i][prompts[i] >= 0]] = True
        np.add.at(counts[i], outputs[i][outputs[i] >= 0], 1)
    ref = numpy_penalties(logits, prompt_mask, counts, t.repetition_penalty, t.frequency_penalty, t.presence_penalty)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-5)
    # end to end: greedy sampling follows the penalised logits, not the raw ones
    greedy = [SamplingParams(temperature=0.0, repetition_penalty=p.repetition_penalty,
                             frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty)
              for p in params]
    out, _ = run(logits, greedy, state=state, slots=slots)
    np.testing.assert_array_equal(out.tokens, ref.argmax(-1))


def test_frequency_penalty_moves_greedy_off_a_repeated_token():
    logits = np.zeros((1, V), np.float32)
    logits[0, 7], logits[0, 9] = 3.0, 2.0
    state = reset_slots(init_penalty_state(MAX_SEQS, V), np.array([2], np.int32), np.full((1, 1), -1, np.int32),
                        np.array([[7, 7]], np.int32))
    out, _ = run(logits, [SamplingParams(temperature=0.0, frequency_penalty=0.6)], state=state, slots=[2])
    assert int(out.tokens[0]) == 9  # 3 - 2 * 0.6 = 1.8 < 2


def test_seed_gives_same_tokens_whatever_the_batch():
    rng = np.random.default_rng(3)
    n = 12
    logits = random_logits(rng, n, scale=1.0)
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=s) for s in range(n)]
    seeds, gen = [1000 + i for i in range(n)], [5 * i for i in range(n)]
    alone, _ = run(logits, params, seeds=seeds, gen=gen)
    perm = rng.permutation(n)
    others = random_logits(rng, 4, scale=1.0)  # other requests in the batch, different S too
    mixed_logits = np.concatenate([others[:2], logits[perm], others[2:]])
    mixed_params = [SamplingParams(temperature=0.0)] * 2 + [params[i] for i in perm] + [SamplingParams(top_k=3)] * 2
    mixed, _ = run(mixed_logits, mixed_params, seeds=[7, 8] + [seeds[i] for i in perm] + [9, 10],
                   gen=[0, 0] + [gen[i] for i in perm] + [0, 0])
    np.testing.assert_array_equal(np.asarray(mixed.tokens)[2:2 + n], np.asarray(alone.tokens)[perm])


def test_gen_index_and_seed_each_change_the_stream():
    n = 64
    logits = np.zeros((n, V), np.float32)  # uniform: every token equally likely
    same_seed, _ = run(logits, [SamplingParams(seed=1)] * n, seeds=[1] * n, gen=list(range(n)))
    same_index, _ = run(logits, [SamplingParams()] * n, seeds=list(range(n)), gen=[0] * n)
    # 64 uniform draws from 256 give ~57 distinct values; rows sharing randomness would give 1
    assert len(set(np.asarray(same_seed.tokens).tolist())) > 40
    assert len(set(np.asarray(same_index.tokens).tolist())) > 40
    again, _ = run(logits, [SamplingParams(seed=1)] * n, seeds=[1] * n, gen=list(range(n)))
    np.testing.assert_array_equal(again.tokens, same_seed.tokens)


def test_min_tokens_suppresses_eos_and_stop_ids():
    eos, stop = 4, 11
    logits = np.zeros((6, V), np.float32)
    logits[:, eos], logits[:, stop], logits[:, 20] = 9.0, 8.0, 1.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop])
    ignore = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop], ignore_eos=True)
    out, _ = run(logits, [p, p, p, ignore, ignore, p], gen=[0, 2, 3, 0, 3, 10], eos=[eos, 99])
    assert np.asarray(out.tokens).tolist() == [20, 20, eos, eos, eos, eos]
    hot = SamplingParams(temperature=1.5, min_tokens=5, stop_token_ids=[stop])
    out, _ = run(np.tile(logits[:1], (500, 1)), [hot] * 500, seeds=list(range(500)), gen=[4] * 500, eos=[eos])
    assert not np.isin(np.asarray(out.tokens), [eos, stop]).any()


def test_logprobs_are_raw_log_softmax_and_sorted():
    rng = np.random.default_rng(4)
    logits = random_logits(rng, 6)
    params = [SamplingParams(temperature=0.5, top_k=4, repetition_penalty=1.5, presence_penalty=1.0),
              SamplingParams(temperature=0.0, frequency_penalty=2.0)] * 3
    state = reset_slots(init_penalty_state(MAX_SEQS, V), np.arange(6, dtype=np.int32),
                        rng.integers(0, V, (6, 30)).astype(np.int32), rng.integers(0, V, (6, 30)).astype(np.int32))
    out, _ = run(logits, params, state=state, slots=range(6), num_logprobs=5)
    ref = logits - special.logsumexp(logits.astype(np.float64), axis=-1, keepdims=True)
    rows = np.arange(6)
    np.testing.assert_allclose(out.logprob, ref[rows, np.asarray(out.tokens)], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-logits, axis=-1)[:, :5])
    np.testing.assert_allclose(out.top_logprobs, np.sort(ref, axis=-1)[:, ::-1][:, :5], rtol=1e-5, atol=1e-5)
    assert out.top_ids.shape == (6, 5)
    none, _ = run(logits, params, state=state, slots=range(6))
    assert none.top_ids.shape == (6, 0) and none.top_logprobs.shape == (6, 0)


def test_penalty_counts_update_only_sampling_rows():
    rng = np.random.default_rng(5)
    logits = random_logits(rng, 5)
    slots, mask = np.array([4, 1, 7, MAX_SEQS, 2], np.int32), np.array([True, False, True, False, True])
    state = init_penalty_state(MAX_SEQS, V)
    out, new = run(logits, [SamplingParams(seed=1)] * 3 + [SamplingParams(temperature=0)] * 2,
                   state=state, slots=slots, mask=mask)
    expected = np.zeros((MAX_SEQS + 1, V), np.int32)
    for s, tok, m in zip(slots, np.asarray(out.tokens), mask):
        expected[s, tok] += m
    np.testing.assert_array_equal(new.output_counts, expected)
    np.testing.assert_array_equal(new.prompt_mask, state.prompt_mask)


def test_reset_slots_clears_and_sets_prompt_mask():
    state = init_penalty_state(MAX_SEQS, V)
    ones = jnp.ones_like(state.output_counts)
    state = type(state)(jnp.ones_like(state.prompt_mask), ones)  # every slot dirty
    slots = np.array([2, 5, MAX_SEQS], np.int32)  # the scratch slot pads the batch
    prompts = np.array([[3, 9, 3, -1], [-1, -1, -1, -1], [1, -1, -1, -1]], np.int32)
    outputs = np.array([[8, 8, -1], [0, -1, -1], [-1, -1, -1]], np.int32)
    new = reset_slots(state, slots, prompts, outputs)
    mask, counts = np.asarray(new.prompt_mask), np.asarray(new.output_counts)
    assert np.flatnonzero(mask[2]).tolist() == [3, 9] and not mask[5].any()
    assert (np.flatnonzero(counts[2]).tolist(), counts[2, 8]) == ([8], 2)
    assert np.flatnonzero(counts[5]).tolist() == [0] and counts[5, 0] == 1
    untouched = [0, 1, 3, 4, 6, 7]
    assert mask[untouched].all() and (counts[untouched] == 1).all()
    fresh = reset_slots(new, np.array([2], np.int32), np.array([[V - 1]], np.int32))  # no output_ids: counts 0
    assert np.flatnonzero(fresh.prompt_mask[2]).tolist() == [V - 1] and not fresh.output_counts[2].any()


def test_compiles_once_per_shape():
    traces = []

    @partial(jax.jit, static_argnames="num_logprobs")
    def step(logits, t, state, slots, mask, num_logprobs):
        traces.append(logits.shape)
        return sample(logits, t, state, slots, mask, num_logprobs=num_logprobs)

    rng = np.random.default_rng(6)
    state = init_penalty_state(MAX_SEQS, V)
    variants = [[SamplingParams(temperature=0.0)] * 4, [SamplingParams(temperature=0.8)] * 4,
                [SamplingParams(top_p=0.5, min_tokens=2, stop_token_ids=[1, 2])] * 4,
                [SamplingParams(repetition_penalty=1.1, top_k=4, min_p=0.1)] * 4]
    for params in variants:
        out, state = step(random_logits(rng, 4), tensors(params, eos=[0]), state, np.arange(4, dtype=np.int32),
                          np.ones(4, bool), num_logprobs=2)
    assert len(traces) == 1
    step(random_logits(rng, 8), tensors([SamplingParams()] * 8), state, np.arange(8, dtype=np.int32),
         np.ones(8, bool), num_logprobs=2)
    assert len(traces) == 2


def test_make_sampling_tensors_pads_and_splits_seeds():
    params = [SamplingParams(top_k=5, min_tokens=2, stop_token_ids=list(range(10, 19))), SamplingParams()]
    t = make_sampling_tensors(params, [2**40 + 3, -1], [0, 0], num_rows=4, eos_token_ids=[2])
    assert isinstance(t, SamplingTensors)
    assert t.seed.dtype == np.uint32 and t.seed.tolist() == [[256, 3], [2**32 - 1, 2**32 - 1], [0, 0], [0, 0]]
    assert t.temperature.tolist() == [1.0, 1.0, 0.0, 0.0] and t.top_k.tolist() == [5, 0, 0, 0]
    assert t.suppress_ids.shape == (4, SUPPRESS_WIDTH)  # fixed: no request's stop ids compile a new graph
    assert t.suppress_ids[0, :10].tolist() == [2] + list(range(10, 19)) and (t.suppress_ids[1:] == -1).all()
    with pytest.raises(ValueError, match="num_rows"):
        make_sampling_tensors(params, [1], [0, 0], num_rows=4)
    with pytest.raises(ValueError, match="num_rows"):
        make_sampling_tensors(params, [1, 2], [0, 0], num_rows=1)


def test_sampling_tensors_follow_each_rows_own_params_when_rows_share_objects():
    """Rows mostly share a few SamplingParams objects (the tensors read each object once): every column still
    follows each row's own params, equal-valued distinct objects and shared ones alike, and min_tokens suppresses
    per row by that row's generated count."""
    rng = np.random.default_rng(0)
    pool = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, presence_penalty=0.5,
                           frequency_penalty=-0.5, repetition_penalty=1.2, min_tokens=3, stop_token_ids=[7, 9]),
            SamplingParams(), SamplingParams(), SamplingParams(temperature=0.2, min_tokens=5, ignore_eos=True,
                                                               stop_token_ids=[11])]
    params = [pool[i] for i in rng.integers(0, len(pool), 40)]
    seeds = rng.integers(-2**63, 2**63 - 1, 40, dtype=np.int64).tolist()
    gen = rng.integers(0, 8, 40).tolist()
    t = make_sampling_tensors(params, seeds, gen, num_rows=48, eos_token_ids=[2, 3])
    fields = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty")
    for name in fields:
        expected = [getattr(p, name) for p in params] + [0.0 if name != "top_p" and name != "repetition_penalty"
                                                         else 1.0] * 8
        np.testing.assert_array_equal(getattr(t, name), np.array(expected, getattr(t, name).dtype), err_msg=name)
    words = [[(s % 2**64) >> 32, s % 2**32] for s in seeds] + [[0, 0]] * 8
    assert t.seed.tolist() == words and t.gen_index.tolist() == gen + [0] * 8
    for row, (p, g) in enumerate(zip(params, gen)):
        suppressed = ([] if p.ignore_eos else [2, 3]) + p.stop_token_ids if g < p.min_tokens else []
        assert t.suppress_ids[row, :len(suppressed)].tolist() == suppressed, row
        assert (t.suppress_ids[row, len(suppressed):] == -1).all(), row
    assert (t.suppress_ids[40:] == -1).all()


@pytest.mark.parametrize("params, mode", [
    ([SamplingParams(temperature=0.0)] * 3, "greedy"),
    ([SamplingParams(temperature=0.0, top_k=5, top_p=0.5)] * 3, "greedy"),  # filters cannot move an argmax
    ([SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=3.0)] * 2, "sample"),
    ([SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, min_p=0.05)], "sample"),
    ([SamplingParams(temperature=0.9, top_k=V)] * 2, "sample"),  # top_k = vocab filters nothing
    ([SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.8)], "filter"),
])
def test_cheapest_mode_gives_the_full_samplers_tokens(params, mode):
    """The host picks a compiled variant per step: it must sample exactly what the all-features one does."""
    assert mode_for(params, V) == mode
    rng = np.random.default_rng(9)
    logits, n = random_logits(rng, len(params)), len(params)
    prompt = np.concatenate([logits.argmax(1)[:, None], rng.integers(0, V, (n, 5))], 1).astype(np.int32)
    state = reset_slots(init_penalty_state(MAX_SEQS, V), np.arange(n, dtype=np.int32), prompt,
                        rng.integers(0, V, (n, 6)).astype(np.int32))  # each row's argmax is a seen token
    args = (jnp.asarray(logits), tensors(params, seeds=[7] * n, gen=[3] * n), state, np.arange(n, dtype=np.int32),
            np.ones(n, bool))
    cheap, cheap_state = sample_jit(*args, mode=mode)
    full, full_state = sample_jit(*args, mode="filter")
    np.testing.assert_array_equal(cheap.tokens, full.tokens)
    np.testing.assert_array_equal(cheap_state.output_counts, full_state.output_counts)
    if any(p.repetition_penalty != 1.0 for p in params):  # the penalty case would break under "greedy"
        assert not np.array_equal(sample_jit(*args, mode="greedy")[0].tokens, full.tokens)


def test_the_filter_takes_the_pivots_of_the_platform(monkeypatch):
    """The top-k / top-p search cuts CPU_SEARCH_PIVOTS times a pass on a CPU (its passes are bound by arithmetic),
    the GPU-tuned SEARCH_PIVOTS elsewhere."""
    import jaxserve.engine.sampler as sampler
    seen = []
    monkeypatch.setattr(sampler, "filter_top_k_top_p", lambda x, top_k, top_p, *, pivots: seen.append(pivots) or x)
    t = make_sampling_tensors([SamplingParams(temperature=1.0, top_p=0.9)], [0], [0], num_rows=1)
    sampler.sample_random(jnp.zeros((1, 16)), t, jnp.ones(1, bool), top_k_top_p=True)
    assert seen == [sampler.CPU_SEARCH_PIVOTS if jax.default_backend() == "cpu" else sampler.SEARCH_PIVOTS]
