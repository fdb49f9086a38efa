"""`jaxserve` command line: generate, chat, convert (and serve / client / bench where installed)."""
from __future__ import annotations

import argparse
import json
import sys

from benchmarks import cli as bench_cli
from jaxserve.models.errors import ModelLoadError
from jaxserve.serve import client as serve_client
from jaxserve.serve import server as serve_server
from jaxserve.models.loader import DEFAULT_MODEL


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"embedded model name ({DEFAULT_MODEL}), GGUF file, HF checkpoint or converted directory")
    p.add_argument("--dtype", choices=["f32", "bf16"], default=None, help="default: f32 on CPU, bf16 on GPU")
    p.add_argument("--config", default=None, help="YAML engine config (see configs/)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def sampling_params(args):
    from jaxserve.engine.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def make_llm(args, **engine_kwargs):
    from jaxserve.engine.llm import LLM
    from jaxserve.models.loader import load_run
    loaded, engine = load_run(args.model, args.config, args.dtype)
    return LLM(loaded, config=engine, **engine_kwargs)


def cmd_generate(args) -> None:
    params = sampling_params(args)
    llm = make_llm(args, precompile=False)   # one-shot use: compile only the buckets it needs
    outputs = llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outputs):
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "token_ids": c.token_ids, "text": c.text}), flush=True)
        else:
            print(c.text if len(args.prompts) == 1 else f"### {prompt}\n{c.text}\n", flush=True)


def cmd_chat(args) -> None:
    params = sampling_params(args)
    llm = make_llm(args, precompile=False)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("jaxserve chat — empty line or Ctrl-D to quit", file=sys.stderr)
    for line in sys.stdin:
        if not line.strip():
            break
        messages.append({"role": "user", "content": line.strip()})
        reply = ""
        for delta in llm.stream(llm.apply_chat_template(messages), params):
            reply += delta.text
            print(delta.text, end="", flush=True)
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})


def cmd_convert(args) -> None:
    from jaxserve.models.loader import load_model, save_converted
    dst = save_converted(load_model(args.src, args.dtype), args.dst)
    print(f"saved {args.src} -> {dst}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM serving on JAX/XLA")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts (raw text, no chat template)")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--json", action="store_true", help='one JSON object per prompt: {"prompt","token_ids","text"}')
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
    conv.set_defaults(func=cmd_convert)
    serve_server.add_parser(sub)
    serve_client.add_parser(sub)
    bench_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ModelLoadError, ValueError) as e:
        print(f"jaxserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
