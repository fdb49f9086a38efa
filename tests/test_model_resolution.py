"""What the model decides before the engine starts: where it is (a Hugging Face repo id, ORG/NAME, resolved
through the local Hugging Face cache, laid out here as huggingface_hub lays it; nothing here reaches the Hub) and
how long a sequence may be (max_model_len: the model's context length, capped by the KV pool; --max-model-len on
every command)."""
import hashlib
import json
from pathlib import Path

import huggingface_hub
import jax.numpy as jnp
import pytest
from huggingface_hub import constants

from jaxserve import LLM, SamplingParams
from jaxserve.cli import build_parser, main as cli_main, make_llm, model_id
from jaxserve.models import gguf
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.loader import embedded_model_path, random_model, resolve_model_path

from helpers import KNOBS, TINY, TINY_HF_KWARGS, jaxserve

REPO, ABSENT = "Org/Tiny-Llama", "Org/Absent"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# max_model_len left to the model; a pool that holds the model's 512 tokens
LAZY = {**{k: v for k, v in KNOBS.items() if k != "max_model_len"}, "num_blocks": 64, "precompile": False}


def cache_repo(cache, repo_id: str, files: dict[str, bytes]):
    """repo_id's files in a Hugging Face cache as huggingface_hub lays one out: each file a blob named by its hash,
    the snapshot of commit COMMIT links to them, refs/main names the commit. Returns the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    for d in (repo / "blobs", repo / "refs", snapshot):
        d.mkdir(parents=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(blob)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def checkpoint_files(tmp_path_factory) -> dict[str, bytes]:
    """A tiny random HF Llama with the embedded SmolLM2's tokenizer (so its vocabulary), as files."""
    import transformers
    path = tmp_path_factory.mktemp("tiny-hf")
    config = transformers.LlamaConfig(**{**TINY_HF_KWARGS, "vocab_size": 49152, "tie_word_embeddings": True})
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    gguf_path = embedded_model_path("smollm2-135m-instruct")
    gguf.gguf_tokenizer(gguf.open_gguf(gguf_path), gguf_path).save_pretrained(path)
    return {p.name: p.read_bytes() for p in path.iterdir()}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache where huggingface_hub looks (HF_HUB_CACHE), offline (HF_HUB_OFFLINE).
    huggingface_hub reads both at import: its constants are patched, the environment is for subprocesses."""
    cache = tmp_path / "hub"
    cache.mkdir()
    for name, value in (("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", True)):
        monkeypatch.setattr(constants, name, value)
        monkeypatch.setenv(name, "1" if value is True else value)
    return cache


@pytest.fixture
def hf_cache(hub_cache, checkpoint_files):
    """The cache holding REPO's checkpoint: (cache, its snapshot)."""
    return hub_cache, cache_repo(hub_cache, REPO, checkpoint_files)


@pytest.mark.slow
def test_the_fake_cache_is_what_huggingface_hub_scans(hf_cache):
    cache, snapshot = hf_cache
    (repo,) = huggingface_hub.scan_cache_dir(cache).repos
    assert repo.repo_id == REPO and {r.commit_hash for r in repo.revisions} == {COMMIT}
    assert {f.file_name for f in next(iter(repo.revisions)).files} == {p.name for p in snapshot.iterdir()}


@pytest.mark.slow
def test_a_repo_id_loads_from_the_local_hugging_face_cache(hf_cache):
    _, snapshot = hf_cache
    assert resolve_model_path(REPO) == snapshot
    llm = LLM(REPO, dtype="f32", **LAZY)
    assert llm.engine.loaded.source == str(snapshot) and llm.get_tokenizer() is not None
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_an_absent_repo_names_the_repo_the_cache_and_how_to_get_it(hub_cache):
    cache = hub_cache
    with pytest.raises(ModelLoadError) as e:
        resolve_model_path(ABSENT)
    message = str(e.value)
    assert message.startswith(f"{ABSENT}: no such file or directory, nor a checkpoint in the Hugging Face cache "
                              f"{cache}, and HF_HUB_OFFLINE is set")
    assert f"`hf download {ABSENT}`" in message and "or give a local path" in message


def test_a_repo_that_cannot_be_downloaded_says_why(hub_cache, monkeypatch):
    """Online, an absent repo is downloaded; a Hub that cannot be reached (a closed local port here) is the reason
    the error gives; a cached repo still loads."""
    cache = hub_cache
    snapshot = cache_repo(cache, REPO, {"config.json": b"{}"})
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ModelLoadError) as e:
        resolve_model_path(ABSENT)
    assert str(e.value).startswith(f"{ABSENT}: no such file or directory, nor a checkpoint in the Hugging Face "
                                   f"cache {cache}, and the download failed (")
    assert resolve_model_path(REPO) == snapshot


def test_a_repo_id_is_served_as_its_name():
    assert model_id("HuggingFaceTB/SmolLM2-135M-Instruct", None) == "SmolLM2-135M-Instruct"
    assert model_id("Qwen/Qwen2.5-0.5B-Instruct", None) == "Qwen2.5-0.5B-Instruct"   # a dot is no file suffix


def test_a_path_is_a_path_before_a_repo_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Org" / "Name").mkdir(parents=True)
    assert resolve_model_path("Org/Name") == Path("Org/Name")
    for missing in ("./Org/Nope", "Org/Name/deeper", "/abs/path"):   # not ORG/NAME: no cache is asked
        with pytest.raises(ModelLoadError, match=r": no such file or directory \(embedded models: "):
            resolve_model_path(missing)


@pytest.mark.slow
def test_cli_generate_loads_a_repo_id_from_the_cache(hf_cache):
    """`jaxserve generate --model ORG/NAME`, with the cache in HF_HUB_CACHE: the same tokens as the Python API."""
    params = SamplingParams(temperature=0, max_tokens=4)
    run = jaxserve("generate", "--model", REPO, "--raw", "--json", "--temperature", "0", "--max-tokens", "4",
                   "--max-model-len", "64", "Hello")
    assert run.returncode == 0, run.stderr
    expected = LLM(REPO, dtype="f32", **LAZY).generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert json.loads(run.stdout)["token_ids"] == expected


# ---- max_model_len ------------------------------------------------------------------------------------------------
def tiny_llm(**knobs) -> LLM:
    return LLM(random_model(TINY, jnp.float32), **{**LAZY, **knobs})


def test_max_model_len_is_the_models_when_the_pool_holds_it(capsys):
    engine = tiny_llm().engine   # 63 blocks of 16: more than the model's 512
    assert engine.cfg.max_model_len == TINY.max_position_embeddings
    assert engine.graphs.max_blocks_per_seq == TINY.max_position_embeddings // engine.cfg.block_size
    assert "max_model_len" not in capsys.readouterr().err


def test_a_small_pool_caps_the_models_max_model_len_in_one_line(capsys):
    llm = tiny_llm(num_blocks=11)   # 10 blocks of 16 past the null block: 160 tokens
    engine = llm.engine
    assert engine.cfg.max_model_len == engine.scheduler.cfg.max_model_len == engine.kv.max_tokens_per_seq == 160
    lines = [line for line in capsys.readouterr().err.splitlines() if "max_model_len" in line]
    assert lines == [f"max_model_len {TINY.max_position_embeddings} (the model's) capped to 160: the KV cache holds "
                     "160 tokens per sequence (10 blocks of 16); more blocks (num_blocks, memory_fraction) raise it"]
    with pytest.raises(ValueError, match="max_model_len=160"):
        engine.add_request([2] * 150, SamplingParams(max_tokens=11))
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    out = llm.generate([[2] * 150], params, use_tqdm=False)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (10, "length")   # runs to the cap, never past the pool


def test_a_given_max_model_len_is_kept_or_refused_by_the_model(capsys):
    engine = tiny_llm(num_blocks=11, max_model_len=256).engine   # past the pool: requests past it are refused
    assert engine.cfg.max_model_len == 256
    assert "max_model_len 256 (given): the KV cache holds 160 tokens per sequence" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^max_model_len=1024 exceeds the model's max_position_embeddings=512: "
                                         r"lower max_model_len \(--max-model-len\)"):
        tiny_llm(num_blocks=11, max_model_len=1024)


@pytest.fixture
def random_config(tmp_path):
    """A run config of TINY's shapes with random weights, its engine section given by each test."""
    def write(**engine):
        path = tmp_path / "tiny.yaml"
        hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": TINY.vocab_size, "hidden_size": TINY.hidden_size,
              "intermediate_size": TINY.intermediate_size, "num_hidden_layers": TINY.num_layers,
              "num_attention_heads": TINY.num_heads, "num_key_value_heads": TINY.num_kv_heads,
              "max_position_embeddings": TINY.max_position_embeddings}
        path.write_text(json.dumps({"model": "random", "dtype": "f32", "random_model": hf,
                                    "engine": {**LAZY, **engine}}))
        return str(path)
    return write


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flag, in_config, expected", [(100, 200, 100), (None, 200, 200), (None, None, 512)])
def test_generate_and_chat_take_max_model_len(random_config, command, flag, in_config, expected):
    """--max-model-len over --config's, over the model's."""
    config = random_config(**({} if in_config is None else {"max_model_len": in_config}))
    argv = [command, "--config", config, *([] if flag is None else ["--max-model-len", str(flag)])]
    args = build_parser().parse_args(argv + (["hi"] if command == "generate" else []))
    assert make_llm(args).engine.cfg.max_model_len == expected


def test_bench_sweep_takes_max_model_len(random_config, capsys):
    """The sweep's contexts reach max_model_len: --max-model-len's, else the model's when the config gives none."""
    config = random_config()
    for flags, high in ((["--max-model-len", "128"], 128), ([], TINY.max_position_embeddings)):
        argv = ["bench", "sweep", "--config", config, "--contexts", str(high + 1), *flags]
        assert cli_main(argv) == 2
        assert f"contexts must be non-empty integers in [1, {high}]" in capsys.readouterr().err
