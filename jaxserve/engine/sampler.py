"""In-graph sampling for the engine's jitted step, in pure JAX.

Order (vLLM's): repetition/frequency/presence penalties -> min_tokens suppression -> greedy argmax,
or temperature -> top-k -> top-p -> min-p -> Gumbel-max sampling. Returned logprobs are those of the raw
logits (vLLM's default `raw_logprobs`).

Rows are the step's sequences padded to a static S; `slot_ids` maps each row to its request's persistent
slot in `PenaltyState` (padding rows to the scratch slot `max_num_seqs`) and `sample_mask` says which rows
sample this step (not mid-prompt prefill chunks, not padding). A row's randomness is
`fold_in(key(seed), gen_index)`: a seeded request draws the same tokens whatever else is in the batch.
Costly work is switched by a static `mode` the host picks per step from the requests' parameters (one
compiled variant each), not by `lax.cond`: on GPU an XLA conditional reads its predicate back to the host,
which stalls the dispatching thread until the device gets there and so serialises host and device.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import SAMPLER_MODES
from jaxserve.engine.sampling_params import GREEDY_TEMPERATURE, MAX_STOP_TOKEN_IDS, SamplingParams

# Width of `suppress_ids`, fixed so that no request's stop ids compile a new graph: the EOS ids (a few per model)
# and at most MAX_STOP_TOKEN_IDS stop ids.
SUPPRESS_WIDTH = 2 * MAX_STOP_TOKEN_IDS
NEG_INF = float("-inf")
# Cuts that each pass of the top-k / top-p threshold search tests past its lower bound. A pass reads the [S, V]
# logits once, and 32 key bits take ceil(32 / log2(P + 1)) passes per threshold: more pivots, fewer reads but more
# arithmetic per element. Tuned on H100 with a Llama-3 vocabulary (V = 128256); benchmarks/bench_sampler.py sweeps
# it. A CPU's passes are bound by their arithmetic, not their reads: 3 pivots there (~40% faster than 7 at V = 49152).
SEARCH_PIVOTS = 7
CPU_SEARCH_PIVOTS = 3
SEARCH_CHUNK = 4096  # longest row the search reduces whole: see `chunked`


@jax.tree_util.register_dataclass
@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters, all [S] unless noted; built on the host by `make_sampling_tensors`."""

    temperature: jax.Array  # f32; < GREEDY_TEMPERATURE: greedy
    top_k: jax.Array  # i32; <= 0 or >= V: off
    top_p: jax.Array  # f32; 1: off
    min_p: jax.Array  # f32; 0: off
    presence_penalty: jax.Array  # f32
    frequency_penalty: jax.Array  # f32
    repetition_penalty: jax.Array  # f32
    seed: jax.Array  # u32 [S, 2]: high and low words of the request's 64-bit seed (threefry key data)
    gen_index: jax.Array  # i32: tokens the request has generated so far
    suppress_ids: jax.Array  # i32 [S, M]: ids masked to -inf this step (EOS/stop ids under min_tokens), -1 padded


@jax.tree_util.register_dataclass
@dataclass(slots=True)
class PenaltyState:
    """What the penalties look at, per slot; persistent on device and donated with the KV cache."""

    prompt_mask: jax.Array  # bool [max_num_seqs + 1, V]: token occurs in the prompt
    output_counts: jax.Array  # i32 [max_num_seqs + 1, V]: times the token was generated


@jax.tree_util.register_dataclass
@dataclass(slots=True)
class SamplerOutput:
    tokens: jax.Array  # i32 [S]; meaningless where sample_mask is False
    logprob: jax.Array  # f32 [S]: raw logprob of the sampled token
    top_ids: jax.Array  # i32 [S, K]: K = num_logprobs most likely tokens, most likely first
    top_logprobs: jax.Array  # f32 [S, K]
    num_accepted: jax.Array | None = None  # i32 [rows]: speculative steps (verify), each row's accepted drafts

    @staticmethod
    def structs(rows: int, num_logprobs: int, width: int = 1) -> "SamplerOutput":
        """The outputs' shapes and dtypes for `rows` rows sampling at `width` positions each (S = rows x width)."""
        n, i32, f32 = rows * width, jnp.int32, jnp.float32
        return SamplerOutput(*(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in
                               (((n,), i32), ((n,), f32), ((n, num_logprobs), i32), ((n, num_logprobs), f32))),
                             None if width == 1 else jax.ShapeDtypeStruct((rows,), i32))


def init_penalty_state(max_num_seqs: int, vocab_size: int) -> PenaltyState:
    shape = (max_num_seqs + 1, vocab_size)  # + the scratch slot that padding rows point at
    return PenaltyState(jnp.zeros(shape, jnp.bool_), jnp.zeros(shape, jnp.int32))


def drop_padding(ids: jax.Array, vocab_size: int) -> jax.Array:
    """-1 padding -> an out-of-range index that a scatter with mode="drop" skips (negatives would wrap)."""
    return jnp.where(ids >= 0, ids, vocab_size)


@partial(jax.jit, donate_argnums=0)
def reset_slots(state: PenaltyState, slots: jax.Array, prompt_ids: jax.Array,
                output_ids: jax.Array | None = None) -> PenaltyState:
    """Start slots [N] afresh for admitted requests: prompt_ids [N, L] (-1 padded) fill the prompt mask;
    output_ids [N, L'] (-1 padded), the tokens generated before a preemption, restore the counts."""
    vocab_size = state.prompt_mask.shape[1]
    rows = slots[:, None]
    prompt_mask = state.prompt_mask.at[slots].set(False)
    prompt_mask = prompt_mask.at[rows, drop_padding(prompt_ids, vocab_size)].set(True, mode="drop")
    counts = state.output_counts.at[slots].set(0)
    if output_ids is not None:
        counts = counts.at[rows, drop_padding(output_ids, vocab_size)].add(1, mode="drop")
    return PenaltyState(prompt_mask, counts)


def mode_for(params: Sequence[SamplingParams], vocab_size: int, constrained: bool = False) -> str:
    """The cheapest static variant (config.SAMPLER_MODES: "greedy" argmax only; "sample" + penalties,
    temperature, min-p, Gumbel noise; "filter" + top-k / top-p) that serves every request sampling in this step,
    among `sampler_modes(constrained)`."""
    def needs_filter(p):
        return 0 < p.top_k < vocab_size or p.top_p < 1.0

    random = [p for p in params if p.temperature >= GREEDY_TEMPERATURE]
    if any(map(needs_filter, random)):
        return "filter"
    penalties = any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params)
    mode = "sample" if random or penalties else "greedy"
    return mode if mode in sampler_modes(constrained) else "filter"


def sampler_modes(constrained: bool) -> tuple[str, ...]:
    """The variants compiled: steps with structured outputs run "greedy" or "filter" (fewer graphs to compile)."""
    return ("greedy", "filter") if constrained else SAMPLER_MODES


def sample(logits: jax.Array, t: SamplingTensors, state: PenaltyState, slot_ids: jax.Array, sample_mask: jax.Array,
           *, num_logprobs: int = 0, mode: str = "filter", token_bitmask: jax.Array | None = None,
           ) -> tuple[SamplerOutput, PenaltyState]:
    """Sample one token per row of logits [S, V]; count it in the row's slot where sample_mask [S] holds.
    `mode` (static) must cover every row's parameters (`mode_for`); "filter" covers all. token_bitmask
    [S, ceil(V / 32)] (structured outputs): only the tokens whose bit is set may be sampled."""
    tokens = choose(logits, t, state, slot_ids, sample_mask, mode=mode, token_bitmask=token_bitmask)
    return raw_logprobs(logits.astype(jnp.float32), tokens, num_logprobs), count(state, slot_ids, tokens, sample_mask)


def verify(logits: jax.Array, t: SamplingTensors, state: PenaltyState, slot_ids: jax.Array, sample_mask: jax.Array,
           draft_ids: jax.Array, *, num_logprobs: int = 0, mode: str = "filter",
           ) -> tuple[SamplerOutput, PenaltyState]:
    """Speculative decoding's verification. Each of S rows has W positions: its last known token, then its drafts
    draft_ids [S, W - 1] (-1 past the row's own); logits [S * W, V] and the per-position t, slot_ids and sample_mask
    are row-major over (row, position), each position's gen_index one past the one before. Position j draws the
    token that sampling would draw there had the drafts before it been sampled: the same noise (seed, gen_index),
    penalties that count those drafts, min_tokens at that index. A row emits the drafts its draws match and the draw
    after them (num_accepted [S] drafts + 1 tokens): what token-by-token decoding emits, for any seed. A draft is so
    accepted with the target's probability of it, as rejection sampling accepts a deterministic draft.
    Returns (SamplerOutput of every position with num_accepted, the state counting the emitted tokens)."""
    num_rows, width = draft_ids.shape[0], draft_ids.shape[1] + 1
    drafted = None if mode == "greedy" else draft_prefix_counts(draft_ids, logits.shape[1])
    tokens = choose(logits, t, state, slot_ids, sample_mask, mode=mode, prior_counts=drafted)
    matches = (tokens.reshape(num_rows, width)[:, :-1] == draft_ids) & (draft_ids >= 0)
    num_accepted = jnp.cumprod(matches, axis=1).sum(axis=1, dtype=jnp.int32)
    emitted = (jnp.arange(width)[None, :] <= num_accepted[:, None]).reshape(-1) & sample_mask
    out = raw_logprobs(logits.astype(jnp.float32), tokens, num_logprobs)
    out.num_accepted = num_accepted
    return out, count(state, slot_ids, tokens, emitted)


def draft_prefix_counts(draft_ids: jax.Array, vocab_size: int) -> jax.Array:
    """[S * W, V] i32: at (row, position j), how often each token occurs among the row's drafts before j."""
    num_rows, width = draft_ids.shape[0], draft_ids.shape[1] + 1
    before = jnp.arange(width)[:, None] > jnp.arange(width - 1)[None, :]   # [W, W - 1]: draft i precedes position j
    ids = jnp.broadcast_to(drop_padding(draft_ids, vocab_size)[:, None, :], (num_rows, width, width - 1))
    rows = jnp.arange(num_rows * width).reshape(num_rows, width, 1)
    counts = jnp.zeros((num_rows * width, vocab_size), jnp.int32)
    return counts.at[jnp.broadcast_to(rows, ids.shape), ids].add(before[None].astype(jnp.int32), mode="drop")


def choose(logits: jax.Array, t: SamplingTensors, state: PenaltyState, slot_ids: jax.Array, sample_mask: jax.Array,
           *, mode: str, token_bitmask: jax.Array | None = None, prior_counts: jax.Array | None = None) -> jax.Array:
    """Each row's token (sample's order of operations); prior_counts [S, V]: generated tokens the slots do not
    count yet (drafts), which the penalties count too."""
    logits = logits.astype(jnp.float32)
    penalised = logits if mode == "greedy" else apply_penalties(logits, t, state, slot_ids, prior_counts)
    if token_bitmask is not None:
        penalised = jnp.where(allowed_tokens(token_bitmask, logits.shape[1]), penalised, NEG_INF)
    penalised = suppress(penalised, t.suppress_ids)
    if mode == "greedy":
        return argmax(penalised)
    random_rows = sample_mask & (t.temperature >= GREEDY_TEMPERATURE)
    return sample_random(penalised, t, random_rows, top_k_top_p=mode == "filter")


def count(state: PenaltyState, slot_ids: jax.Array, tokens: jax.Array, mask: jax.Array) -> PenaltyState:
    """tokens counted as generated in their rows' slots where mask holds."""
    return PenaltyState(state.prompt_mask, state.output_counts.at[slot_ids, tokens].add(mask.astype(jnp.int32)))


def allowed_tokens(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """bool [S, V] from a bitmask [S, W] of int32 words (token t: bit t % 32 of word t // 32)."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size] != 0


def argmax(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def apply_penalties(logits: jax.Array, t: SamplingTensors, state: PenaltyState, slot_ids: jax.Array,
                    prior_counts: jax.Array | None = None) -> jax.Array:
    """Repetition penalty over prompt and output tokens; frequency and presence over output tokens only."""
    counts = state.output_counts[slot_ids]
    if prior_counts is not None:
        counts = counts + prior_counts
    generated = counts > 0
    seen = state.prompt_mask[slot_ids] | generated
    rep = t.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - t.frequency_penalty[:, None] * counts - t.presence_penalty[:, None] * generated


def suppress(logits: jax.Array, ids: jax.Array) -> jax.Array:
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, drop_padding(ids, logits.shape[1])].set(NEG_INF, mode="drop")


def sample_random(logits: jax.Array, t: SamplingTensors, random_rows: jax.Array, *,
                  top_k_top_p: bool) -> jax.Array:
    """Temperature, filters, then Gumbel-max on random_rows; the other rows take the plain argmax."""
    vocab_size = logits.shape[1]
    scaled = logits / jnp.where(random_rows, t.temperature, 1.0)[:, None]
    if top_k_top_p:
        pivots = CPU_SEARCH_PIVOTS if jax.default_backend() == "cpu" else SEARCH_PIVOTS
        scaled = filter_top_k_top_p(scaled, effective_top_k(t.top_k, vocab_size), t.top_p, pivots=pivots)
    scaled = filter_min_p(scaled, t.min_p)  # max logit survives top-k/top-p: the same as min-p on the full row
    noise = jax.vmap(row_gumbel, in_axes=(0, 0, None))(t.seed, t.gen_index, vocab_size)
    return argmax(scaled + jnp.where(random_rows[:, None], noise, 0.0))


def effective_top_k(top_k: jax.Array, vocab_size: int) -> jax.Array:
    return jnp.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)


@partial(jax.jit, static_argnames="pivots", inline=True)   # one trace a shape for all filter variants; inlined
def filter_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
                       pivots: int = SEARCH_PIVOTS) -> jax.Array:
    """Keep each row's top_k largest, then the fewest of those whose renormalised mass (softmax over the top-k
    set) reaches top_p (top_p >= 1 keeps them all). Cut by value, so ties with the last kept token are kept too;
    NaN counts as -inf. No sort: each cut is an exact threshold on the values' order-preserving u32 keys, which a
    search finds in a fixed number of passes over the rows (`search_passes(pivots)` each)."""
    x = jnp.where(jnp.isnan(logits), NEG_INF, logits)
    rows = chunked(x)
    top = x.max(axis=-1, keepdims=True)
    weights = jnp.exp(jnp.where(rows == top[..., None], 0.0, rows - top[..., None]))  # also right at max = inf
    top_k, top_p = top_k[:, None].astype(jnp.float32), top_p[:, None]
    lowest, highest = jnp.zeros_like(top, jnp.uint32), jnp.full_like(top, 2**32 - 1, jnp.uint32)
    kth = threshold(rows, jnp.ones_like(rows), lambda _: top_k, lowest, highest, pivots)
    goal = lambda kept_mass: jnp.where(top_p >= 1.0, jnp.inf, top_p * kept_mass)  # 1: no rounding cuts the tail
    cutoff = threshold(rows, weights, goal, kth, order_key(top), pivots)  # the top-p cut is at or above kth
    return jnp.where(x >= key_value(cutoff), x, NEG_INF)


def chunked(x: jax.Array) -> jax.Array:
    """[S, V] -> [S, C, W], -inf padded (-inf changes no count that matters, and weighs 0): rows of at most
    SEARCH_CHUNK, which XLA reduces whole. A longer row's reduction it splits into two kernels, which makes the
    filter slower on GPU."""
    num_chunks = -(-x.shape[1] // SEARCH_CHUNK)
    width = -(-x.shape[1] // num_chunks)
    padded = jnp.pad(x, ((0, 0), (0, num_chunks * width - x.shape[1])), constant_values=NEG_INF)
    return padded.reshape(x.shape[0], num_chunks, width)


def order_key(x: jax.Array) -> jax.Array:
    """f32 -> u32 in the same order, -0 = +0, -inf below every finite value: sign-magnitude to offset binary."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    magnitude, zero = bits & 0x7FFFFFFF, jnp.uint32(2**31)
    return jnp.where(bits >> 31 == 1, zero - magnitude, zero + magnitude)


def key_value(key: jax.Array) -> jax.Array:
    """The f32 v with x >= v exactly where order_key(x) >= key, for x not NaN: order_key's inverse, -inf below
    its range and NaN (nothing is >= it) above."""
    zero = jnp.uint32(2**31)
    value = jax.lax.bitcast_convert_type(jnp.where(key >= zero, key - zero, (zero - key) | zero), jnp.float32)
    return jnp.where(key < order_key(jnp.float32(NEG_INF)), NEG_INF, value)


def threshold(rows: jax.Array, weights: jax.Array, goal: Callable[[jax.Array], jax.Array], lo: jax.Array,
              hi: jax.Array, pivots: int) -> jax.Array:
    """Per row, the largest key t in [lo, hi] (u32 [S, 1]) with mass(order_key(rows) >= t) >= goal(that mass at
    lo), which must hold at lo: a (pivots + 1)-ary search whose every pass sums the weights above lo and `pivots`
    evenly spaced cuts past it in one read of the rows, narrowing [lo, hi] (pivots + 1)-fold. Python-unrolled:
    a data-dependent loop would read its predicate back to the host. Mass falls as t rises, so the cuts that reach
    the goal are the first n."""
    target = None
    for _ in range(search_passes(pivots)):
        width = hi - lo
        step = width // (pivots + 1) + 1

        def cut(i):  # cut(0) = lo, cut(pivots) <= hi; u32 throughout, so no step overflows
            return lo + jnp.minimum(i * step, width)

        mass = mass_above(rows, weights, key_value(cut(jnp.arange(pivots + 1, dtype=jnp.uint32))))
        target = goal(mass[:, :1]) if target is None else target
        n = (mass[:, 1:] >= target).sum(axis=-1, keepdims=True, dtype=jnp.uint32)
        lo, hi = cut(n), jnp.where(n < pivots, cut(n + 1) - 1, hi)
    return lo


def search_passes(pivots: int) -> int:
    """Passes that narrow 2**32 keys to one, (pivots + 1)-fold each."""
    return next(n for n in range(1, 33) if (pivots + 1) ** n >= 2**32)


def mass_above(rows: jax.Array, weights: jax.Array, cuts: jax.Array) -> jax.Array:
    """[S, K]: the summed weights [S, C, W] of each row's values at or above each of its K cuts [S, K]. One variadic
    reduction, so one kernel reads the rows once for all the cuts (a reduction over a broadcast [S, K, C, W] is
    slower on GPU)."""
    above = tuple(jnp.where(rows >= cuts[:, i, None, None], weights, 0.0) for i in range(cuts.shape[1]))
    sums = jax.lax.reduce(above, (np.float32(0),) * len(above), lambda a, b: tuple(map(jnp.add, a, b)), (2,))
    return jnp.stack(sums, axis=-1).sum(axis=1)


def filter_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drop tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p); min_p 0 keeps all."""
    cutoff = logits.max(axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
    return jnp.where(logits >= cutoff, logits, NEG_INF)


def row_gumbel(seed: jax.Array, gen_index: jax.Array, vocab_size: int) -> jax.Array:
    key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), gen_index)
    return jax.random.gumbel(key, (vocab_size,), jnp.float32)


def raw_logprobs(logits: jax.Array, tokens: jax.Array, num_logprobs: int) -> SamplerOutput:
    logsumexp = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    logprob = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - logsumexp[:, 0]
    top_logits, top_ids = jax.lax.top_k(logits, num_logprobs)
    return SamplerOutput(tokens, logprob, top_ids.astype(jnp.int32), top_logits - logsumexp)


def make_sampling_tensors(params: Sequence[SamplingParams], seeds: Sequence[int], gen_indices: Sequence[int],
                          *, num_rows: int, eos_token_ids: Sequence[int] = ()) -> SamplingTensors:
    """Host-side (numpy) tensors for the first len(params) rows; the rest up to num_rows are greedy padding.
    seeds: each request's seed (its params.seed, or one the engine drew for it; int64). While a request has
    generated fewer than min_tokens, its stop_token_ids and (unless ignore_eos) the EOS ids are suppressed.
    Each distinct SamplingParams is read once (a batch's rows mostly share a few): rows index its columns."""
    if not len(params) == len(seeds) == len(gen_indices) <= num_rows:
        raise ValueError(f"params, seeds and gen_indices need one entry per row, at most num_rows={num_rows}")
    distinct, which = distinct_params(params)
    column = partial(distinct_column, distinct, which, num_rows=num_rows)
    seed64, gen_index = np.zeros(num_rows, "<u8"), np.zeros(num_rows, np.int32)
    seed64[:len(seeds)], gen_index[:len(gen_indices)] = np.array(seeds, np.int64).view(np.uint64), gen_indices
    return SamplingTensors(
        temperature=column("temperature", 0.0, np.float32), top_k=column("top_k", 0, np.int32),
        top_p=column("top_p", 1.0, np.float32), min_p=column("min_p", 0.0, np.float32),
        presence_penalty=column("presence_penalty", 0.0, np.float32),
        frequency_penalty=column("frequency_penalty", 0.0, np.float32),
        repetition_penalty=column("repetition_penalty", 1.0, np.float32),
        seed=np.ascontiguousarray(seed64.view("<u4").reshape(num_rows, 2)[:, ::-1]),   # [high, low] words
        gen_index=gen_index,
        suppress_ids=suppressed_rows(distinct, which, gen_index[:len(params)], eos_token_ids, num_rows))


def distinct_params(params: Sequence[SamplingParams]) -> tuple[list[SamplingParams], np.ndarray]:
    """Each SamplingParams object of params once, and per row the index of its own among them. (By object.__hash__,
    the object's address rotated, unique while it lives; not id(), which an audit hook, filelock's, makes run Python
    code at every call.)"""
    _, first, which = np.unique(np.fromiter(map(object.__hash__, params), np.int64, len(params)),
                                return_index=True, return_inverse=True)
    return [params[i] for i in first], which


def distinct_column(distinct: list[SamplingParams], which: np.ndarray, name: str, fill, dtype, *,
                    num_rows: int) -> np.ndarray:
    """One field per row (`which`: each row's index in distinct), `fill` below the rows."""
    out = np.full(num_rows, fill, dtype)
    out[:len(which)] = np.array([getattr(p, name) for p in distinct], dtype)[which]
    return out


def suppressed_rows(distinct: list[SamplingParams], which: np.ndarray, gen_index: np.ndarray,
                    eos_token_ids: Sequence[int], num_rows: int) -> np.ndarray:
    """[num_rows, SUPPRESS_WIDTH] each row's ids to suppress (suppressed_ids while under its min_tokens), -1 padded."""
    ids = np.full((num_rows, SUPPRESS_WIDTH), -1, np.int32)
    if not any(p.min_tokens for p in distinct):
        return ids
    under = gen_index < np.array([p.min_tokens for p in distinct], np.int32)[which]
    table = np.full((len(distinct), SUPPRESS_WIDTH), -1, np.int32)
    for i in np.unique(which[under]):
        row_ids = suppressed_ids(distinct[i], eos_token_ids)
        if len(row_ids) > SUPPRESS_WIDTH:
            raise ValueError(f"{len(row_ids)} EOS and stop ids to suppress; at most {SUPPRESS_WIDTH}")
        table[i, :len(row_ids)] = row_ids
    ids[:len(which)][under] = table[which[under]]
    return ids


def suppressed_ids(p: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """The ids a request's rows suppress while it has generated fewer than min_tokens."""
    eos = [] if p.ignore_eos else list(eos_token_ids)
    return list(dict.fromkeys(eos + p.stop_token_ids))
