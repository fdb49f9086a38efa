"""The command line as a user meets it: JSON output, orbax round trip, one clear line for every bad model."""
import json
import subprocess
import sys

import gguf
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

PROMPT = "The capital of France is"


def jaxserve(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "jaxserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_json_matches_the_python_api(smollm):
    run = jaxserve("generate", "--json", "--max-tokens", "8", PROMPT, "Hi")
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    expected = LLM(smollm, precompile=False, num_blocks=64).generate(
        [PROMPT, "Hi"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert [r["prompt"] for r in rows] == [PROMPT, "Hi"]
    assert [r["token_ids"] for r in rows] == [e.outputs[0].token_ids for e in expected]
    assert [r["text"] for r in rows] == [e.outputs[0].text for e in expected]
    assert "Paris" in rows[0]["text"]


def test_convert_round_trip_gives_the_same_tokens(tmp_path):
    dst = tmp_path / "smollm-orbax"
    assert jaxserve("convert", "smollm2-135m-instruct", str(dst)).returncode == 0
    direct = jaxserve("generate", "--json", "--max-tokens", "8", PROMPT)
    converted = jaxserve("generate", "--json", "--max-tokens", "8", "--model", str(dst), PROMPT)
    assert converted.returncode == 0, converted.stderr
    assert json.loads(converted.stdout)["token_ids"] == json.loads(direct.stdout)["token_ids"]


def write_gguf(path, arch="llama", tensor_type=gguf.GGMLQuantizationType.F32):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_context_length(128)
    w.add_vocab_size(8)
    data = np.zeros((8, 210), np.uint8) if tensor_type == gguf.GGMLQuantizationType.Q6_K else np.zeros((8, 256), np.float32)
    w.add_tensor("token_embd.weight", data, raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("case", ["missing", "corrupt", "unknown-arch-gguf", "unknown-arch-hf", "q6k-tensor"])
def test_bad_model_gives_one_clear_line(tmp_path, case):
    if case == "missing":
        path, reason = tmp_path / "nope.gguf", "no such file"
    elif case == "corrupt":
        path, reason = tmp_path / "bad.gguf", "not a readable GGUF"
        path.write_bytes(b"GGUF" + bytes(range(200)))
    elif case == "unknown-arch-gguf":
        path, reason = write_gguf(tmp_path / "gpt2.gguf", arch="gpt2"), "unknown architecture 'gpt2'"
    elif case == "unknown-arch-hf":
        path, reason = tmp_path / "hf", "unknown architecture 'gpt2'"
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                                      "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
                                                      "num_hidden_layers": 1, "num_attention_heads": 2}))
        (path / "model.safetensors").write_bytes(b"")
    else:
        path, reason = write_gguf(tmp_path / "q6k.gguf", tensor_type=gguf.GGMLQuantizationType.Q6_K), "Q6_K"
    run = jaxserve("generate", "--model", str(path), "hello", timeout=120)
    assert run.returncode == 2
    lines = [l for l in run.stderr.splitlines() if l.startswith("jaxserve generate: error:")]
    assert len(lines) == 1 and str(path) in lines[0] and reason in lines[0], run.stderr
    assert "Traceback" not in run.stderr


def test_chat_repl_answers_through_the_chat_template():
    run = subprocess.run([sys.executable, "-m", "jaxserve.cli", "chat", "--max-tokens", "8"], input="What is 2+2?\n\n",
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip(), "the assistant printed nothing"
