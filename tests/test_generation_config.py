"""Requests' sampling defaults from the model's generation config (vLLM's `--generation-config auto`): read from a HF
checkpoint's generation_config.json, a GGUF's general.sampling.* keys and a `jaxserve convert` directory, the embedded
model's from its publisher's card; applied by the engine to what a request leaves unset, on every surface (Python
API, HTTP, gRPC, CLI); `generation_config: vllm` leaves vLLM's. The tiny random model here carries defaults easy to
see: temperature 0 makes a request that sets none greedy, and its max_new_tokens bounds one that sets no bound."""
import asyncio
import json
from dataclasses import replace
from pathlib import Path

import gguf
import jax.numpy as jnp
import openai
import pytest

from jaxserve import LLM, EngineConfig, LLMEngine, SamplingParams
from jaxserve.cli import build_parser, sampling_params, served_engine_config
from jaxserve.client import Client
from jaxserve.models import gguf as jaxserve_gguf
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.loader import EMBEDDED_SAMPLING, load_model, random_model, save_converted

from helpers import KNOBS, MODEL, SERVER_KNOBS, TINY_HF_KWARGS, TINY_NO_EOS, base_url, in_process, token_prompts

GREEDY_BY_DEFAULT = {"temperature": 0.0, "max_tokens": 6}   # the tiny model's "generation config"
PROMPTS = token_prompts(5, 9)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
HOT = dict(temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def tiny():
    return replace(random_model(TINY_NO_EOS, jnp.float32), sampling_defaults=GREEDY_BY_DEFAULT)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, precompile=False, **KNOBS)


def token_ids(outs) -> list[list[int]]:
    return [c.token_ids for out in outs for c in out.outputs]


# ---- where the defaults come from ---------------------------------------------------------------------------
def hf_checkpoint(path, generation_config: dict):
    import torch
    import transformers
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_HF_KWARGS)).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def test_a_hf_checkpoints_generation_config_is_read_and_survives_convert(tmp_path):
    fields = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
              "repetition_penalty": 1.05, "max_new_tokens": 64, "bos_token_id": 1, "eos_token_id": 2}
    loaded = load_model(str(hf_checkpoint(tmp_path / "hf", fields)), dtype="f32")
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
            "max_tokens": 64}
    assert loaded.sampling_defaults == want
    assert load_model(str(save_converted(loaded, tmp_path / "orbax")), dtype="f32").sampling_defaults == want


def test_a_generation_config_no_request_could_carry_is_refused_at_load_naming_it(tmp_path):
    path = hf_checkpoint(tmp_path / "hf", {"temperature": 0.7, "top_p": 0.0})
    with pytest.raises(ModelLoadError, match=r"generation_config\.json: top_p must be in"):
        load_model(str(path), dtype="f32")


def metadata_gguf(path, **sampling):
    """A llama GGUF of metadata only (enough for its config), with llama.cpp's general.sampling.* keys."""
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_embedding_length, 32), (w.add_feed_forward_length, 64),
                       (w.add_head_count, 4), (w.add_context_length, 128), (w.add_vocab_size, 8)):
        add(value)
    for key, value in sampling.items():
        getattr(w, f"add_sampling_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def test_a_ggufs_general_sampling_keys_are_read_and_checked_before_the_weights(tmp_path):
    path = metadata_gguf(tmp_path / "rec.gguf", temp=0.6, top_k=20, top_p=0.9, min_p=0.05, penalty_repeat=1.1)
    assert jaxserve_gguf.gguf_sampling(jaxserve_gguf.open_gguf(path)) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    assert jaxserve_gguf.gguf_sampling(jaxserve_gguf.open_gguf(metadata_gguf(tmp_path / "none.gguf"))) == {}
    with pytest.raises(ModelLoadError, match=r"bad\.gguf: temperature must be in"):   # the file holds no tensors
        load_model(str(metadata_gguf(tmp_path / "bad.gguf", temp=-1.0)))


@pytest.mark.slow
def test_the_embedded_model_carries_its_publishers_settings(smollm):
    """Its GGUF has no general.sampling.* keys; the model card's temperature 0.2, top_p 0.9 stand in."""
    assert smollm.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}
    assert EMBEDDED_SAMPLING == {Path(smollm.source).name: smollm.sampling_defaults}   # also by its path


# ---- the Python API --------------------------------------------------------------------------------------------
def test_unset_fields_take_the_models_defaults_and_set_ones_override_them(llm):
    greedy = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert token_ids(llm.generate(PROMPTS, use_tqdm=False)) == greedy   # no params: the model's, max_tokens too
    assert token_ids(llm.generate(PROMPTS, SamplingParams(max_tokens=6, seed=3), use_tqdm=False)) == greedy
    hot = token_ids(llm.generate(PROMPTS, SamplingParams(max_tokens=6, **HOT), use_tqdm=False))
    assert hot != greedy and all(len(ids) == 6 for ids in hot)


def test_generation_config_vllm_leaves_vllms_defaults(tiny, capsys):
    vllm = LLM(tiny, precompile=False, generation_config="vllm", **KNOBS)
    assert "generation config" not in capsys.readouterr().err   # nothing applied, nothing said
    unset = token_ids(vllm.generate(PROMPTS, SamplingParams(max_tokens=6, seed=3), use_tqdm=False))
    assert unset == token_ids(vllm.generate(PROMPTS, SamplingParams(max_tokens=6, **HOT), use_tqdm=False))
    assert unset != token_ids(vllm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert [len(ids) for ids in token_ids(vllm.generate(PROMPTS, use_tqdm=False))] == [16, 16]   # vLLM's max_tokens


def test_the_start_says_which_defaults_the_model_sets(tiny, capsys):
    LLMEngine(tiny, EngineConfig(precompile=False, **KNOBS))
    lines = [line for line in capsys.readouterr().err.splitlines() if "generation config" in line]
    assert len(lines) == 1 and "temperature=0.0, max_tokens=6" in lines[0], lines


def test_the_models_max_new_tokens_bounds_an_unbounded_request_within_the_room_left(llm):
    room = llm.engine.cfg.max_model_len - 3
    [out] = llm.generate([[2 + i % 100 for i in range(room)]], use_tqdm=False)   # the model's 6 would not fit: 3 do
    assert (len(out.outputs[0].token_ids), out.outputs[0].finish_reason) == (3, "length")
    [out] = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=None, temperature=0.0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6
    [out] = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=9, temperature=0.0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 9   # a bound the request sets is its own


# ---- the servers ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny):
    with in_process(LLMEngine(tiny, EngineConfig(precompile=False, **SERVER_KNOBS))) as s:
        yield s


def test_http_fields_left_out_or_null_take_the_models_defaults(server, llm):
    greedy = token_ids(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))[0]
    with openai.OpenAI(base_url=base_url(server) + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        ids = lambda **fields: c.completions.create(model=MODEL, prompt=PROMPTS[0], extra_body={  # noqa: E731
            "return_token_ids": True, **fields}).choices[0].token_ids
        assert ids() == ids(temperature=None, top_p=None, max_tokens=None) == greedy   # max_tokens: the model's 6
        hot = ids(max_tokens=6, **HOT)
    assert hot != greedy and len(hot) == 6


def test_grpc_fields_left_unset_take_the_models_defaults(server, llm):
    greedy = token_ids(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))[0]

    async def completions():
        async with Client(f"127.0.0.1:{server.grpc_port}") as c:
            unset = await c.complete(PROMPTS[0], SamplingParams(max_tokens=None, seed=3))
            hot = await c.complete(PROMPTS[0], SamplingParams(max_tokens=6, **HOT))
            return list(unset.outputs[0].token_ids), list(hot.outputs[0].token_ids)
    unset, hot = asyncio.run(completions())
    assert unset == greedy and hot != greedy and len(hot) == 6


# ---- the command line ---------------------------------------------------------------------------------------
def test_cli_sampling_flags_left_out_are_unset_and_generation_config_is_a_knob():
    parser = build_parser()
    params = sampling_params(parser.parse_args(["generate", "hi"]))
    assert params.unset == {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}
    given = sampling_params(parser.parse_args(["client", "--temperature", "0", "--top-k", "5", "--min-p", "0.1",
                                               "--repetition-penalty", "1.2", "hi"]))
    assert (given.temperature, given.top_k, given.min_p, given.repetition_penalty) == (0.0, 5, 0.1, 1.2)
    assert given.unset == {"top_p"}
    assert served_engine_config(parser.parse_args(["serve"])).generation_config == "auto"
    assert served_engine_config(parser.parse_args(["serve", "--generation-config", "vllm"])).generation_config == "vllm"
    with pytest.raises(ValueError, match="generation_config must be one of"):
        EngineConfig(generation_config="hf")
