"""The model runner: device state (weights, the KV cache, penalty state, the previous step's samples), the device
slots of the running sequences (a slot: a sequence's block-table row and penalty state, for its life in the
batch), and running a step through the step graphs. `execute` consumes one `SchedulerOutput`: its host work makes
one `DeviceStep`, which `launch` runs (so does every worker process of a multi-host engine, engine/distributed.py)."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core
from jax._src.lib import xla_client as xc

from jaxserve.cache.block_table import BlockTable, KVRowTable
from jaxserve.cache.kv_cache import KVCache, copy_bucket, pad_block_copies
from jaxserve.engine.drafter import DraftInputs, draft_inputs
from jaxserve.engine.sampler import SamplerOutput, distinct_params, init_penalty_state, mode_for
from jaxserve.engine.sampling_params import MAX_LOGPROBS
from jaxserve.engine.scheduler import SchedulerOutput, StepRow
from jaxserve.engine.sequence import PENDING, Sequence
from jaxserve.engine.step_graphs import GraphKey, PromptLogprobs, StepGraphs, kv_addressing
from jaxserve.engine.step_inputs import StepInputs, pack, pad


@dataclass(slots=True)
class Unsampled:
    """A constrained step launched up to its sampler: the model's logits and the sampler's inputs (their bytes, its
    graph's key), waiting for the token bitmask."""
    logits: jax.Array
    sampler_bytes: jax.Array
    key: GraphKey
    prompt: PromptLogprobs | None

    @property
    def num_rows(self) -> int:
        rows, *_, width = self.key.dims
        return rows * width


class StableBuffers:
    """The model graphs' buffers keep their addresses from step to step. On a GPU XLA runs a graph as one CUDA graph
    and records it again, with the device idle, whenever a buffer it reads or writes has moved: milliseconds at
    every step if each step's inputs and outputs were new arrays. So a step's model inputs are sent as one byte
    buffer (a transfer costs the host the same whatever its size), which the model graph copies into its temp buffer
    outside its CUDA graph (step_graphs.run_sent_model), and its logits and hidden states are written over the last
    ones of their shapes (donated outputs). The sampler's inputs are sent as bytes too (its small graph is recorded
    again at every step: its outputs rotate through SAMPLED_RING buffers, since the host reads a step's samples
    while the next steps run and a new array left alive across a step would move the next step's scratch memory,
    XLA's temp buffer). A step's sent buffers are made before anything else of the step is allocated and held
    until the step before it is done (HELD_STEPS): they then take the places of those of two steps before, each step
    finds the allocator as the last one left it, and the temp buffer stays where it was. (A transfer's buffer
    dropped at once is freed whenever its copy finishes, in between a step's allocations: the temp buffer moves.)"""
    SAMPLED_RING = 3
    HELD_STEPS = 2   # the step being launched and the one in flight: older ones are done when the next launches

    def __init__(self, graphs: StepGraphs):
        self.graphs = graphs
        self.outputs: dict[tuple, jax.Array] = {}    # (0: logits | 1: hidden, shape) -> a free output buffer
        self.sampled: dict[tuple, list[SamplerOutput]] = {}   # sampler graph dims -> its outputs, oldest first
        self.held: deque[list] = deque(maxlen=self.HELD_STEPS)   # per recent step, its sent inputs
        # a CPU's arrays are host memory already: a host view of one would keep its buffer from being donated again
        self.copies_to_host = graphs.mesh.devices.flat[0].platform != "cpu"

    def allocate(self, keys: list[GraphKey]) -> None:
        """The buffers of every graph of keys, before serving: a step's first graph of a size would wait for them."""
        for key in keys:
            if key.kind == "model":
                self.keep_outputs(*self.take_outputs(key))
            elif key.kind == "sampler":
                ring = self.sampled.setdefault(key.dims, [])
                ring += [self.sampled_buffers(key) for _ in range(self.SAMPLED_RING - len(ring))]

    def stage(self, inp: StepInputs) -> list[jax.Array | np.ndarray]:
        """The step's model and sampler inputs as two byte buffers on the device (step_inputs.pack), held for
        HELD_STEPS steps. (Across processes device_put would check that every process holds the same values, a
        collective a step: there the graphs take the host's bytes.)"""
        self.held.append([])   # the oldest step's buffers are let go first: the new ones take their places
        packed = [pack(inp.model), pack(inp.sampler)]
        if not self.graphs.replicated.is_fully_addressable:
            return packed
        self.held[-1] = [put_replicated(x, self.graphs.replicated) for x in packed]
        return self.held[-1]

    def take_outputs(self, key: GraphKey) -> tuple[jax.Array, jax.Array]:
        """The (logits, hidden) buffers the model graph of key writes over."""
        tokens, seqs, _, width, _ = key.dims
        structs = self.graphs.output_structs(tokens, seqs, width)
        free = [self.outputs.pop((i, x.shape), None) for i, x in enumerate(structs)]
        return tuple(self.zeros(x) if a is None else a for a, x in zip(free, structs))

    def sample(self, sampler: jax.stages.Compiled, key: GraphKey, logits, penalty, sampler_bytes, token_bitmask,
               last_tokens):
        """The sampler graph run over the oldest of its output buffers: (penalty, last tokens, SamplerOutput)."""
        ring = self.sampled.setdefault(key.dims, [])
        outputs = ring.pop(0) if len(ring) == self.SAMPLED_RING else self.sampled_buffers(key)
        penalty, last_tokens, out = sampler(logits, penalty, sampler_bytes, token_bitmask, last_tokens, outputs)
        ring.append(out)
        return penalty, last_tokens, self.copy_to_host_soon(out)

    def copy_to_host_soon(self, tree):
        """Start the outputs' copies to the host, to land as soon as they are computed: the host reads them a step
        later, and reading each array then would wait for its own copy."""
        if self.copies_to_host:
            for x in jax.tree.leaves(tree):
                x.copy_to_host_async()
        return tree

    def sampled_buffers(self, key: GraphKey) -> SamplerOutput:
        rows, _, num_logprobs, _, width = key.dims
        return jax.tree.map(self.zeros, SamplerOutput.structs(rows, num_logprobs, width))

    def zeros(self, like) -> jax.Array:
        """A new buffer of like's shape and dtype, from the host: no graph to compile while serving."""
        return put_replicated(np.zeros(like.shape, like.dtype), self.graphs.replicated)

    def keep_outputs(self, *arrays: jax.Array) -> None:
        for i, a in enumerate(arrays):
            self.outputs[(i, a.shape)] = a


def put_replicated(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """x copied to every device of a fully addressable sharding: the runtime call jax.device_put ends in, without
    its Python dispatch (0.1-0.3 ms for a step's two buffers, at every step)."""
    devices = sharding._addressable_device_assignment
    return xc.batched_device_put(core.ShapedArray(x.shape, x.dtype), sharding, [x] * len(devices), devices)


@dataclass(slots=True)
class DeviceStep:
    """What one `execute` launches, as host (numpy) data: block copies, penalty resets of newly placed sequences,
    the step's bucketed inputs. Each is None when the step has none."""
    copies: tuple[np.ndarray, np.ndarray] | None = None            # block ids src -> dst, unpadded
    resets: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None   # slots [R], prompt and output ids [R, W]
    inputs: StepInputs | None = None

    @property
    def empty(self) -> bool:
        return self.copies is None and self.resets is None and self.inputs is None


class ModelRunner:
    def __init__(self, graphs: StepGraphs, kv_cache: KVCache):
        cfg = self.cfg = graphs.cfg
        self.graphs, self.params, self.kv_cache = graphs, graphs.params, kv_cache
        self.num_blocks = graphs.num_blocks
        rows = graphs.kernels.blocks_per_row
        self.block_table = (KVRowTable(cfg.max_num_seqs, rows) if rows
                            else BlockTable(cfg.max_num_seqs, graphs.max_blocks_per_seq))
        self.free_slots = list(range(cfg.max_num_seqs - 1, -1, -1))
        self.slot_of: dict[int, int] = {}     # seq_id -> device slot
        self.prev_rows: dict[int, int] = {}   # seq_id -> row of the last launched step that samples it
        self.penalty = jax.jit(init_penalty_state, static_argnums=(0, 1), out_shardings=graphs.replicated)(
            cfg.max_num_seqs, graphs.model_config.vocab_size)
        self.last_tokens = jnp.zeros(graphs.seq_buckets[-1], jnp.int32,   # the previous step's samples, on device
                                     device=graphs.replicated)
        f = graphs.features   # EAGLE-3: the features of the last step that ran the head, and where each row's are
        self.features = None if f is None else jnp.zeros(f.shape, f.dtype, device=graphs.replicated)
        self.feature_rows: dict[int, tuple[int, int, int]] = {}   # seq_id -> (index, first position, positions)
        self.on_launch: Callable[[DeviceStep], None] | None = None
        self.cascade_steps = 0   # decode steps that attended shared prefixes once per group
        self.buffers = StableBuffers(graphs)

    def observe_launches(self, on_launch: Callable[[DeviceStep], None] | None) -> None:
        """on_launch sees each step before it launches (a multi-host leader publishes it); None: no one."""
        self.on_launch = on_launch

    def kv_addressing(self, slots: np.ndarray) -> dict:
        """Where the KV of the sequences in these device slots lies (step_graphs.kv_addressing)."""
        return kv_addressing(self.block_table.table[slots], self.graphs.kernels.blocks_per_row)

    def run(self, inp: StepInputs) -> tuple[SamplerOutput, PromptLogprobs | None] | Unsampled:
        """One step on ready inputs through the compiled graphs: device arrays, no sync. A constrained step stops
        before its sampler (Unsampled), which `sample` runs once the host has its token bitmask."""
        keys = self.graphs.keys_of(inp)
        model, sampler, *prompt = map(self.graphs.get, keys)
        split = self.graphs.draft_split(keys[0])
        cache, features = (self.kv_cache, self.features) if split is None else (self.kv_cache[:split], None)
        (model_bytes, sampler_bytes), outputs = self.buffers.stage(inp), self.buffers.take_outputs(keys[0])
        cache, logits, hidden, features = model(self.params, cache, self.last_tokens, model_bytes, features, outputs)
        self.buffers.keep_outputs(logits, hidden)
        self.kv_cache = cache if split is None else cache + self.kv_cache[split:]
        self.features = self.features if features is None else features
        prompt_out = self.buffers.copy_to_host_soon(prompt[0](self.params, hidden, inp.next_prompt_ids)) \
            if prompt else None
        if inp.sampler.constrained:
            return Unsampled(logits, sampler_bytes, keys[1], prompt_out)
        self.penalty, self.last_tokens, out = self.buffers.sample(sampler, keys[1], logits, self.penalty,
                                                                  sampler_bytes, None, self.last_tokens)
        return out, prompt_out

    def sample(self, step: Unsampled, token_bitmask: np.ndarray) -> tuple[SamplerOutput, PromptLogprobs | None]:
        """The sampler of a constrained step, under its token bitmask [S, ceil(V / 32)]."""
        self.penalty, self.last_tokens, out = self.buffers.sample(
            self.graphs.get(step.key), step.key, step.logits, self.penalty, step.sampler_bytes, token_bitmask,
            self.last_tokens)
        return out, step.prompt

    def execute(self, out: SchedulerOutput, ready: Callable[[], None] | None = None):
        """Apply the step's slot, block-table and cache changes and launch it: device outputs (None without
        rows), no sync. `ready` runs once the host work is done, before any device work is launched."""
        for seq_id in out.preempted + out.finished:
            self._release(seq_id)
        for seq in out.placed:
            self.slot_of[seq.seq_id] = self.free_slots.pop()
        for seq_id, start, block_ids in out.block_updates:
            self.block_table.write(self.slot_of[seq_id], start, block_ids)
        step = DeviceStep(out.copies if len(out.copies[0]) else None, self._penalty_resets(out.placed))
        if self.graphs.draft_def is not None and any(r.draft_ids for r in out.rows):
            self.launch(DeviceStep(step.copies))   # drafting reads the blocks a copy-on-write fills
            step.copies = None
            self.draft(out.rows)
        if out.rows:
            step.inputs = self.prepare_inputs(out.rows)
            self.prev_rows = {row.seq.seq_id: i for i, row in enumerate(out.rows) if row.samples}
            self._keep_feature_rows(out.rows, step.inputs)
        if self.on_launch is not None and not step.empty:
            self.on_launch(step)
        if ready is not None:
            ready()
        return self.launch(step)

    def launch(self, step: DeviceStep):
        """Run a step's device work: its outputs (None without inputs) as device arrays, no sync."""
        if step.copies is not None:
            self.copy_blocks(*step.copies)
        if step.resets is not None:
            self._reset_penalties(*step.resets)
        return None if step.inputs is None else self.run(step.inputs)

    def draft(self, rows: list[StepRow]) -> None:
        """The draft model's tokens for the rows that speculate (their drafts, placeholders so far, filled): one
        drafting graph, then the one sync that the verifying step's inputs need."""
        drafting = [r for r in rows if r.draft_ids]
        slots = [self.slot_of[r.seq.seq_id] for r in drafting]
        inp = draft_inputs([r.seq.token_ids[r.start] for r in drafting], [r.start for r in drafting],
                           self.block_table.table[slots], [len(r.draft_ids) for r in drafting],
                           self.graphs.drafts_key(len(drafting)).dims[0],
                           [self.feature_index(r.seq.seq_id, r.start - 1) for r in drafting])
        for row, tokens in zip(drafting, np.asarray(self.run_drafts(inp))):
            row.draft_ids = tuple(tokens[:len(row.draft_ids)].tolist())

    def run_drafts(self, inp: DraftInputs) -> jax.Array:
        """The drafting graph on ready inputs: drafts [S, k] as a device array; it takes (and updates) the draft's
        cache layers only."""
        split = self.graphs.draft_def.first_layer
        graph = self.graphs.get(self.graphs.drafts_key(len(inp.token_ids)))
        draft_cache, drafts = graph(self.params, self.kv_cache[split:], inp, self.features)
        self.kv_cache = self.kv_cache[:split] + draft_cache
        return drafts

    def feature_index(self, seq_id: int, position: int) -> int:
        """Where in `features` an EAGLE-3 head's features of a sequence's position are; -1: not there."""
        index, first, count = self.feature_rows.get(seq_id, (-1, 0, 0))
        return index + position - first if 0 <= position - first < count else -1

    def _keep_feature_rows(self, rows: list[StepRow], inp: StepInputs) -> None:
        """The positions whose features a step that runs an EAGLE-3 head keeps: each row's logits positions (its
        last known token and its drafts), at row x W + j (step_inputs' logits_indices)."""
        if self.features is None or not self.graphs.runs_draft(self.graphs.keys_of(inp)[0]):
            return
        width = inp.model.key[3]
        self.feature_rows = {}
        for i, row in enumerate(rows):
            src = row if row.logits_from < 0 else rows[row.logits_from]
            self.feature_rows[row.seq.seq_id] = (i * width, src.start + src.num_known - 1, 1 + len(src.draft_ids))

    def _release(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)   # None: finished before it was ever placed
        if slot is not None:
            self.block_table.clear_row(slot)
            self.free_slots.append(slot)

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """In chunks of the largest precompiled copy graph (a vattention fork copies a whole prompt); a chunk's
        sources are never another's destinations (copy-on-write and fork copies go to fresh blocks)."""
        chunk = copy_bucket(self.cfg.max_num_seqs)
        for i in range(0, len(src), chunk):
            s, d = pad_block_copies(src[i:i + chunk], dst[i:i + chunk], self.num_blocks)
            self.kv_cache = self.graphs.get(self.graphs.copy_key(len(s)))(self.kv_cache, s, d)

    def _penalty_resets(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Fresh penalty state for newly placed sequences (prompt mask; counts of tokens already generated): slots,
        prompt and output ids, padded to a seq bucket (padding rows reset the scratch slot) and a width of
        `reset_widths`."""
        if not seqs:
            return None
        outputs = [s.confirmed_output_ids for s in seqs]
        longest = max(s.num_prompt_tokens + len(o) for s, o in zip(seqs, outputs))
        rows, width = self.graphs.reset_key(len(seqs), longest).dims
        prompt, output = np.full((2, rows, width), -1, np.int32)
        for i, (s, o) in enumerate(zip(seqs, outputs)):
            prompt[i, :s.num_prompt_tokens] = s.token_ids[:s.num_prompt_tokens]
            output[i, :len(o)] = o
        return pad([self.slot_of[s.seq_id] for s in seqs], rows, fill=self.cfg.max_num_seqs), prompt, output

    def _reset_penalties(self, slots: np.ndarray, prompt: np.ndarray, output: np.ndarray) -> None:
        self.penalty = self.graphs.get(self.graphs.reset_key(*prompt.shape))(self.penalty, slots, prompt, output)

    def prepare_inputs(self, rows: list[StepRow]) -> StepInputs:
        seqs, counts, starts = [r.seq for r in rows], [r.count for r in rows], [r.start for r in rows]
        params = [s.params for s in seqs]
        drafted = any(r.draft_ids for r in rows)
        one_each = counts.count(1) == len(counts)
        if one_each and not drafted:   # one token a row: the last known one
            token_ids = np.array([s.token_ids[start] for s, start in zip(seqs, starts)], np.int32)
        else:
            token_ids = np.array([t for r in rows for t in (*r.seq.token_ids[r.start:r.start + r.num_known],
                                                            *r.draft_ids)], np.int32)
        slots = np.array([self.slot_of[s.seq_id] for s in seqs], np.int32)
        # the features below are per request: asked of each distinct SamplingParams first (rows mostly share a few)
        requests, which = distinct_params(params)
        samples = np.fromiter((r.samples for r in rows), bool, len(rows))
        sampling = [requests[i] for i in np.unique(which[samples])]
        prompt = any(p.prompt_logprobs is not None for p in requests) and any(
            r.seq.params.prompt_logprobs is not None and r.start < r.seq.num_prompt_tokens for r in rows)
        # prompt logprobs' graphs exist for token buckets only: their steps never pad tokens to a seq bucket
        decode_only = one_each and not prompt
        constrained = any(p.structured_outputs is not None for p in sampling)
        width = self.cfg.speculative_config.width if drafted else 1
        addressing = self.kv_addressing(slots)
        shared = self.graphs.share_prefixes(addressing.get("block_tables"), starts) \
            if decode_only and width == 1 else []
        self.cascade_steps += bool(shared)
        tokens, rows_bucket, decode_only, _, groups = self.graphs.model_key(
            len(token_ids), len(rows), decode_only, width, cascade=bool(shared)).dims
        return self.graphs.step_inputs(
            num_tokens=tokens, num_seqs=rows_bucket, decode_only=decode_only, **addressing, cascade_groups=groups,
            shared=shared,
            starts=starts, counts=counts, token_ids=np.where(token_ids == PENDING, 0, token_ids),
            slots=slots, sample_mask=samples, params=params,
            seeds=[s.seed for s in seqs], num_generated=[r.num_generated for r in rows],
            logits_from=[r.logits_from for r in rows], prev_index=self._prev_index(rows, counts, token_ids),
            feature_index=None if self.features is None else
            [self.feature_index(r.seq.seq_id, r.start - 1) for r in rows],
            next_prompt_ids=next_prompt_ids(rows, len(token_ids)) if prompt else None,
            num_logprobs=MAX_LOGPROBS if any(p.logprobs for p in requests) else 0,
            sampler_mode=mode_for(sampling, self.graphs.model_config.vocab_size, constrained), constrained=constrained,
            draft_ids=[r.draft_ids for r in rows] if width > 1 else None, spec_width=width)

    def _prev_index(self, rows: list[StepRow], counts: list[int], token_ids: np.ndarray) -> np.ndarray:
        """Per input token, the row of the previous step that sampled it while it is still on the device."""
        prev_index = np.full(len(token_ids), -1, np.int32)
        pending = np.flatnonzero(token_ids == PENDING)   # only a row's last known token can still be pending
        owners = np.searchsorted(np.cumsum(counts), pending, side="right")
        prev_index[pending] = [self.prev_rows[rows[i].seq.seq_id] for i in owners]
        return prev_index


def next_prompt_ids(rows: list[StepRow], num_tokens: int) -> np.ndarray:
    """Per input token, the prompt token after it (prompt logprobs); -1 past the prompt and for other rows."""
    ids, lo = np.full(num_tokens, -1, np.int32), 0
    for r in rows:
        if r.seq.params.prompt_logprobs is not None and r.start < r.seq.num_prompt_tokens:
            nxt = r.seq.token_ids[r.start + 1:min(r.start + r.count + 1, r.seq.num_prompt_tokens)]
            ids[lo:lo + len(nxt)] = nxt
        lo += r.count
    return ids
