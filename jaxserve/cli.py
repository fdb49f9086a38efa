"""`jaxserve` command line: generate, chat, convert, serve, client and bench. Every argument is parsed here;
the modules behind the commands take plain values (and never import this one)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

import jaxserve
from jaxserve.cache.vattention import leave_gpu_memory_to_the_page_pool
from jaxserve.client import ClientError, grpc_reply, http_reply, print_reply
from jaxserve.config import (GENERATION_CONFIGS, KV_CACHE_DTYPES, QUANTIZATIONS, SPECULATIVE_METHODS, EngineConfig,
                             SpeculativeConfig, engine_flags, load_run_config)
from jaxserve.engine import distributed
from jaxserve.engine.llm import LLM, has_chat_template
from jaxserve.engine.llm_engine import LLMEngine, start_device
from jaxserve.engine.runner import ModelRunner
from jaxserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.loader import DEFAULT_MODEL, EMBEDDED_MODELS, load_model, load_replicas, load_run, save_converted
from jaxserve.serve import connections, server
from jaxserve.serve.connections import ConnectionLimits
from jaxserve.serve.engine_process import EngineProcess
from jaxserve.serve.engine_loop import THROUGHPUT_INTERVAL_S
from jaxserve.serve.tool_calls import TOOL_PARSERS

ENGINE_FLAGS = engine_flags()   # the knobs declared flag=True in config.EngineConfig
LOG_LEVELS = ("debug", "info", "warning", "error")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written, and every option's default after its help, an option without help text included
    (argparse shows a default only beside help text)."""

    def _format_action(self, action):
        if action.help is None and action.option_strings:
            action = copy.copy(action)
            action.help = self._get_help_string(action).lstrip()
        return super()._format_action(action)


class Parser(argparse.ArgumentParser):
    """Subparsers are made of their parser's class: so every subcommand's help shows its defaults."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"formatter_class": HelpFormatter, **kwargs})


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="embedded model name, GGUF file, HF checkpoint or converted directory, or a Hugging Face "
                        "repo id (ORG/NAME) in the local Hugging Face cache, downloaded there first unless "
                        f"HF_HUB_OFFLINE=1 (None: --config's model, else the embedded {DEFAULT_MODEL})")
    p.add_argument("--dtype", choices=["f32", "bf16"], default=None, help="None: f32 on CPU, bf16 on GPU")
    p.add_argument("--config", default=None, help="YAML engine config (see configs/)")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="devices the model is split over (overrides --config; None: --config's, else 1)")
    p.add_argument("--quantization", choices=[q for q in QUANTIZATIONS if q], default=None,
                   help="fp8: the linear layers' weights in float8 e4m3 with per-channel scales, quantized at load "
                        "(overrides --config; a pre-quantized FP8 checkpoint needs no flag); gguf: a GGUF file's "
                        "Q4_1 / Q8_0 blocks kept as stored (the default on one CPU device); float: dequantized to "
                        "the model dtype")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="fp8: the KV cache in float8 e4m3 with a scale per layer and kv head, twice the tokens "
                        "(overrides --config; None: --config's, else auto: the model's dtype)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt and output, in tokens (overrides --config; None: --config's, else "
                        "the model's context length, capped to what the KV cache holds per sequence)")
    p.add_argument("--generation-config", choices=GENERATION_CONFIGS, default=None,
                   help="what sampling a request leaves unset takes: auto, the model's generation config (HF "
                        "generation_config.json, GGUF general.sampling.*), else vLLM's defaults; vllm: vLLM's "
                        "(overrides --config; None: --config's, else auto)")
    p.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default=None,
                   help="speculative decoding: ngram drafts the next tokens from earlier text of the same sequence "
                        "(prompt lookup), draft from a smaller model with the same tokenizer (--speculative-model), "
                        "eagle3 from an EAGLE-3 head trained for the model (--speculative-model: its directory); "
                        "each is verified exactly in one step (overrides --config's speculative_config; None: "
                        "--config's, else off)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help=f"drafts per sequence and step (None: --config's, else "
                        f"{SpeculativeConfig.num_speculative_tokens})")
    p.add_argument("--speculative-model", default=None,
                   help="the draft model of --speculative-method draft or eagle3, a name or path as the model's (None: "
                        "--config's)")


def speculative_override(args, given: SpeculativeConfig | None) -> dict:
    """The engine knob the speculative flags set over the config file's: {} when none is given."""
    fields = {"method": args.speculative_method, "num_speculative_tokens": args.num_speculative_tokens,
              "model": args.speculative_model}
    if all(v is None for v in fields.values()):
        return {}
    if given is None and args.speculative_method is None:
        raise ValueError("--num-speculative-tokens and --speculative-model need --speculative-method (or a "
                         "speculative_config in --config)")
    return {"speculative_config": replace(given or SpeculativeConfig(),
                                          **{k: v for k, v in fields.items() if v is not None})}


MODEL_DEFAULT = "None: the model's default (its generation config, else vLLM's)"


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None, help=f"0: greedy ({MODEL_DEFAULT})")
    p.add_argument("--top-p", type=float, default=None, help=MODEL_DEFAULT)
    p.add_argument("--top-k", type=int, default=None, help=f"0 or -1: off ({MODEL_DEFAULT})")
    p.add_argument("--min-p", type=float, default=None, help=MODEL_DEFAULT)
    p.add_argument("--repetition-penalty", type=float, default=None, help=MODEL_DEFAULT)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json-schema", metavar="FILE", default=None,
                   help="a JSON schema the answer follows (structured outputs)")


def sampling_params(args) -> SamplingParams:
    """The flags given; the rest are left unset, for the serving model's defaults."""
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, structured_outputs=json_schema_file(args.json_schema))


def json_schema_file(path: str | None) -> StructuredOutputsParams | None:
    try:
        return None if path is None else StructuredOutputsParams(json=Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--json-schema {path}: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(f"--json-schema {path}: {e}") from None


def prepare_process(cfg: EngineConfig) -> None:
    """What must happen before JAX starts its GPU backend."""
    if cfg.kv_backend == "vattention":
        leave_gpu_memory_to_the_page_pool()


def make_llm(args, **engine_kwargs) -> LLM:
    if args.config:
        prepare_process(load_run_config(args.config).engine)
    loaded, engine = load_run(args.model, args.config, args.dtype, args.tensor_parallel_size,
                              quantization=args.quantization)
    overrides = {"kv_cache_dtype": args.kv_cache_dtype, "max_model_len": args.max_model_len,
                 "generation_config": args.generation_config}
    engine_kwargs |= {k: v for k, v in overrides.items() if v is not None}
    engine_kwargs |= speculative_override(args, (engine or EngineConfig()).speculative_config)
    return LLM(loaded, config=engine, **engine_kwargs)


def cmd_generate(args) -> None:
    """Each prompt as the user's message of a chat when the model has a chat template (an instruct model answers
    it, rather than continuing the text), unless --raw. On a terminal (without --json) each answer streams as it is
    generated, the prompts one after another; otherwise they run as one batch. A stop at the token limit is said on
    stderr (--json: each object's finish_reason), so stdout stays the answers alone."""
    params = sampling_params(args)
    llm = make_llm(args, precompile=False)   # one-shot use: compile only the buckets it needs
    chat = not args.raw and has_chat_template(llm.get_tokenizer())
    prompts = [[{"role": "user", "content": p}] for p in args.prompts] if chat else args.prompts
    if sys.stdout.isatty() and not args.json:
        for text, prompt in zip(args.prompts, prompts):   # laid out as below: the answer under its heading
            if len(prompts) > 1:
                print(f"### {text}", flush=True)
            stream_reply(llm, llm.apply_chat_template(prompt) if chat else prompt, params)
            if len(prompts) > 1:
                print(flush=True)
        return
    outputs = llm.chat(prompts, params) if chat else llm.generate(prompts, params)
    for prompt, out in zip(args.prompts, outputs):
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "token_ids": c.token_ids, "text": c.text,
                              "finish_reason": c.finish_reason}), flush=True)
        else:
            print(c.text if len(args.prompts) == 1 else f"### {prompt}\n{c.text}\n", flush=True)
            mark_length_stop(c.finish_reason, params)


def stream_reply(llm: LLM, prompt: str | list[int], params: SamplingParams) -> str:
    """One reply printed as it is generated, then a newline; a stop at the token limit marked on stderr."""
    reply, finish_reason = "", None
    for delta in llm.stream(prompt, params):
        reply += delta.text
        finish_reason = delta.finish_reason or finish_reason
        print(delta.text, end="", flush=True)
    print(flush=True)
    mark_length_stop(finish_reason, params)
    return reply


def mark_length_stop(finish_reason: str | None, params: SamplingParams) -> None:
    if finish_reason == "length":
        print(f"[stopped: --max-tokens {params.max_tokens} reached]", file=sys.stderr, flush=True)


def cmd_chat(args) -> None:
    params = sampling_params(args)
    llm = make_llm(args, precompile=False)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("jaxserve chat — empty line or Ctrl-D to quit", file=sys.stderr)
    for line in sys.stdin:
        if not line.strip():
            break
        messages.append({"role": "user", "content": line.strip()})
        messages.append({"role": "assistant", "content": stream_reply(llm, llm.apply_chat_template(messages), params)})


def cmd_convert(args) -> None:
    # an orbax checkpoint holds float or FP8 weights: a GGUF's blocks are dequantized for it
    dst = save_converted(load_model(args.src, args.dtype, quantization=args.quantization or "float"), args.dst)
    print(f"saved {args.src} -> {dst}", file=sys.stderr)


def served_engine_config(args) -> EngineConfig:
    """--config's engine section (or the defaults) with the engine flags on top, checked whole."""
    model_knobs = ("tensor_parallel_size", "kv_cache_dtype", "max_model_len", "generation_config")
    knobs = {k: getattr(args, k) for k in ENGINE_FLAGS + model_knobs if getattr(args, k) is not None}
    if args.no_precompile:
        knobs["precompile"] = False
    cfg = load_run_config(args.config).engine if args.config else EngineConfig()
    return replace(cfg, **knobs, **speculative_override(args, cfg.speculative_config))


def served_model(args) -> str | None:
    """serve's MODEL or --model, which name the same thing (None: neither)."""
    if args.model_arg is not None and args.model is not None and args.model_arg != args.model:
        raise ValueError(f"MODEL {args.model_arg} and --model {args.model}: name the model once")
    return args.model if args.model_arg is None else args.model_arg


def model_id(model: str | None, config: str | None) -> str:
    """The model's served name unless --served-model-name gives one: an embedded model's name, a checkpoint's file
    stem or directory name, a Hugging Face repo id's NAME, the config's file stem for random weights."""
    name = load_run_config(config).model if config and model in (None, DEFAULT_MODEL) else model or DEFAULT_MODEL
    if name in EMBEDDED_MODELS:
        return name
    path = Path(config if name == "random" else name)
    return path.stem if path.is_file() else path.name



def api_key(args) -> str | None:
    """--api-key, else JAXSERVE_API_KEY (not the flag's default: --help prints defaults)."""
    return os.environ.get("JAXSERVE_API_KEY") if args.api_key is None else args.api_key


def serve_options(args) -> server.ServeOptions:
    return server.ServeOptions(host=args.host, http_port=args.port, grpc_port=None if args.no_grpc else args.grpc_port,
                               metrics_port=args.metrics_port, http_metrics=not args.no_metrics,
                               max_waiting=args.max_waiting, grace_period_s=args.grace_period,
                               max_message_bytes=args.max_message_bytes, tls_cert=args.tls_cert, tls_key=args.tls_key,
                               scheduling_policy=args.scheduling_policy, reflection=not args.no_reflection,
                               api_key=api_key(args),
                               allowed_origins=tuple(o for o in args.allowed_origins.split(",") if o),
                               tool_call_parser=args.tool_call_parser,
                               http_limits=ConnectionLimits(args.http_max_connections, args.http_read_timeout,
                                                            args.http_write_timeout))


def configure_logging(level: str) -> None:
    """jaxserve's loggers (a line per finished request, the throughput lines) to stderr from `level` up; again, the
    same (one handler)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S"))
    logger = logging.getLogger("jaxserve")
    logger.setLevel(level.upper())
    logger.handlers = [handler]
    logger.propagate = False   # a library's root handler would print each line twice


def cmd_serve(args) -> None:
    """Every flag, the config, the TLS files and the ports are checked before the model loads (minutes on a
    large model); once every engine failed (each data-parallel replica's), the server exits 1, so a supervisor
    restarts it. Multi-host: process 0 serves, the others run the steps it publishes (engine/distributed.py)."""
    configure_logging(args.log_level)
    opts, cfg, model = serve_options(args), served_engine_config(args), served_model(args)
    cluster = distributed.cluster_from(args.coordinator_address, args.num_processes, args.process_id)
    if cluster is not None and args.data_parallel_size != 1:
        raise ValueError("--data-parallel-size: a multi-host engine is one replica; run a server per cluster and "
                         "balance over them")
    if cluster is None or cluster.is_leader:
        opts.read_tls()
        opts.check_bindable()
    prepare_process(cfg)
    distributed.initialize(cluster, cfg.tensor_parallel_size)   # before anything touches a device
    names = tuple(args.served_model_name or (model_id(model, args.config),))
    if cluster is None and args.engine_process:
        code = server.serve(opts, EngineProcess(functools.partial(start_engines, args, cfg, model)), names)
    elif cluster is not None and not cluster.is_leader:
        follow_leader(cluster, start_device(load_served(args, cfg, model)[0], cfg)[1])
        return
    else:
        engines = start_engines(args, cfg, model)
        with distributed.leading(cluster, engines[0].runner):
            code = server.serve(opts, engines, names)
    if code:
        raise SystemExit(code)


def load_served(args, cfg: EngineConfig, model: str | None) -> list:
    """The model (else --config's, whose `model: random` builds random weights) for each data-parallel replica."""
    return load_replicas(model, args.config, args.dtype, cfg.tensor_parallel_size, args.data_parallel_size,
                         quantization=args.quantization)[0]


def start_engines(args, cfg: EngineConfig, model: str | None) -> list[LLMEngine]:
    """serve's engines, one per data-parallel replica; in an engine process, its whole start (logging there too)."""
    configure_logging(args.log_level)
    return [LLMEngine(loaded, cfg) for loaded in load_served(args, cfg, model)]


def follow_leader(cluster: distributed.Cluster, runner: ModelRunner) -> None:
    print(f"jaxserve serve: process {cluster.process_id} of {cluster.num_processes}: running the steps process 0 "
          "publishes", file=sys.stderr, flush=True)
    steps = distributed.follow(cluster, runner)
    print(f"jaxserve serve: stopped after {steps} steps", file=sys.stderr, flush=True)


def cmd_client(args) -> None:
    """PROMPT (after --system) as a user message unless --raw: the server applies the model's chat template, and a
    model without one refuses it (the error says so, and --raw asks for a plain completion)."""
    prompt = args.prompt if args.raw else [*([{"role": "system", "content": args.system}] if args.system else []),
                                           {"role": "user", "content": args.prompt}]
    if args.url:
        reply = http_reply(http_base_url(args.url), prompt, sampling_params(args), api_key=api_key(args),
                           timeout=args.timeout)
    else:
        reply = grpc_reply(f"{args.host}:{args.port}", prompt, sampling_params(args),
                           root_certificates=read_tls_ca(args.tls_ca), api_key=api_key(args), timeout=args.timeout)
    try:
        asyncio.run(print_reply(reply))
    except ClientError as e:
        hint = " (--raw sends PROMPT as a plain completion)" if not args.raw and "chat template" in str(e) else ""
        raise SystemExit(f"jaxserve client: error: {e}{hint}") from None


def http_base_url(url: str) -> str:
    """--url as the openai package's base URL: /v1 added unless given."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url {url}: give the server's HTTP address, http://HOST:PORT (its --port)")
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def read_tls_ca(path: str | None) -> bytes | None:
    try:
        return None if path is None else Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"--tls-ca {path}: {e.strerror}") from None


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model: an OpenAI-compatible HTTP API with Prometheus /metrics on "
                                     "--port, and gRPC (health, reflection) on --grpc-port")
    p.add_argument("model_arg", nargs="?", metavar="MODEL", help="the model, as --model names it")
    add_model_args(p)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names requests may give the model, responses giving the first (None: an embedded "
                        "model's name, a checkpoint's file stem or directory name, a random model's config stem)")
    p.add_argument("--host", default=server.DEFAULT_HOST, help="address to bind (127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=server.DEFAULT_PORT,
                   help="the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
                        "/detokenize, /version, /health) and Prometheus /metrics, always served (0: any free port)")
    grpc_flags = p.add_mutually_exclusive_group()
    grpc_flags.add_argument("--grpc-port", type=int, default=server.DEFAULT_GRPC_PORT,
                            help="the gRPC API, with health and reflection (0: any free port)")
    grpc_flags.add_argument("--no-grpc", action="store_true", help="no gRPC server: HTTP only")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="also serve Prometheus /metrics on a port of its own (0: any free port)")
    p.add_argument("--no-metrics", action="store_true", help="no /metrics on --port (--metrics-port still serves it)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="of jaxserve's log on stderr; info: a line per finished request, and the throughput every "
                        f"{THROUGHPUT_INTERVAL_S:g} s while requests run")
    p.add_argument("--api-key", default=None,
                   help="every call needs `Authorization: Bearer KEY`: an HTTP header, gRPC call metadata, the metrics "
                        "scrape (health checks stay open; None: env JAXSERVE_API_KEY, which keeps it out of `ps`)")
    p.add_argument("--allowed-origins", default="",
                   help="comma-separated browser origins (https://host[:port], or *) the HTTP API answers, with CORS; "
                        "requests from any other origin get 403 (empty: none, so no web page can drive the server)")
    p.add_argument("--tool-call-parser", choices=TOOL_PARSERS, default=None,
                   help="how tool_choice auto reads the model's tool calls: hermes (<tool_call> blocks: Hermes, Qwen) "
                        "or llama3_json (Llama 3.x JSON calls); None: the one the chat template tells, if any (else "
                        "only tool_choice required or a named function is served)")
    p.add_argument("--http-max-connections", type=int, default=connections.DEFAULT_MAX_CONNECTIONS,
                   help="open HTTP connections; more are answered 503 and closed")
    p.add_argument("--http-read-timeout", type=float, default=connections.DEFAULT_READ_TIMEOUT_S,
                   help="seconds a client has to send a request's headers, and then its body; an idle "
                        "kept-alive connection is closed after as long")
    p.add_argument("--http-write-timeout", type=float, default=connections.DEFAULT_WRITE_TIMEOUT_S,
                   help="seconds a response may wait on a client that reads nothing; then it is cut and its "
                        "request aborted")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engines in a process of their own, so that the front ends never hold up a step "
                        "(--no-engine-process: on threads of the server's process; a multi-host engine always is)")
    p.add_argument("--max-waiting", type=int, default=server.DEFAULT_MAX_WAITING,
                   help="requests without a first token before new ones get RESOURCE_EXHAUSTED")
    p.add_argument("--grace-period", type=float, default=server.DEFAULT_GRACE_PERIOD_S,
                   help="seconds in-flight calls get to finish on SIGTERM")
    p.add_argument("--max-message-bytes", type=int, default=server.DEFAULT_MAX_MESSAGE_BYTES,
                   help="largest request: a gRPC message, an HTTP body")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain (with --tls-key: gRPC over TLS; HTTP "
                                                    "stays plain)")
    p.add_argument("--tls-key", default=None, help="PEM private key")
    p.add_argument("--scheduling-policy", choices=server.SCHEDULING_POLICIES, default="fcfs",
                   help="priority: requests' priority field orders the queue (fcfs refuses a nonzero priority)")
    p.add_argument("--no-reflection", action="store_true", help="turn the gRPC reflection service off")
    for name in ENGINE_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help="engine knob (overrides --config)")
    p.add_argument("--no-precompile", action="store_true", help="compile step graphs on first use")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engines behind the server, each with its own weights, KV cache and scheduler on its own "
                        "--tensor-parallel-size devices; a request goes to the least-loaded one")
    p.add_argument("--coordinator-address", default=None,
                   help="multi-host: HOST:PORT of process 0, which serves (env JAXSERVE_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int, default=None,
                   help="multi-host: processes the engine spans (env JAXSERVE_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=None,
                   help="multi-host: this process, 0 to N-1; 0 serves (env JAXSERVE_PROCESS_ID)")
    p.set_defaults(func=cmd_serve)


def add_client_parser(sub) -> None:
    p = sub.add_parser("client", help="stream a reply from a running `jaxserve serve`: PROMPT as a user message "
                                      "through the model's chat template (--raw: a plain completion), over gRPC on "
                                      "--host/--port, or HTTP with --url")
    transport = p.add_mutually_exclusive_group()
    transport.add_argument("--url", default=None,
                           help="the server's OpenAI-compatible HTTP API, http://HOST:PORT (its --port; /v1 "
                                "optional), through the openai package (None: gRPC on --host and --port)")
    transport.add_argument("--tls-ca", default=None, help="gRPC: PEM root certificate: connect with TLS")
    p.add_argument("--host", default=server.DEFAULT_HOST, help="gRPC: the server's address")
    p.add_argument("--port", type=int, default=server.DEFAULT_GRPC_PORT, help="gRPC: the server's --grpc-port")
    p.add_argument("--api-key", default=None, help="the server's --api-key (None: env JAXSERVE_API_KEY)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--raw", action="store_true", help="send PROMPT as a plain completion, no chat template")
    mode.add_argument("--system", default=None, help="system message before PROMPT")
    add_sampling_args(p)
    p.add_argument("prompt", metavar="PROMPT")
    p.set_defaults(func=cmd_client)


def add_bench_parser(sub, with_commands: bool) -> None:
    """The benchmarks package is imported only when `bench` is the command: the product CLI never needs it."""
    bench = sub.add_parser("bench", help="benchmarks (results in benchmarks/results/)")
    if not with_commands:
        return
    from benchmarks import sweep
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)   # sweep.invocation looks for it
    p = bench_sub.add_parser("sweep", help="compile and time the jitted step of every bucket; weigh the bucket ladder",
                             description=sweep.__doc__)
    sweep.add_args(p)
    p.set_defaults(func=sweep.cmd_sweep)


def build_parser(with_bench_commands: bool = False) -> argparse.ArgumentParser:
    parser = Parser(prog="jaxserve", description="LLM serving on JAX/XLA")
    parser.add_argument("--version", action="version", version=jaxserve.__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer prompts (each a user message, through the model's chat "
                                          "template when it has one; --raw: complete the text), streamed on a "
                                          "terminal; a stop at --max-tokens is said on stderr")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--raw", action="store_true", help="plain completion of the prompt text, no chat template")
    gen.add_argument("--json", action="store_true",
                     help='one JSON object per prompt: {"prompt","token_ids","text","finish_reason"} (finish_reason '
                          '"length": stopped at --max-tokens; "stop": the model ended it)')
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat through the model's chat template")
    add_model_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="system message")
    chat.set_defaults(func=cmd_chat, max_tokens=256)
    conv = sub.add_parser("convert", help="save a model's parameters as an orbax checkpoint for fast loading")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--dtype", choices=["f32", "bf16"], default=None)
    conv.add_argument("--quantization", choices=["fp8", "float"], default=None,
                      help="fp8: save the linear layers' weights quantized to float8 e4m3 (default: float)")
    conv.set_defaults(func=cmd_convert)
    add_serve_parser(sub)
    add_client_parser(sub)
    add_bench_parser(sub, with_bench_commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(with_bench_commands=argv[:1] == ["bench"]).parse_args(argv)
    try:
        args.func(args)
    except (ModelLoadError, ValueError) as e:
        print(f"jaxserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def run() -> None:
    """The `jaxserve` command. After a one-shot answer (generate, chat) the process ends at once: tearing down JAX's
    runtime and the interpreter's thousands of modules takes ~1.5 s on a CPU, after the answer is out, and holds
    nothing to keep (output flushed and logs shut down first; the OS frees the rest)."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv[:1] in (["generate"], ["chat"]):
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):   # a closed pipe: nothing left to flush into
                stream.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
