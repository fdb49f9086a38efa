"""benchmarks/offline.py's roofline: a lower bound on the workload's time for the engine's concurrency, each
decode step bound by its bytes or its FLOPs (pure arithmetic on an 8B-shaped config; nothing runs)."""
import dataclasses

import pytest

from benchmarks.common import Bytes
from benchmarks.offline import (Ceilings, Workload, decode_step_bytes, decode_step_s, matmul_params, roofline_s,
                                wave_prompts, weight_read_bytes)
from jaxserve.config import ModelConfig

LLAMA_8B = ModelConfig(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                       num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192)
BF16 = Bytes(linear=2, other=2, kv=2)
UNBOUNDED = 1e30   # a ceiling that never binds


def test_a_decode_step_takes_the_longer_of_its_bytes_and_its_flops():
    wave = Workload(num_prompts=256, input_len=512, output_len=128)
    nbytes = decode_step_bytes(LLAMA_8B, wave.kv_tokens(64), BF16, rows=256)
    flops = 2 * matmul_params(LLAMA_8B) * 256
    by_bytes = decode_step_s(LLAMA_8B, wave, 64, Ceilings(gbps=4000, tflops=UNBOUNDED), BF16)
    by_flops = decode_step_s(LLAMA_8B, wave, 64, Ceilings(gbps=UNBOUNDED, tflops=600), BF16)
    assert by_bytes == pytest.approx(nbytes / 4000e9, rel=1e-12)
    assert by_flops == pytest.approx(flops / 600e12, rel=1e-12)
    # an H200's measured ceilings: 256 bf16 rows over a shared 1,024-token prefix are FLOP-bound (the prefix read
    # once), over 576 tokens each byte-bound; one row is byte-bound
    both = Ceilings(gbps=4650, tflops=700)
    shared = Workload(num_prompts=256, input_len=64, output_len=128, shared_prefix_len=1024)
    assert decode_step_s(LLAMA_8B, shared, 64, both, BF16) == pytest.approx(flops / 700e12, rel=1e-12)
    assert decode_step_s(LLAMA_8B, wave, 64, both, BF16) == pytest.approx(nbytes / 4650e9, rel=1e-12)
    one = dataclasses.replace(wave, num_prompts=1)
    assert decode_step_s(LLAMA_8B, one, 64, both, BF16) == pytest.approx(
        decode_step_bytes(LLAMA_8B, one.kv_tokens(64), BF16) / 4650e9, rel=1e-12)


def test_each_wave_reads_the_weights_once_a_step():
    w = Workload(num_prompts=1000, input_len=1000, output_len=1000)
    bytes_only = Ceilings(gbps=1, tflops=UNBOUNDED)
    at_once = roofline_s(LLAMA_8B, w, bytes_only, BF16, prompts=1000)
    in_waves = roofline_s(LLAMA_8B, w, bytes_only, BF16, prompts=250)
    # the same K/V bytes either way; four waves read the weights four times a step where one wave reads them once
    assert in_waves - at_once == pytest.approx(3 * (w.output_len - 1) * weight_read_bytes(LLAMA_8B, BF16) / 1e9,
                                               rel=1e-9)


def test_a_partial_last_wave_keeps_the_roofline_a_lower_bound():
    w = Workload(num_prompts=1000, input_len=1000, output_len=64)
    c = Ceilings(gbps=4650, tflops=700)
    whole_waves = sum(roofline_s(LLAMA_8B, dataclasses.replace(w, num_prompts=p), c, BF16, prompts=p)
                      for p in (300, 300, 300, 100))
    bound = roofline_s(LLAMA_8B, w, c, BF16, prompts=300)
    assert roofline_s(LLAMA_8B, w, c, BF16, prompts=1000) < bound < whole_waves


def test_the_prompts_at_once_are_the_engines_sequences_that_fit():
    w = Workload(num_prompts=1000, input_len=1000, output_len=1000)
    assert wave_prompts(w, max_seqs=256, kv_capacity=1_389_168) == 256
    assert wave_prompts(w, max_seqs=512, kv_capacity=713_120) == 356   # an H100's FP8 cache holds 356 whole
    sampled = Workload(num_prompts=32, input_len=1024, output_len=128, n=8)
    assert wave_prompts(sampled, max_seqs=256, kv_capacity=10**6) == 32
    assert wave_prompts(sampled, max_seqs=64, kv_capacity=10**6) == 8
    assert wave_prompts(sampled, max_seqs=4, kv_capacity=10**6) == 1


def test_the_flops_count_the_lm_head_but_not_the_embedding_lookup():
    head = LLAMA_8B.vocab_size * LLAMA_8B.hidden_size
    assert matmul_params(LLAMA_8B) == LLAMA_8B.num_params - head
    tied = dataclasses.replace(LLAMA_8B, tie_word_embeddings=True)
    assert matmul_params(tied) == tied.num_params
    prefill_only = Workload(num_prompts=4, input_len=100, output_len=1)   # no decode step
    rate = Ceilings(gbps=1, tflops=1)
    expected = 2 * (matmul_params(LLAMA_8B) - head) * 400 + 2 * head * 4
    assert roofline_s(LLAMA_8B, prefill_only, rate, BF16, prompts=4) == pytest.approx(expected / 1e12, rel=1e-12)
