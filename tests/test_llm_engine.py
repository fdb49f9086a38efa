"""Engine correctness (jaxserve/engine/llm_engine.py): a request's output must not depend on how it was scheduled
(CPU, f32)."""
import dataclasses
import random
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import custom_calls

import jaxserve.engine.runner as runner_module
from jaxserve import LLM, RequestOutputKind, SamplingParams
from jaxserve.models.attention import AttentionKernels, resolve_attention_kernels
from jaxserve.models.loader import load_model, random_model

from helpers import TEXT_PROMPTS, hf_greedy as _hf_greedy, on_gpu, on_hopper, token_prompts

_HF_MEMO = {}


def hf_greedy(model, ids, n):
    key = (id(model), tuple(ids), n)
    if key not in _HF_MEMO:
        _HF_MEMO[key] = _hf_greedy(model, ids, n)
    return _HF_MEMO[key]

# f32 logprobs against HF's on the CPU; a GPU's default f32 matmul precision (TF32-class) moves them ~1e-4
LOGPROB_TOLERANCE = 1e-4 if jax.default_backend() == "cpu" else 5e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
BASE = dict(max_num_seqs=8, max_num_batched_tokens=64, min_prefill_chunk=16, max_model_len=512, num_blocks=256,
            precompile=False)


@pytest.fixture(scope="module")
def smollm_llm(smollm):
    return LLM(smollm, **BASE)


@pytest.fixture(scope="module")
def hf_expected(smollm, smollm_hf):
    ids = [smollm.tokenizer(p, add_special_tokens=False)["input_ids"] for p in TEXT_PROMPTS]
    return ids, [hf_greedy(smollm_hf, i, GREEDY.max_tokens) for i in ids]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
def test_batched_greedy_matches_hf(smollm_llm, hf_expected):
    ids, expected = hf_expected
    assert token_ids(smollm_llm.generate(ids, GREEDY)) == expected


@pytest.mark.parametrize("knobs", [
    dict(max_num_batched_tokens=24, min_prefill_chunk=8, max_num_seqs=8),   # prompts split into small chunks
    dict(max_num_seqs=1, max_num_batched_tokens=32),                        # one sequence at a time
    dict(num_blocks=20),                                                    # tiny pool: forced preemption
], ids=["small-chunks", "one-seq", "preemption"])
def test_schedule_does_not_change_greedy_output(tiny, tiny_expected, knobs):
    prompts, expected = tiny_expected
    llm = LLM(tiny[0], **{**BASE, **knobs})
    assert token_ids(llm.generate(prompts, GREEDY)) == expected
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]     # every block came back
    if "num_blocks" in knobs:
        assert stats["preemptions"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_caching_on_and_off_give_the_same_output(smollm, smollm_hf, prefix_caching):
    shared = smollm.tokenizer("You are a helpful assistant. Answer briefly and precisely. " * 3)["input_ids"]
    prompts = [shared + smollm.tokenizer(q)["input_ids"] for q in (" What is 2+2?", " Name a colour.", " Hi!")]
    llm = LLM(smollm, **{**BASE, "enable_prefix_caching": prefix_caching})
    first = token_ids(llm.generate(prompts[:1], GREEDY))
    rest = token_ids(llm.generate(prompts[1:], GREEDY))
    assert first + rest == [hf_greedy(smollm_hf, p, GREEDY.max_tokens) for p in prompts]
    hits = llm.engine.kv.prefix_cache_hits
    assert (hits >= 2 * (len(shared) // 16) * 16) if prefix_caching else hits == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama checkpoint: fast to compile, for the scheduling-heavy tests."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,  # GPU kernels' dims
                                   max_position_embeddings=512)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(path)
    return load_model(str(path), dtype="f32"), hf


@pytest.fixture(scope="module")
def tiny_llm(tiny):
    return LLM(tiny[0], **BASE)


def sampled(seed, **kw):
    return SamplingParams(temperature=1.0, top_p=0.9, seed=seed, max_tokens=16, ignore_eos=True, **kw)


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_llm):
    prompt = [1, 5, 9, 13, 17]
    alone = token_ids(tiny_llm.generate([prompt], sampled(7)))[0]
    others = [[2, 3], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4], [100]]
    mixed = token_ids(tiny_llm.generate(others[:2] + [prompt] + others[2:],
                                        [sampled(1), sampled(2), sampled(7), sampled(3)]))
    assert mixed[2] == alone
    assert token_ids(tiny_llm.generate([prompt], sampled(8)))[0] != alone


def test_forks_diverge_and_each_equals_its_seeded_single_run(tiny_llm):
    prompt = list(range(1, 20))   # ends mid-block: the forks share a partial last block (copy-on-write)
    out = tiny_llm.generate([prompt], sampled(11, n=3))[0]
    forks = [c.token_ids for c in sorted(out.outputs, key=lambda c: c.index)]
    assert len({tuple(f) for f in forks}) == 3
    for i, f in enumerate(forks):
        assert f == token_ids(tiny_llm.generate([prompt], sampled(11 + i)))[0]
    stats = tiny_llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_forks_never_take_more_slots_than_there_are(tiny):
    """Six n=3 requests through 4 slots: admission reserves the siblings' slots (this used to crash with
    IndexError when a fork found no free slot); every slot and block comes back after the next step."""
    llm = LLM(tiny[0], **{**BASE, "max_num_seqs": 4})
    outs = llm.generate([[i + 1] * (3 + i) for i in range(6)], sampled(5, n=3))
    assert [len(o.outputs) for o in outs] == [3] * 6
    assert all(len(c.token_ids) == 16 for o in outs for c in o.outputs)
    llm.engine.step()   # finished sequences' slots are released by the step after they finish
    runner, stats = llm.engine.runner, llm.engine.stats()
    assert sorted(runner.free_slots) == [0, 1, 2, 3] and not runner.slot_of
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_the_engine_knows_no_slots_or_block_tables():
    """The seam: the scheduler's output is the runner's one input; slots and block tables are the runner's."""
    import inspect
    import re
    from jaxserve.engine import llm_engine
    source = inspect.getsource(llm_engine)
    assert not re.search(r"slot(?!s=True)|block_table|take_", source)


@pytest.fixture(scope="module")
def tiny_expected(tiny):
    """8 prompts of different lengths (5..96 tokens) and HF's greedy continuations."""
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 128, n)] for n in (5, 17, 33, 9, 64, 2, 96, 40)]
    return prompts, [hf_greedy(tiny[1], p, GREEDY.max_tokens) for p in prompts]


def test_tiny_model_batched_greedy_matches_hf(tiny, tiny_llm, tiny_expected):
    """The engine on one device runs q, k and v as one layer (fuse_qkv)."""
    prompts, expected = tiny_expected
    assert all(layer.self_attn.qkv_proj is not None for layer in tiny[0].model.layers)
    assert token_ids(tiny_llm.generate(prompts, GREEDY)) == expected


@pytest.mark.parametrize("bad, field", [
    (dict(prompt=""), "prompt"),
    (dict(prompt=[1] * 600), "max_model_len"),
    (dict(params=dict(max_tokens=0)), "max_tokens"),
    (dict(params=dict(max_tokens=510)), "max_tokens=510 with the prompt's 3 tokens exceeds max_model_len=512"),
    (dict(params=dict(top_p=1.5)), "top_p"),
    (dict(params=dict(temperature=-1.0)), "temperature"),
    (dict(params=dict(stop=[1, 2])), "stop"),
    (dict(prompt=[1, 2, 999]), "token ids"),
])
def test_bad_input_names_the_field_and_the_engine_keeps_serving(tiny_llm, bad, field):
    engine = tiny_llm.engine
    good = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(ValueError, match=field):
        engine.add_request(bad.get("prompt", [1, 2, 3]), SamplingParams(**bad.get("params", {})))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(finished[good].outputs[0].token_ids) == 4


SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.init]
FUZZ_VALUES = [None, True, False, 0, 1, -1, 3, 2**31, 2**63, -(2**70), 0.5, 1e-300, 1e308, float("nan"),
               float("inf"), "", "a", "\ud800", "s" * 2000, [], [1, 2], ["\udfff"], ["."], [2**40], (1,), {}, object()]


@pytest.mark.slow
def test_random_values_in_every_request_field_raise_valueerror_or_run(smollm_llm):
    """Through the Python API, every SamplingParams field and add_request argument takes random values: each
    request is refused with a ValueError naming a field, or it runs; a step never raises."""
    seed = random.randrange(2**32)
    rng, engine = random.Random(seed), smollm_llm.engine
    arguments = SAMPLING_FIELDS + ["prompt", "cache_salt", "priority", "request_id"]
    for i in range(200):
        fields = {rng.choice(arguments): rng.choice(FUZZ_VALUES) for _ in range(rng.randrange(1, 4))}
        sampling = {"max_tokens": 2, **{k: v for k, v in fields.items() if k in SAMPLING_FIELDS}}
        extra = {k: v for k, v in fields.items() if k not in SAMPLING_FIELDS and k != "prompt"}
        try:
            engine.add_request(fields.get("prompt", "Hello"), SamplingParams(**sampling), **extra)
        except ValueError as e:
            assert str(e), f"seed {seed}: {fields!r}"
        except TypeError as e:   # a keyword SamplingParams does not have is the caller's bug, not input
            pytest.fail(f"seed {seed}: {fields!r} raised {e!r}")
        while engine.has_unfinished_requests():
            engine.step()
    assert token_ids(smollm_llm.generate(["Hello"], GREEDY)) == token_ids(smollm_llm.generate(["Hello"], GREEDY))


def test_abort_frees_everything(tiny_llm):
    engine = tiny_llm.engine
    rid = engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort(rid)
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.slow
def test_stream_yields_the_same_text_as_generate(smollm_llm):
    params = SamplingParams(temperature=0.0, max_tokens=20)
    text = "".join(d.text for d in smollm_llm.stream("The capital of France is", params))
    assert text == smollm_llm.generate(["The capital of France is"], params)[0].outputs[0].text


def test_step_donates_the_cache_and_penalty_state(tiny_llm):
    """The jitted step updates the KV cache in place: the arrays it was given are consumed, not copied."""
    engine = tiny_llm.engine
    engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=2))
    old_cache, old_penalty = engine.runner.kv_cache, engine.runner.penalty
    engine.step()
    assert all(k.is_deleted() and v.is_deleted() for k, v in old_cache)
    assert old_penalty.output_counts.is_deleted()
    while engine.has_unfinished_requests():
        engine.step()


def test_decode_steps_keep_their_buffers_where_they_were(tiny, monkeypatch):
    """A model graph's outputs and the sampled tokens stay at their device addresses from step to step, the new
    values written into them, and the sampler's outputs rotate through the same few buffers: on a GPU a buffer that
    moves makes XLA re-record the step's CUDA graph. A step's model and sampler inputs come as two new byte
    buffers, held for two steps (the allocator then finds each step as it left the one before)."""
    engine = LLM(tiny[0], **BASE).engine
    runner = engine.runner
    for prompt in token_prompts(5, 7, 9):
        engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    while any(s.is_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()

    def snapshot():
        return ({k: v.unsafe_buffer_pointer() for k, v in runner.buffers.outputs.items()},
                runner.last_tokens.unsafe_buffer_pointer(),
                {k: {o.tokens.unsafe_buffer_pointer() for o in ring} for k, ring in runner.buffers.sampled.items()})
    # read on the host holds a view of its buffer, and such a buffer cannot be donated
    for _ in range(runner.buffers.SAMPLED_RING):
        engine.step()
    before = snapshot()
    engine.step()
    after = snapshot()
    assert before == after and any(len(ring) == runner.buffers.SAMPLED_RING for ring in after[2].values())
    # each of the last two steps' model and sampler inputs, sent as bytes
    assert [len(step) for step in runner.buffers.held] == [2, 2]
    assert all(isinstance(x, jax.Array) and x.dtype == jnp.uint8 and x.ndim == 1 and x.size
               for step in runner.buffers.held for x in step)
    # the oldest step's buffers are let go before a step's are sent, so the new ones can take their places (sent
    # first, they would cycle through three places, and the model graph's temp buffer with them)
    held_when_sent, put = [], runner_module.put_replicated
    monkeypatch.setattr(runner_module, "put_replicated", lambda x, sharding: held_when_sent.append(
        [len(step) for step in runner.buffers.held]) or put(x, sharding))
    engine.step()
    monkeypatch.undo()
    assert held_when_sent == [[2, 0], [2, 0]]   # the model's bytes, the sampler's
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.skipif(not on_gpu(), reason="XLA runs graphs as CUDA graphs on an NVIDIA GPU only")
def test_a_model_graph_reads_the_sent_bytes_outside_its_cuda_graph(tiny_llm):
    """The byte buffer a step's model inputs come in is new at every step: read by a command of the model's CUDA
    graph, it would have XLA record the graph again at every step. So the copy that XLA runs outside the graph (no
    command-buffer trait) is the buffer's one reader."""
    assert custom_calls.available(), custom_calls.unavailable_reason()
    tiny_llm.generate([[1, 2, 3]], GREEDY)
    graphs = tiny_llm.engine.graphs
    models = [e for k, e in graphs.manager.executables.items() if k.kind == "model"]
    assert models
    for compiled in models:
        text = compiled.as_text()
        entry = text[text.index("\nENTRY"):]
        entry = entry[:entry.index("\n}")]
        sent = re.search(r"(%[\w.-]+) = u8\[\d+\]\{0\} parameter\(", entry).group(1)
        readers = [line for line in entry.splitlines()[1:]
                   if re.search(re.escape(sent) + r"(?![\w.-])", line) and " parameter(" not in line]
        assert len(readers) == 1 and 'custom_call_target="jaxserve_copy_outside_graphs"' in readers[0], readers


def test_kv_sizing_reserves_the_profiled_activation_peak(tiny, monkeypatch):
    from jaxserve.cache import kv_cache
    seen = {}

    def sized(bytes_per_block, *, activation_peak_bytes, fraction, device):
        seen.update(peak=activation_peak_bytes, bytes_per_block=bytes_per_block)
        return 64
    monkeypatch.setattr(kv_cache, "num_blocks_for_memory", sized)
    llm = LLM(tiny[0], **{**BASE, "num_blocks": None})
    assert llm.engine.runner.num_blocks == llm.engine.kv.num_blocks == 64
    assert seen["peak"] > 0 and seen["peak"] == llm.engine.graphs.activation_peak()


@pytest.fixture(scope="module")
def tiny_sync_llm(tiny):
    return LLM(tiny[0], **BASE, async_scheduling=False)


def test_async_scheduling_gives_the_same_outputs_as_sync(tiny_llm, tiny_sync_llm, tiny_expected):
    prompts, _ = tiny_expected
    mixed = [SamplingParams(temperature=0.0, max_tokens=3 + i, ignore_eos=True) for i in range(4)] + \
            [sampled(i) for i in range(4)]
    sync = tiny_sync_llm.generate(prompts, mixed)
    # a stop token that really occurs mid-stream: async must stop at the same place despite running ahead
    stop = [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[o.outputs[0].token_ids[2]])
            for o in sync]
    for params in (mixed, stop):
        expected = tiny_sync_llm.generate(prompts, params)
        got = tiny_llm.generate(prompts, params)
        assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in got] == \
               [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in expected]
    stats = tiny_llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_async_step_hands_back_the_previous_steps_tokens(tiny_llm):
    """Step N+1 is launched before step N's samples are read: outputs trail the launches by one step."""
    engine = tiny_llm.engine
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert engine.step() == []
    assert [len(o.outputs[0].token_ids) for o in engine.step()] == [1]
    while engine.has_unfinished_requests():
        engine.step()


def test_final_only_requests_give_one_output_when_they_finish(tiny_llm):
    """FINAL_ONLY (what generate uses): no output for the steps in between, the last one the same as a CUMULATIVE
    request's, with the time of its first token; n > 1 waits for every sibling."""
    engine, seen = tiny_llm.engine, {"cumulative": [], "final": []}
    for name, kind, n in (("cumulative", RequestOutputKind.CUMULATIVE, 1), ("final", RequestOutputKind.FINAL_ONLY, 2)):
        engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5 + n, ignore_eos=True, n=n,
                                                      output_kind=kind), request_id=name)
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["cumulative"]) == 6 and [o.finished for o in seen["final"]] == [True]
    final = seen["final"][0]
    assert [len(c.token_ids) for c in final.outputs] == [7, 7]
    assert final.outputs[0].token_ids[:6] == seen["cumulative"][-1].outputs[0].token_ids   # greedy: one prefix
    assert final.metrics["arrival_time"] < final.metrics["first_token_time"] < time.monotonic()


def test_prompt_logprobs_match_hf_across_chunks_and_skip_the_prefix_cache(tiny, tiny_llm):
    _, hf = tiny
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 128, 150)]   # > the 64-token budget: 3 chunks
    tiny_llm.generate([prompt], GREEDY)      # now cached: prompt logprobs must still compute every position
    out = tiny_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1).numpy()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        assert abs(entry[prompt[p]] - ref[p - 1, prompt[p]]) < LOGPROB_TOLERANCE
        third = np.sort(ref[p - 1])[-3]   # HF's top 3, up to near-ties that the tolerance cannot order
        assert len(entry) >= 3 and all(ref[p - 1, t] >= third - LOGPROB_TOLERANCE for t in entry if t != prompt[p])


@pytest.mark.slow
def test_a_one_token_prompt_chunk_with_prompt_logprobs_runs_a_precompiled_graph(tiny):
    """A prompt's last chunk can be one token: every row of that step then has one token, but prompt logprobs'
    graphs exist for token buckets only, so the step must pad to a token bucket, not to a smaller seq bucket."""
    llm = LLM(tiny[0], **{**BASE, "precompile": True, "max_num_seqs": 2, "max_num_batched_tokens": 18})
    prompt = list(range(1, 20))   # 19 tokens: chunks of 18 and 1
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))[0]
    assert len(out.prompt_logprobs) == len(prompt) and llm.engine.stats()["compiles_after_start"] == 0


@pytest.mark.parametrize("knob, field", [
    (dict(prefill_attention="cudnn"), "prefill_attention"),
    (dict(decode_attention="flash"), "decode_attention"),
])
def test_bad_engine_knobs_name_the_field(tiny, knob, field):
    with pytest.raises(ValueError, match=field):
        LLM(tiny[0], **{**BASE, **knob})


def test_each_step_compiles_the_sampler_its_requests_need(tiny_llm):
    """top_k=1 at temperature 1 is greedy only if the step ran the top-k sampler variant, also when the batch
    shares its steps with plain greedy and plain random requests."""
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    top1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True, seed=3)
    free = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3)
    expected = token_ids(tiny_llm.generate(prompts, greedy))
    mixed = token_ids(tiny_llm.generate(prompts, [greedy, top1, free]))
    assert mixed[:2] == expected[:2]
    assert mixed[2] != expected[2]  # random sampling really ran beside them
    modes = {key.dims[1] for key in tiny_llm.engine.graphs.manager.executables if key.kind == "sampler"}
    assert {"greedy", "filter"} <= modes


def test_attention_kernels_are_what_runs_here():
    """On a CPU the attention is the pure-JAX reference (decode-only steps need no graph of their own), and asking
    for CUDA names why it cannot run. On an NVIDIA GPU (with nvcc): the Pallas decode-only launch, or the CUDA
    call when asked, refused for a head_dim it does not serve."""
    if custom_calls.available():
        assert resolve_attention_kernels("auto", "triton", head_dim=64) == AttentionKernels("pallas", "triton")
        assert resolve_attention_kernels("cuda", "mosaic", head_dim=64) == AttentionKernels("cuda", "mosaic")
        with pytest.raises(ValueError, match="head_dim 32"):
            resolve_attention_kernels("cuda", "triton", head_dim=32)
        assert resolve_attention_kernels("triton", "triton", head_dim=64).decode_backend == "triton"
        if on_hopper():
            assert resolve_attention_kernels("mosaic", "triton", head_dim=64) == AttentionKernels(
                "pallas", "triton", decode_backend="mosaic")
        return
    assert resolve_attention_kernels("auto", "triton", head_dim=64) == AttentionKernels("reference", "triton")
    with pytest.raises(ValueError, match="CUDA custom calls are unavailable: no NVIDIA GPU"):
        resolve_attention_kernels("cuda", "triton", head_dim=64)
    for backend in ("triton", "mosaic"):  # a backend named for a device that cannot run it: why, and what to set
        with pytest.raises(ValueError, match=f"decode_attention='{backend}' needs .*capability none.*'auto'"):
            resolve_attention_kernels(backend, "triton", head_dim=64)


def test_decodes_take_the_cuda_tensor_core_kernel_where_it_is_faster(monkeypatch):
    """Under "auto" on sm_90 with the CUDA library, the engine marks its decodes for the CUDA call (cuda_decodes):
    those of decode-only, mixed and cascade steps (a cascade's own keys) whose shapes its tensor-core kernel takes
    run it, over an FP8 cache at any batch, over a cache of q's dtype from CUDA_DECODE_MIN_ROWS sequence slots;
    other shapes keep the Pallas launch; a named backend keeps it everywhere, and "cuda" takes the call for every
    decode-only step (mixed steps' decodes stay with the Pallas launch)."""
    from types import SimpleNamespace

    import jaxserve.models.attention as attention

    monkeypatch.setattr(attention, "resolve_impl", lambda *_, **__: "pallas")
    monkeypatch.setattr(attention, "gpu_capability", lambda: 9.0)
    monkeypatch.setattr(custom_calls, "available", lambda: True)
    fp8, bf16 = jnp.float8_e4m3fn, jnp.bfloat16
    assert all(resolve_attention_kernels("auto", "auto", 128, cache_dtype=dtype).cuda_decodes for dtype in (fp8, bf16))
    assert not resolve_attention_kernels("triton", "auto", 128, cache_dtype=fp8).cuda_decodes
    monkeypatch.setattr(custom_calls, "available", lambda: False)
    assert not resolve_attention_kernels("auto", "auto", 128, cache_dtype=fp8).cuda_decodes
    monkeypatch.setattr(custom_calls, "available", lambda: True)
    monkeypatch.setattr(attention, "gpu_capability", lambda: 8.0)
    assert not resolve_attention_kernels("auto", "auto", 128, cache_dtype=fp8).cuda_decodes

    marked, plain = AttentionKernels("pallas", "auto", cuda_decodes=True), AttentionKernels("pallas", "auto")
    rows = attention.CUDA_DECODE_MIN_ROWS

    def on_cuda(tokens=rows, slots=rows, q_heads=32, head_dim=128, cache=fp8, q=bf16, block=16, decode_only=True,
                cascade=None, kernels=marked):
        batch = SimpleNamespace(cascade=cascade, decode_only=decode_only,
                                kv_lens=jax.ShapeDtypeStruct((slots,), jnp.int32))
        return attention.decode_on_cuda(jax.ShapeDtypeStruct((tokens, q_heads, head_dim), q),
                                        jax.ShapeDtypeStruct((100, block, 8, head_dim), cache), batch, kernels)

    assert all([on_cuda(), on_cuda(tokens=1, slots=1), on_cuda(tokens=4096, slots=16, decode_only=False),
                on_cuda(cache=bf16), on_cuda(tokens=4096, cache=bf16, decode_only=False),
                on_cuda(tokens=2 * rows, slots=2 * rows, head_dim=64, q=jnp.float16, q_heads=128, block=32),
                on_cuda(cascade=object()), on_cuda(cascade=object(), cache=bf16)])
    assert not any([on_cuda(tokens=rows - 1, cache=bf16), on_cuda(tokens=4096, slots=rows - 1, cache=bf16),
                    on_cuda(q=jnp.float32), on_cuda(head_dim=256), on_cuda(q_heads=136), on_cuda(block=24),
                    on_cuda(cascade=object(), cache=bf16, slots=rows - 1), on_cuda(kernels=plain)])
    forced = AttentionKernels("cuda", "auto")
    assert on_cuda(tokens=1, cache=bf16, kernels=forced) and not on_cuda(decode_only=False, kernels=forced)


HOPPER = pytest.mark.skipif(on_gpu() and not on_hopper(), reason="needs sm_90")
LOGPROBS = dataclasses.replace(GREEDY, logprobs=2)


def assert_greedy_up_to_near_ties(outputs, reference, nats=0.05):
    """Each completion takes the reference's tokens until a position where the two differ, and there only between
    two tokens the reference itself ranked within `nats` (a near-tie that attention's rounding may flip)."""
    for out, ref in zip(outputs, reference):
        got, want = out.outputs[0], ref.outputs[0]
        for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
            if a != b:
                ranked = want.logprobs[i]
                assert a in ranked and ranked[b] - ranked[a] < nats, (i, a, b, ranked)
                break


@pytest.mark.parametrize("kernel, backend, prefill", [
    ("cuda", "auto", "triton"), ("pallas", "triton", "triton"),
    pytest.param("pallas", "mosaic", "triton", marks=HOPPER),
    pytest.param("pallas", "mosaic", "mosaic", marks=HOPPER),  # every attention kernel on Mosaic GPU
    pytest.param("pallas", "auto", "auto", marks=HOPPER),      # the default: Mosaic GPU's kernels on Hopper
])
def test_decode_steps_run_the_decode_kernel(tiny, tiny_expected, kernel, backend, prefill, monkeypatch):
    """Decode-only steps run the decode kernel's graph (mixed steps the ragged kernel's) and HF's tokens come
    out. On the GPU these are the Pallas decode-only launch on each backend (its small buckets split contexts)
    and the CUDA call, and with both backends Mosaic, or both "auto" (Hopper's default where the CUDA call does
    not take the decodes), every graph holds Mosaic GPU's kernels and none Triton's; on CPU all fall back to the
    reference, which checks the plumbing only. Mosaic GPU's kernels read bf16/f16: on the GPU they serve a bf16
    copy of the model, held to its own engine with pure-JAX attention."""
    import jaxserve.engine.step_graphs as step_graphs

    def engine(kernels, model):
        monkeypatch.setattr(step_graphs, "resolve_attention_kernels", lambda *_: kernels)
        return LLM(model, **BASE)

    prompts, expected = tiny_expected
    bf16 = on_gpu() and ("mosaic" in (backend, prefill) or prefill == "auto")
    model = load_model(tiny[0].source, dtype="bf16") if bf16 else tiny[0]
    llm = engine(AttentionKernels(kernel, prefill, decode_backend=backend), model)
    assert llm.engine.graphs.kernels.decode == kernel
    outputs = llm.generate(prompts, LOGPROBS if bf16 else GREEDY)
    models = {key: executable for key, executable in llm.engine.graphs.manager.executables.items()
              if key.kind == "model"}
    assert {key.dims[2] for key in models} == {False, True}   # decode-only and mixed steps
    if not bf16:
        assert token_ids(outputs) == expected
        return
    assert_greedy_up_to_near_ties(outputs, engine(AttentionKernels("reference", "triton"), model).generate(
        prompts, LOGPROBS))
    # a Pallas Triton kernel is its own custom call (XLA's own GEMM fusions may say "triton" too: not Pallas)
    pallas_triton = [key for key, executable in models.items() if "__gpu$xla.gpu.triton" in executable.as_text()]
    assert bool(pallas_triton) == (prefill == "triton")
    if backend != "triton" and prefill != "triton":
        assert all("mosaic_gpu" in executable.as_text() for executable in models.values())


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qk_norm"])
def test_steps_rotate_q_and_k_where_the_cache_is_written(tiny, monkeypatch, qk_norm):
    """A bf16 model on one device: each layer's fused q/k/v rows go to custom_calls.rope_and_cache (the norms, the
    rotation and the cache write in one call), and the greedy tokens are those of the steps that rotate in XLA
    before the write: the same ops on a CPU (the call's reference there, taken as the GPU takes the kernel), on a
    GPU up to near-ties (its sin, cos and rsqrt)."""
    from jaxserve.cache.kv_cache import layer_blocks
    from jaxserve.models import llama
    model = load_model(tiny[0].source, dtype="bf16")
    if qk_norm:   # Qwen3's per-head norms of q and k, weights away from 1
        model = random_model(dataclasses.replace(model.model.cfg, qk_norm=True), jnp.bfloat16)
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight[...] = jnp.linspace(0.5, 1.5, 64, dtype=jnp.bfloat16)
            layer.self_attn.k_norm.weight[...] = jnp.linspace(1.5, 0.5, 64, dtype=jnp.bfloat16)
    calls = []

    def recorded(*args):
        calls.append(args[2].shape)
        return rope_and_cache(*args)
    rope_and_cache = custom_calls.rope_and_cache
    monkeypatch.setattr(custom_calls, "rope_and_cache", recorded)
    if not on_gpu():   # the GPU's test, without its library: the call's reference
        monkeypatch.setattr(llama, "rotates_where_written", lambda qkv, hq, kv_layer, paged: kv_layer is not None and (
            custom_calls.rope_and_cache_unsupported(*layer_blocks(kv_layer)[:2], qkv, hq) is None))
    compare_with_the_call_off(model, monkeypatch, "rotates_where_written", calls, lambda: (
        calls and all(shape[1] == (4 + 2 * 2) * 64 for shape in calls)))


def test_steps_add_the_residual_where_it_is_normed(tiny, monkeypatch):
    """A bf16 model on one device: every residual add and the RMS norm after it (two a layer, the final norm) go to
    custom_calls.add_rms_norm, and the greedy tokens are those of XLA's adds and norms: the same ops on a CPU (the
    call's reference there, taken as the GPU takes the kernel), on a GPU up to near-ties (its f32 sums' order)."""
    from jaxserve.models import llama
    model = load_model(tiny[0].source, dtype="bf16")
    calls = []

    def recorded(x, delta, weight, eps):
        calls.append(x.shape)
        return add_rms_norm(x, delta, weight, eps)
    add_rms_norm = custom_calls.add_rms_norm
    monkeypatch.setattr(custom_calls, "add_rms_norm", recorded)
    # on a CPU the GPU's decision without its library (the call's reference runs)
    takes = llama.adds_where_normed if on_gpu() else (
        lambda x, delta, weight, layers: custom_calls.add_rms_norm_unsupported(x, delta, weight) is None)
    decided = []
    monkeypatch.setattr(llama, "adds_where_normed", lambda *args: decided.append(takes(*args)) or decided[-1])
    # every add and norm traced took the call
    compare_with_the_call_off(model, monkeypatch, "adds_where_normed", calls, lambda: (
        decided and all(decided) and len(calls) == len(decided)
        and all(shape[1] == model.model.cfg.hidden_size for shape in calls)))


def compare_with_the_call_off(model, monkeypatch, switch: str, calls: list, traced_the_call):
    """The greedy tokens of the model's engine traced as patched (traced_the_call() then holds) against those of
    one traced with llama's `switch` off (no call recorded): the same on a CPU (the call's reference runs the same
    ops), on a GPU up to near-ties."""
    from jaxserve.models import llama
    prompts = token_prompts(5, 17, 40)
    jax.clear_caches()   # layers traced by another test would not take the patched functions
    try:
        taken = LLM(model, **BASE, compile_cache_dir=None).generate(prompts, LOGPROBS)   # traced here
        assert traced_the_call()
        monkeypatch.setattr(llama, switch, lambda *_: False)
        jax.clear_caches()
        calls.clear()
        plain = LLM(model, **BASE, compile_cache_dir=None).generate(prompts, LOGPROBS)
        assert not calls
    finally:
        jax.clear_caches()
    if on_gpu():
        assert_greedy_up_to_near_ties(taken, plain)
    else:
        assert token_ids(taken) == token_ids(plain)


@pytest.mark.skipif(not (on_gpu() and on_hopper()), reason="the Mosaic GPU kernels run on Hopper only; interpreted, "
                    "tests/test_cascade_attention.py holds the Mosaic cascade to the reference")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_cascade_steps_on_mosaic(tiny, monkeypatch, kv_cache_dtype):
    """Requests behind one shared prompt with every attention kernel on Mosaic GPU and cascade_attention: on, over
    a bf16 and an FP8 cache: the cascade graphs ran, hold no Pallas Triton kernel, and give pure-JAX attention's
    greedy tokens over the same cache up to near-ties (a bf16 copy of the model: Mosaic GPU's kernels read
    bf16/f16)."""
    import jaxserve.engine.step_graphs as step_graphs

    def engine(kernels, cascade):
        monkeypatch.setattr(step_graphs, "resolve_attention_kernels", lambda *_: kernels)
        return LLM(model, **BASE, cascade_attention=cascade, kv_cache_dtype=kv_cache_dtype)

    model = load_model(tiny[0].source, dtype="bf16")
    system = list(range(10, 60))   # 50 tokens: three whole blocks of 16 shared
    prompts = [system + [60 + i] * (i + 1) for i in range(6)]
    mosaic = engine(AttentionKernels("pallas", "mosaic", decode_backend="mosaic"), "on")
    outputs = mosaic.generate(prompts, LOGPROBS)
    assert mosaic.engine.stats()["cascade_steps"] > 0
    assert_greedy_up_to_near_ties(outputs, engine(AttentionKernels("reference", "triton"), "off").generate(
        prompts, LOGPROBS))
    cascades = [executable for key, executable in mosaic.engine.graphs.manager.executables.items()
                if key.kind == "model" and key.dims[4]]
    assert cascades and not any("__gpu$xla.gpu.triton" in executable.as_text() for executable in cascades)
