"""The command line as a user meets it: JSON output, orbax round trip, one clear line for every bad model, every
default in --help, --version, generate streaming to a terminal and marking a length stop; and what it imports: no
benchmarks unless `bench` runs, no cycle with the serving modules."""
import ast
import importlib.metadata
import io
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

import jaxserve as jaxserve_package
from jaxserve import LLM, SamplingParams, cli
from jaxserve.cli import build_parser, model_id

from helpers import jaxserve

pytestmark = pytest.mark.slow   # every test runs the CLI, an interpreter in a subprocess, or the embedded model

PROMPT = "The capital of France is"
SERVE_DIR = Path(__file__).resolve().parents[1] / "jaxserve" / "serve"


@pytest.fixture(scope="module")
def offline(smollm):
    return LLM(smollm, precompile=False, num_blocks=64)


def test_generate_answers_through_the_chat_template_quietly(offline):
    """An instruct model answers each prompt as a user message (as LLM.chat does), and stderr holds only jaxserve's
    own progress lines, even without torch."""
    prompts = ["What is the capital of France?", "Hi"]
    run = jaxserve("generate", "--json", "--max-tokens", "12", "--temperature", "0", *prompts, without_torch=True)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    expected = offline.chat([[{"role": "user", "content": p}] for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert [r["prompt"] for r in rows] == prompts
    assert [(r["token_ids"], r["text"]) for r in rows] == [(e.outputs[0].token_ids, e.outputs[0].text)
                                                           for e in expected]
    assert rows[0]["text"] == "The capital of France is Paris."
    assert not [line for line in run.stderr.splitlines() if "transformers" in line or "warn" in line.lower()], \
        run.stderr


def test_generate_raw_matches_the_python_api(offline):
    run = jaxserve("generate", "--raw", "--json", "--max-tokens", "8", "--temperature", "0", PROMPT, "Hi")
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    expected = offline.generate([PROMPT, "Hi"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert [r["prompt"] for r in rows] == [PROMPT, "Hi"]
    assert [r["token_ids"] for r in rows] == [e.outputs[0].token_ids for e in expected]
    assert [r["text"] for r in rows] == [e.outputs[0].text for e in expected]
    assert "Paris" in rows[0]["text"]


def test_generate_serves_fp8_weights_and_cache_as_the_python_api_does():
    run = jaxserve("generate", "--raw", "--json", "--max-tokens", "8", "--temperature", "0", "--quantization", "fp8",
                   "--kv-cache-dtype", "fp8", PROMPT)
    assert run.returncode == 0, run.stderr
    llm = LLM(quantization="fp8", kv_cache_dtype="fp8", precompile=False)
    assert llm.engine.stats()["weight_dtype"] == llm.engine.stats()["kv_cache_dtype"] == "float8_e4m3fn"
    expected = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert json.loads(run.stdout)["token_ids"] == expected[0].outputs[0].token_ids


def test_convert_round_trip_gives_the_same_tokens(tmp_path):
    dst = tmp_path / "smollm-orbax"
    assert jaxserve("convert", "smollm2-135m-instruct", str(dst)).returncode == 0
    direct = jaxserve("generate", "--json", "--max-tokens", "8", PROMPT)   # the chat template survives the round trip
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
    data = np.zeros((8, 256), np.int32 if tensor_type == gguf.GGMLQuantizationType.I32 else np.float32)
    w.add_tensor("token_embd.weight", data, raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("case", ["missing", "corrupt", "unknown-arch-gguf", "unknown-arch-hf", "i32-tensor"])
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
        path, reason = write_gguf(tmp_path / "i32.gguf", tensor_type=gguf.GGMLQuantizationType.I32), "I32"
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


def modules_after_importing(*modules: str) -> set[str]:
    """sys.modules of a fresh interpreter that imported `modules`."""
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print(*sys.modules, sep='\\n')"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return set(run.stdout.split())


def imported_names(path: Path) -> set[str]:
    """Every module a file imports anywhere (function bodies included), `from a import b` counted as a and a.b."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
    return names


def test_cli_import_leaves_benchmarks_alone():
    assert not {m for m in modules_after_importing("jaxserve.cli") if m.partition(".")[0] == "benchmarks"}


def test_serve_modules_never_import_the_cli():
    assert "jaxserve.cli" not in modules_after_importing("jaxserve.serve.server", "jaxserve.client")
    for path in SERVE_DIR.glob("*.py"):   # not even lazily, inside a function
        assert "jaxserve.cli" not in imported_names(path), path


def test_bench_subcommands_parse_on_demand():
    top, sweep = jaxserve("--help", timeout=120), jaxserve("bench", "sweep", "--help", timeout=120)
    assert top.returncode == 0 and "bench" in top.stdout, top.stderr
    assert sweep.returncode == 0 and "--token-buckets" in sweep.stdout, sweep.stderr


def option_help(capsys, *command: str) -> dict[str, str]:
    """`jaxserve COMMAND --help`'s options: each one's first flag -> its entry, unwrapped."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*command, "--help"])
    assert exit_.value.code == 0
    entries = re.split(r"\n  (?=-)", capsys.readouterr().out.split("\noptions:\n", 1)[1])
    return {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries}


@pytest.mark.parametrize("command, defaults", [
    (["serve"], {"--port": "8000", "--grpc-port": "50051", "--log-level": "info", "--metrics-port": "None",
                 "--no-grpc": "False", "--http-read-timeout": "30.0", "--max-message-bytes": "16777216"}),
    (["generate"], {"--max-tokens": "64", "--temperature": "None", "--generation-config": "None"}),
    (["chat"], {"--max-tokens": "256"}),
    (["client"], {"--port": "50051"}),
    (["convert"], {"--dtype": "None"}),
])
def test_help_shows_every_options_default(capsys, command, defaults):
    options = option_help(capsys, *command)
    assert {flag: entry for flag, entry in options.items() if flag != "-h" and "(default: " not in entry} == {}
    assert {flag: options[flag].rpartition("(default: ")[2][:-1] for flag in defaults} == defaults


def test_version_prints_the_package_version():
    run = jaxserve("--version", timeout=120)
    assert run.returncode == 0 and run.stdout == importlib.metadata.version("jaxserve") + "\n", run.stderr


def test_version_needs_no_installed_metadata(monkeypatch, capsys):
    """A source tree on PYTHONPATH (the GPU machines run it so) has no jaxserve distribution."""
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == jaxserve_package.__version__ + "\n"


def test_serve_takes_the_model_as_its_positional_argument(tmp_path):
    """MODEL means what --model does: a missing file is named in the one error line, before anything loads."""
    path = tmp_path / "nope.gguf"
    run = jaxserve("serve", str(path), "--port", "0", "--grpc-port", "0", timeout=120)
    lines = [line for line in run.stderr.splitlines() if line.startswith("jaxserve serve: error:")]
    assert run.returncode == 2 and len(lines) == 1 and str(path) in lines[0] and "no such file" in lines[0], \
        run.stderr


def test_served_model_id_is_stable_whatever_loads_it(tmp_path):
    """The served name without --served-model-name: an embedded model's name (also through a config that names
    it), a checkpoint's file stem or directory name, a random model's config stem; never a path."""
    gguf_file, checkpoint = tmp_path / "Tiny-Llama.Q8_0.gguf", tmp_path / "Llama-3-8B-Instruct"
    gguf_file.write_bytes(b"")
    checkpoint.mkdir()
    random_config = tmp_path / "llama3-8b-random.yaml"
    random_config.write_text("model: random\n")
    assert model_id(None, None) == model_id("smollm2-135m-instruct", None) == "smollm2-135m-instruct"
    assert model_id(None, "configs/smollm2-135m-instruct.yaml") == "smollm2-135m-instruct"
    assert model_id(str(gguf_file), None) == "Tiny-Llama.Q8_0"
    assert model_id(str(checkpoint), None) == model_id(f"{checkpoint}/", None) == "Llama-3-8B-Instruct"
    assert model_id(None, str(random_config)) == "llama3-8b-random"
    assert model_id(str(checkpoint), str(random_config)) == "Llama-3-8B-Instruct"   # MODEL over the config's


# ---- generate's output on a terminal and in a pipe (in this process, over the module's LLM) ----------------
class Console(io.StringIO):
    """stdout or stderr, a terminal or not, recording each write as (its name, the text) in a shared list."""

    def __init__(self, name: str, writes: list[tuple[str, str]], terminal: bool):
        super().__init__()
        self.name, self.writes, self.terminal = name, writes, terminal

    def isatty(self) -> bool:
        return self.terminal

    def write(self, text: str) -> int:
        self.writes.append((self.name, text))
        return super().write(text)


def generate_here(monkeypatch, llm: LLM, *args: str, terminal: bool) -> list[tuple[str, str]]:
    """`jaxserve generate ARGS` over llm in this process: every write to stdout and stderr, in order."""
    writes = []
    monkeypatch.setattr(cli, "make_llm", lambda *_, **__: llm)
    monkeypatch.setattr(sys, "stdout", Console("stdout", writes, terminal))
    monkeypatch.setattr(sys, "stderr", Console("stderr", writes, terminal))
    assert cli.main(["generate", *args]) == 0
    return writes


def written(writes: list[tuple[str, str]], stream: str) -> str:
    return "".join(text for name, text in writes if name == stream)


@pytest.mark.parametrize("max_tokens, reason", [(4, "length"), (48, "stop")])
def test_generate_streams_to_a_terminal_and_marks_a_length_stop(monkeypatch, offline, max_tokens, reason):
    question = "What is the capital of France?"
    want = offline.chat([{"role": "user", "content": question}], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                        use_tqdm=False)[0].outputs[0]
    writes = generate_here(monkeypatch, offline, "--max-tokens", str(max_tokens), "--temperature", "0", question,
                           terminal=True)
    assert want.finish_reason == reason
    assert written(writes, "stdout") == want.text + "\n"
    assert len([text for name, text in writes if name == "stdout" and text.strip()]) >= 4   # token by token
    mark = f"[stopped: --max-tokens {max_tokens} reached]\n"
    assert written(writes, "stderr") == (mark if reason == "length" else "")
    if reason == "length":   # after the text
        assert writes.index(("stderr", mark.strip())) > max(i for i, (name, _) in enumerate(writes) if name == "stdout")


def test_generate_streams_several_prompts_as_it_prints_them_to_a_pipe(monkeypatch, offline):
    """On a terminal each answer streams under its heading, laid out as in a pipe; a pipe's stdout is the answers
    alone, the length stop said on stderr; --json gives each finish_reason."""
    prompts = ["What is the capital of France?", "Name three colours."]   # the first ends by itself, the second not
    args = ("--max-tokens", "12", "--temperature", "0", *prompts)
    piped, streamed = generate_here(monkeypatch, offline, *args, terminal=False), \
        generate_here(monkeypatch, offline, *args, terminal=True)
    rows = [json.loads(line) for line in written(generate_here(monkeypatch, offline, "--json", *args, terminal=False),
                                                 "stdout").splitlines()]
    want = offline.chat([[{"role": "user", "content": p}] for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert [(r["text"], r["finish_reason"]) for r in rows] == [(w.outputs[0].text, w.outputs[0].finish_reason)
                                                               for w in want]
    assert [r["finish_reason"] for r in rows] == ["stop", "length"]
    assert written(piped, "stdout") == "".join(f"### {p}\n{r['text']}\n\n" for p, r in zip(prompts, rows))
    assert written(streamed, "stdout") == written(piped, "stdout")
    assert written(piped, "stderr") == written(streamed, "stderr") == "[stopped: --max-tokens 12 reached]\n"


def test_logging_configured_twice_prints_each_line_once(capsys):
    """serve configures it, and so does the start of its engines (in their own process, or on the server's)."""
    logger = logging.getLogger("jaxserve")
    saved = logger.handlers[:], logger.level, logger.propagate
    try:
        cli.configure_logging("info")
        cli.configure_logging("info")
        logging.getLogger("jaxserve.engine").info("a finished request")
        assert capsys.readouterr().err.count("a finished request") == 1
    finally:
        logger.handlers, logger.level, logger.propagate = saved
