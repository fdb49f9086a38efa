"""LLMEngine: add_request / step / abort. It owns requests and their outputs (tokenization, stop checks,
detokenization); each step is `scheduler.schedule()` -> `runner.execute(output)`, and the sampled tokens that
come back are turned into outputs. Device state is the runner's."""
from __future__ import annotations

import itertools
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.cache.kv_backend import KVManager, make_kv_backend
from jaxserve.cache.kv_cache import is_quantized_kv, kv_cache_dtype, kv_dtype_name
from jaxserve.compilation_cache import enable_compilation_cache
from jaxserve.config import MODEL_DRAFTERS, EngineConfig
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.drafter import load_draft
from jaxserve.engine.huge_pages import collapse_to_huge_pages
from jaxserve.engine.runner import ModelRunner, Unsampled
from jaxserve.engine.sampling_params import (INT32_MAX, RequestOutputKind, SamplingParams, StructuredOutputsParams,
                                             check_text, short)
from jaxserve.engine.scheduler import Scheduler, StepRow
from jaxserve.engine.speculation import SpeculationStats, Speculator
from jaxserve.engine.step_graphs import StepGraphs
from jaxserve.engine.structured_outputs import StructuredOutputs
from jaxserve.engine.sequence import (CompletionOutput, RequestOutput, Sequence, next_seq_id,
                                      stable_seed)
from jaxserve.models.kv_calibration import calibrate_kv_scales, calibration_ids
from jaxserve.models.llama import fuse_qkv
from jaxserve.models.loader import LoadedModel
from jaxserve.sharding import TP

MAX_PROMPT_BYTES_PER_TOKEN = 128   # a prompt of more bytes than max_model_len tokens could hold is refused untokenized
MAX_CACHE_SALT_CHARS = 256         # the salt is hashed into every block hash of the request


def check_cache_salt(cache_salt) -> None:
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {short(cache_salt)}")
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt: at most {MAX_CACHE_SALT_CHARS} characters, got {len(cache_salt):,}")
    check_text("cache_salt", cache_salt)


class AdmissionError(ValueError):
    """A well-formed request the engine cannot take. Servers answer RESOURCE_EXHAUSTED, not INVALID_ARGUMENT."""


class NeverFits(AdmissionError):
    """The request could never fit the KV pool: the client must ask for less (HTTP 400)."""


class QueueFull(AdmissionError):
    """The queue bounds are reached: retry later (HTTP 429)."""


@dataclass(slots=True)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.finished for s in self.seqs)


@dataclass(slots=True)
class Launched:
    rows: list[StepRow]
    out: tuple | Unsampled   # (SamplerOutput, PromptLogprobs | None) as device arrays; Unsampled: constrained
    mask: Future | None = None   # Unsampled: its token bitmask, being filled on the mask thread


def fit_to_model(cfg: EngineConfig, max_position_embeddings: int) -> EngineConfig:
    """cfg with max_model_len decided by the model (what EngineConfig cannot check alone): the model's context
    length when none is given; a given one past it is an error."""
    if cfg.max_model_len is None:
        return replace(cfg, max_model_len=max_position_embeddings)
    if cfg.max_model_len > max_position_embeddings:
        raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's max_position_embeddings="
                         f"{max_position_embeddings}: lower max_model_len (--max-model-len)")
    return cfg


def fit_to_kv_pool(cfg: EngineConfig, kv: KVManager, given: bool) -> EngineConfig:
    """The model's max_model_len capped to what the KV cache holds for one sequence, said in one line (the block
    tables keep the model's width: the pool is sized after the graphs). A given one stays (the line says so):
    requests past the pool are refused one by one (NeverFits)."""
    held, block_size = kv.max_tokens_per_seq, kv.block_size
    if held >= cfg.max_model_len:
        return cfg
    pool = f"the KV cache holds {held:,} tokens per sequence ({held // block_size:,} blocks of {block_size})"
    if given:
        print(f"max_model_len {cfg.max_model_len:,} (given): {pool}, so longer requests are refused; more blocks "
              "(num_blocks, memory_fraction) or a lower max_model_len match them", file=sys.stderr)
        return cfg
    print(f"max_model_len {cfg.max_model_len:,} (the model's) capped to {held:,}: {pool}; more blocks (num_blocks, "
          "memory_fraction) raise it", file=sys.stderr)
    return replace(cfg, max_model_len=held)


def tensor_parallel_mesh(loaded: LoadedModel, cfg: EngineConfig) -> Mesh:
    """The mesh the model was loaded on, which must be the config's tensor_parallel_size devices."""
    if (tp := loaded.mesh.shape[TP]) != cfg.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={cfg.tensor_parallel_size} but the model was loaded on {tp} "
                         f"device(s): load it with tensor_parallel_size={cfg.tensor_parallel_size} "
                         f"(models.loader.load_run, or load_model(mesh=make_mesh({cfg.tensor_parallel_size})))")
    return loaded.mesh


def weight_dtype(loaded: LoadedModel) -> str:
    """The linear layers' weight dtype, as stats and metrics name it (a GGUF block type in lower case: q4_1)."""
    if loaded.gguf_blocks is not None:
        return loaded.gguf_blocks.linear.lower()
    return "float8_e4m3fn" if loaded.quantization == "fp8" else loaded.dtype.name


def sampling_defaults(loaded: LoadedModel, cfg: EngineConfig) -> dict:
    """What requests take for the sampling fields they leave unset (SamplingParams.with_defaults): the model's
    recommended values under generation_config "auto", said in one line at start; none ("vllm": vLLM's)."""
    if cfg.generation_config == "vllm" or not loaded.sampling_defaults:
        return {}
    shown = ", ".join(f"{name}={value}" for name, value in loaded.sampling_defaults.items())
    print(f"default sampling parameters from the model's generation config: {shown} (a request's own values "
          "override them; --generation-config vllm leaves vLLM's)", file=sys.stderr)
    return loaded.sampling_defaults


def start_device(loaded: LoadedModel, cfg: EngineConfig) -> tuple[StepGraphs, ModelRunner, KVManager]:
    """The device side's start-up, in its one order: q, k and v fused into one layer on one device -> the KV
    backend's layout (the kernels address it) -> the step
    graphs (a CPU's weights moved onto huge pages) -> the cache's size (from the activation peak when memory sizes
    it) -> the graphs bound to that size (every key final) -> precompile (before the cache takes the memory:
    compiling, autotuning, needs room) -> the cache allocated and the runner over it (with every graph's input
    and output buffers) -> the host block manager. A multi-host worker runs it too: sizing is a collective.
    max_model_len: the model's unless cfg gives one (fit_to_model), in graphs.cfg."""
    cfg = fit_to_model(cfg, loaded.config.max_position_embeddings)
    mesh = tensor_parallel_mesh(loaded, cfg)
    kv_dtype = kv_cache_dtype(cfg.kv_cache_dtype, loaded.dtype, mesh.devices.flat[0].platform)
    if is_quantized_kv(kv_dtype) and not loaded.kv_scales_loaded:
        print("calibrating the FP8 KV cache's scales", file=sys.stderr)
        calibrate_kv_scales(loaded.model, calibration_ids(loaded.tokenizer, loaded.config.vocab_size))
    spec = cfg.speculative_config
    draft = load_draft(spec, loaded) if spec is not None and spec.method in MODEL_DRAFTERS else None
    # an EAGLE-3 head's FP8 KV keeps unit scales: it reads no text of its own to calibrate on
    if spec and spec.method == "draft" and is_quantized_kv(kv_dtype) and not draft.kv_scales_loaded:
        calibrate_kv_scales(draft.model, calibration_ids(loaded.tokenizer, draft.config.vocab_size))
    if mesh.size == 1:
        fuse_qkv(loaded.model)
    backend = make_kv_backend(cfg, loaded.config, mesh, kv_dtype, draft and draft.config)
    graphs = StepGraphs(loaded, cfg, mesh, backend, draft)
    if mesh.devices.flat[0].platform == "cpu":
        collapse_to_huge_pages(graphs.params)
    num_blocks = backend.size(graphs.activation_peak)
    graphs.bind_cache(num_blocks)
    if cfg.precompile:
        graphs.precompile()
    else:
        graphs.prefetch()
    runner = ModelRunner(graphs, backend.allocate(num_blocks))
    if cfg.precompile:
        runner.buffers.allocate(graphs.graph_keys())
    backend.release_at_exit(runner)
    return graphs, runner, backend.host_manager(num_blocks)


class LLMEngine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig | None = None):
        given = cfg or EngineConfig()
        enable_compilation_cache(given.compile_cache_dir)
        self.loaded, self.tokenizer = loaded, loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.sampling_defaults = sampling_defaults(loaded, given)
        self.graphs, self.runner, self.kv = start_device(loaded, given)
        self.cfg = cfg = fit_to_kv_pool(self.graphs.cfg, self.kv, given=given.max_model_len is not None)
        self.scheduler = Scheduler(cfg, self.kv)
        self.structured = StructuredOutputs(self.tokenizer, loaded.config.vocab_size, self.eos_token_ids)
        spec = cfg.speculative_config
        self.speculator = None if spec is None else Speculator(spec, cfg.max_model_len,
                                                               self.graphs.spec_seq_buckets)
        self._emitted = 0   # tokens the step call emitted so far (the speculator times decode steps by them)
        self.requests: dict[str, Request] = {}
        self._constrained_requests = 0   # requests under structured outputs: no step speculates while any is here
        self._request_ids = itertools.count()
        self._inflight: Launched | None = None    # the launched step whose samples are not yet on the host
        self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="jaxserve-mask")   # llguidance frees the GIL
        self.graphs.start_serving()

    # ---- requests -----------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                    prompt_token_ids: list[int] | None = None) -> str:
        """Queue a request; bad input raises ValueError naming the field (AdmissionError: well-formed but not
        admitted) and changes nothing. `prompt_token_ids`: the text prompt already tokenized (servers tokenize
        off the engine's thread). The sampling fields params leave unset take sampling_defaults."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self._prompt(prompt, prompt_token_ids)
        params = params.with_defaults(self.sampling_defaults, self.cfg.max_model_len - len(ids))
        self._check_request(ids, params)
        check_cache_salt(cache_salt)
        if not isinstance(priority, int) or isinstance(priority, bool) or not -INT32_MAX - 1 <= priority <= INT32_MAX:
            raise ValueError(f"priority must be an int32, got {short(priority)}")
        request_id = str(next(self._request_ids)) if request_id is None else str(request_id)
        check_text("request_id", request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        matcher = self._matcher(params)
        req = Request(request_id, text, ids, params)
        seed = params.seed if params.seed is not None else stable_seed(self.cfg.seed, request_id)
        seq_id = next_seq_id()
        if params.prompt_logprobs is not None:   # every prompt position must be computed: no prefix-cache hits
            cache_salt = f"{cache_salt}/prompt-logprobs-{seq_id}"
        seq = Sequence(seq_id, request_id, 0, list(ids), len(ids), params, seed, priority,
                       cache_salt=cache_salt, num_forks_pending=params.n - 1,
                       prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(ids))
        seq.detokenizer, seq.matcher = self._detokenizer(ids, params), matcher
        req.seqs.append(seq)
        self.requests[request_id] = req
        self._constrained_requests += matcher is not None
        self.scheduler.add(seq)
        return request_id

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text; thread-safe (no engine state). Text longer than max_model_len tokens could be is
        refused before the tokenizer spends time on it."""
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass token ids")
        limit = self.cfg.max_model_len * MAX_PROMPT_BYTES_PER_TOKEN
        # a text of more characters than the limit has more bytes too: it is refused unencoded
        num_bytes = len(text) if len(text) > limit else len(check_text("prompt", text))
        if num_bytes > limit:
            raise ValueError(f"prompt: at least {num_bytes:,} bytes cannot fit max_model_len="
                             f"{self.cfg.max_model_len} tokens (at most {limit:,} bytes)")
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def _prompt(self, prompt, token_ids) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str) and token_ids is None:
            return prompt, self.tokenize(prompt)   # which checks the text
        if isinstance(prompt, str):
            check_text("prompt", prompt)
            return prompt, self._prompt(token_ids, None)[1]
        if isinstance(prompt, (list, tuple)):
            self.check_prompt_length(len(prompt))   # before any per-id work
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile a structured-outputs constraint into the engine's cache (ValueError if invalid); thread-safe:
        servers call it off the engine's thread, so that add_request finds it compiled."""
        self.structured.compile(spec)

    def _matcher(self, params: SamplingParams):
        if params.structured_outputs is None:
            return None
        if self.runner.on_launch is not None:
            raise ValueError("structured_outputs: not served by a multi-host engine")
        return self.structured.matcher(params.structured_outputs)

    def check_prompt_length(self, num_tokens: int) -> None:
        if num_tokens >= self.cfg.max_model_len:
            raise ValueError(f"prompt has {num_tokens:,} tokens; max_model_len={self.cfg.max_model_len} leaves no "
                             "room to generate")

    def _check_request(self, ids: list[int], params: SamplingParams) -> None:
        vocab = self.loaded.config.vocab_size
        if not ids:
            raise ValueError("prompt is empty")
        self.check_prompt_length(len(ids))
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.cfg.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens:,} with the prompt's {len(ids):,} tokens exceeds "
                             f"max_model_len={self.cfg.max_model_len:,}: ask for at most "
                             f"{self.cfg.max_model_len - len(ids):,}")
        if params.n > self.cfg.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.cfg.max_num_seqs}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; use stop_token_ids")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        self._check_fits(len(ids), params)
        self._check_queue(len(ids))

    def _check_fits(self, num_prompt: int, params: SamplingParams) -> None:
        """A sequence longer than the KV pool would wait forever (or preempt itself forever): refuse it now; so
        is a request whose n copies of the prompt can never fit together (vattention forks copy it)."""
        cfg, kv = self.cfg, self.kv
        total = min(num_prompt + (params.max_tokens or cfg.max_model_len), cfg.max_model_len)
        if total > kv.max_tokens_per_seq:
            raise NeverFits(f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) can reach "
                                 f"{total} tokens; the KV pool holds {kv.max_tokens_per_seq} per sequence "
                                 f"(num_blocks={kv.num_blocks}): lower max_tokens or give the cache more blocks")
        if not kv.forks_fit(num_prompt, params.n):
            raise NeverFits(f"n={params.n} copies of the prompt ({num_prompt} tokens) can never fit the KV pool "
                            f"together (kv_backend={cfg.kv_backend}): lower n or give the cache more memory")

    def _check_queue(self, num_prompt: int) -> None:
        waiting, max_requests, max_tokens = self.scheduler.waiting, self.cfg.max_queued_requests, \
            self.cfg.max_queued_tokens
        if max_requests is not None and len(waiting) >= max_requests:
            raise QueueFull(f"queue full: {len(waiting)} requests wait (max_queued_requests={max_requests}); "
                                 "retry later")
        queued = sum(s.num_tokens - s.num_computed_tokens for s in waiting) if max_tokens is not None else 0
        if max_tokens is not None and queued + num_prompt > max_tokens:
            raise QueueFull(f"queue full: {queued} prompt tokens wait and {num_prompt} more would exceed "
                                 f"max_queued_tokens={max_tokens}; retry later")

    def _detokenizer(self, prompt_ids, params):
        return None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, prompt_ids, params)

    def abort(self, request_id: str) -> bool:
        """Stop a request at once and free its blocks; False if it is unknown or already finished."""
        req = self._forget(request_id)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.finished:
                self._finish(seq, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        inflight = self._inflight is not None and any(r.samples and not r.seq.finished for r in self._inflight.rows)
        return self.scheduler.has_work() or inflight

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch step N+1, then finish step N while the device runs N+1 (async scheduling: the host work of
        a step hides behind the device's); synchronous: launch and finish the same step. Under structured outputs
        N+1's token bitmask is filled on the mask thread once N's tokens are in its matchers, while N's outputs and
        N+2's schedule are made; N+1's sampler launches just before N+2's model. A step that speculates finishes
        N first (its drafts are proposed from every token so far) and, with drafts, is finished before it returns."""
        if self.speculator is None:
            return self._step()
        running = self.scheduler.running
        start, decoding, self._emitted = time.perf_counter(), sum(not s.is_prefill for s in running), 0
        steady = decoding == len(running) and not self.scheduler.waiting   # prefills would blur the timing
        speculating = self.speculator.wants(decoding, self._constrained_requests > 0)
        outputs = self._speculative_step() if speculating else self._step()
        if steady:
            self.speculator.observe(decoding, speculating, time.perf_counter() - start, self._emitted)
        return outputs

    def _step(self) -> list[RequestOutput]:
        if not self.cfg.async_scheduling:
            return self.complete_step(self.launch_step())
        done = self._inflight
        self._inflight = self.launch_step(before=done)
        return self.complete_step(done)

    def _speculative_step(self) -> list[RequestOutput]:
        """The step in flight finished, drafts proposed from every token, the next step launched and, with drafts,
        finished too: the outputs of both (a request's latest)."""
        outputs, self._inflight = self.complete_step(self._inflight), None
        drafted = self.speculator.propose(self.scheduler.running)
        launched = self.launch_step()
        if self.cfg.async_scheduling and not drafted:   # no drafts: the step runs as any other
            self._inflight = launched
            return outputs
        latest = {out.request_id: out for out in outputs + self.complete_step(launched)}   # outputs are cumulative
        return list(latest.values())

    def launch_step(self, before: Launched | None = None) -> Launched | None:
        """Schedule the next step and launch it: its device outputs, not yet on the host (the first half of
        `step`, public so that a profiler can time each half). `before`: a launched step whose sampler (if it
        waits for its mask) must run first."""
        output = self.scheduler.schedule()
        for child in output.forks:
            req = self.requests[child.request_id]
            child.detokenizer, child.matcher = self._detokenizer(req.prompt_token_ids, req.params), \
                self._matcher(req.params)
            req.seqs.append(child)
        out = self.runner.execute(output, ready=lambda: self._sample_constrained(before))
        return None if out is None else Launched(output.rows, out)

    def complete_step(self, launched: Launched | None) -> list[RequestOutput]:
        """Bring a step's samples to the host (the step's one device->host sync) and act on them."""
        if launched is None:
            return []
        self._sample_constrained(launched)
        out, prompt_lp = jax.tree.map(np.asarray, launched.out)
        width = 1 if out.num_accepted is None else len(out.tokens) // len(out.num_accepted)   # tokens: [rows x W]
        grammars_go_on = self._advance_grammars(launched.rows, out.tokens[::width])
        self._fill_mask(self._inflight)   # async: the next step's, now that this step's tokens are in the matchers
        touched: dict[str, Request] = {}
        now, flat, tokens = time.monotonic(), 0, out.tokens.tolist()   # a list: its items read as ints at once
        for i, row in enumerate(launched.rows):
            seq, flat = row.seq, flat + row.count
            if prompt_lp is not None and seq.prompt_logprobs is not None and row.start < seq.num_prompt_tokens:
                self._record_prompt_logprobs(seq, prompt_lp, flat - row.count, row.start, row.count)
            if not row.samples or seq.finished:
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            accepted = 0 if out.num_accepted is None else int(out.num_accepted[i])
            self._emitted += self._emit(seq, row.start + row.num_known, tokens, out,
                                        range(i * width, i * width + accepted + 1))
            if row.draft_ids:
                self._commit_drafts(seq, len(row.draft_ids), accepted)
            if not grammars_go_on.get(i, True) and not seq.finished:
                self._finish(seq, "stop")
            if seq.finished or seq.params.output_kind is RequestOutputKind.CUMULATIVE:
                touched[seq.request_id] = self.requests[seq.request_id]
        return [self._request_output(r) for r in touched.values()
                if r.params.output_kind is RequestOutputKind.CUMULATIVE or r.finished]

    def _emit(self, seq: Sequence, pos: int, tokens: list[int], out, positions: range) -> int:
        """A row's sampled tokens (one, or a speculative row's accepted drafts and the token after them: tokens[k]
        for k in positions; their logprobs in out) into its sequence, the first at pos (its PENDING place), each
        checked for a stop before the next; how many it took."""
        for j, k in enumerate(positions):
            token = tokens[k]
            if j == 0:
                seq.token_ids[pos] = token
            else:
                seq.token_ids.append(token)
            if seq.params.logprobs is not None:
                top = {int(t): float(l) for t, l in zip(out.top_ids[k, :seq.params.logprobs],
                                                      out.top_logprobs[k, :seq.params.logprobs])}
                seq.logprobs.append({token: float(out.logprob[k]), **top})
            self._check_stop(seq, token, pos + j + 1)
            if seq.finished:
                return j + 1
        return len(positions)

    def _commit_drafts(self, seq: Sequence, num_drafts: int, accepted: int) -> None:
        """A speculative row's acceptance, counted; its accepted drafts committed (Scheduler.commit_drafts)."""
        self.speculator.record(num_drafts, accepted)
        if not seq.finished and accepted:
            self.scheduler.commit_drafts(seq, accepted)

    def _sample_constrained(self, launched: Launched | None) -> None:
        """A constrained step's sampler, once every token before it is on the host: its rows' matchers fill the
        token bitmask (a no-op for a sampled step)."""
        if launched is None or not isinstance(launched.out, Unsampled):
            return
        self._fill_mask(launched)
        launched.out = self.runner.sample(launched.out, launched.mask.result())

    def _fill_mask(self, launched: Launched | None) -> None:
        """Start filling a constrained step's token bitmask on the mask thread (once)."""
        if launched is not None and isinstance(launched.out, Unsampled) and launched.mask is None:
            matchers = [row.seq.matcher if row.samples else None for row in launched.rows]
            launched.mask = self._mask_thread.submit(self.structured.fill, matchers, launched.out.num_rows)

    def _advance_grammars(self, rows: list[StepRow], tokens: np.ndarray) -> dict[int, bool]:
        """The matchers of the step's constrained rows take their sampled tokens (in parallel); per such row, False
        where its sequence must end there: the grammar is complete and takes no more tokens (a stop), or it cannot go
        on (the token was outside the mask: min_tokens left no allowed token)."""
        constrained = [i for i, row in enumerate(rows) if row.samples and row.seq.matcher is not None
                       and not row.seq.finished]
        taken = self.structured.advance([(rows[i].seq.matcher, int(tokens[i])) for i in constrained])
        for i, ok in zip(constrained, taken):
            if not ok:
                print(f"jaxserve: request {rows[i].seq.request_id}: token {int(tokens[i])} breaks its "
                      f"structured_outputs grammar ({rows[i].seq.matcher.get_error()}); stopping it",
                      file=sys.stderr, flush=True)
        return {i: ok and not rows[i].seq.matcher.is_stopped() for i, ok in zip(constrained, taken)}

    def _record_prompt_logprobs(self, seq: Sequence, lp, flat: int, start: int, count: int) -> None:
        """Input token at position p predicts prompt token p + 1: its logprob and the top-k there."""
        k = seq.params.prompt_logprobs
        for j in range(min(count, seq.num_prompt_tokens - 1 - start)):
            target = seq.token_ids[start + j + 1]
            top = {int(t): float(v) for t, v in zip(lp.top_ids[flat + j, :k], lp.top_logprobs[flat + j, :k])}
            seq.prompt_logprobs[start + j + 1] = {target: float(lp.logprob[flat + j]), **top}

    def _check_stop(self, seq: Sequence, token: int, length: int) -> None:
        """Stop tokens end a sequence before detokenization (their text is never shown, as in vLLM).
        length: tokens up to and including this one (later, still pending ones do not count)."""
        p, num_out = seq.params, length - seq.num_prompt_tokens
        if num_out >= p.min_tokens:
            if token in self.eos_token_ids and not p.ignore_eos:
                return self._finish(seq, "stop")
            if token in p.stop_token_ids:
                return self._finish(seq, "stop", token)
        stop_str = seq.detokenizer.update([token]) if seq.detokenizer is not None else None
        if stop_str is not None:
            self._finish(seq, "stop", stop_str)
        elif (p.max_tokens is not None and num_out >= p.max_tokens) or length >= self.cfg.max_model_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        del seq.token_ids[seq.num_prompt_tokens + len(seq.confirmed_output_ids):]   # tokens computed past the end
        if seq.detokenizer is not None:
            seq.detokenizer.finish()
        self.scheduler.finish(seq)

    def _forget(self, request_id: str) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self._constrained_requests -= req.params.structured_outputs is not None
        return req

    def _request_output(self, req: Request) -> RequestOutput:
        outs = [self._completion(s) for s in req.seqs]
        finished = req.finished
        if finished:
            self._forget(req.request_id)
        first = min((s.first_token_time for s in req.seqs if s.first_token_time is not None), default=None)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished,
                             req.seqs[0].prompt_logprobs, {"arrival_time": req.arrival_time, "first_token_time": first})

    def _completion(self, seq: Sequence) -> CompletionOutput:
        text = seq.detokenizer.text if seq.detokenizer is not None else ""
        logprobs = seq.logprobs if seq.params.logprobs is not None else None
        cum = sum(lp[t] for lp, t in zip(seq.logprobs, seq.confirmed_output_ids)) if logprobs else None
        return CompletionOutput(seq.index, text, seq.confirmed_output_ids, cum, logprobs,
                                seq.finish_reason, seq.stop_reason)

    # ---- introspection ------------------------------------------------------------------------------
    def _speculation_stats(self) -> dict:
        s = self.speculator.stats if self.speculator is not None else SpeculationStats()
        return {"spec_num_drafts": s.num_drafts, "spec_num_draft_tokens": s.num_draft_tokens,
                "spec_num_accepted_tokens": s.num_accepted_tokens,
                "spec_mean_acceptance_length": s.mean_acceptance_length}

    def stats(self) -> dict:
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_blocks_total": self.kv.num_blocks - 1, "kv_blocks_free": self.kv.num_free_blocks,
                "kv_usage": self.kv.usage, "prefix_cache_queries": self.kv.prefix_cache_queries,
                "prefix_cache_hits": self.kv.prefix_cache_hits, "preemptions": self.scheduler.num_preemptions,
                "cascade_steps": self.runner.cascade_steps,
                "weight_dtype": weight_dtype(self.loaded), "kv_cache_dtype": kv_dtype_name(self.graphs.backend.dtype),
                **self._speculation_stats(), "compiled_graphs": len(self.graphs.manager.executables),
                "graphs_from_cache": self.graphs.manager.loaded_from_cache,
                "compiles_after_start": self.graphs.manager.compiles_after_start,
                "compile_timings": self.graphs.manager.report()}   # where the start's time went
