"""Protobuf <-> engine: requests into prompts and SamplingParams, RequestOutputs into responses, and the
Tokenize / Detokenize / ModelInfo answers."""
from __future__ import annotations

import jax

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.sequence import CompletionOutput, RequestOutput
from jaxserve.serve import jaxserve_pb2 as pb


def sampling_params(options: pb.SamplingOptions) -> SamplingParams:
    """Set fields only; the rest take SamplingParams' defaults. SamplingParams validates (ValueError)."""
    kwargs = {f.name: v if isinstance(v, (bool, int, float, str)) else list(v) for f, v in options.ListFields()}
    return SamplingParams(**kwargs)


def request_prompt(request: pb.GenerateRequest, engine: LLMEngine) -> str | list[int]:
    """The prompt; token ids are counted before they are converted (a 16 MiB message holds millions)."""
    if request.prompt and request.prompt_token_ids:
        raise ValueError("prompt and prompt_token_ids: give one, not both")
    if not request.prompt_token_ids:
        return request.prompt
    engine.check_prompt_length(len(request.prompt_token_ids))
    return list(request.prompt_token_ids)


def token_logprobs(token: int, logprobs: dict[int, float]) -> pb.TokenLogprobs:
    top = [pb.TopLogprob(token_id=t, logprob=lp) for t, lp in logprobs.items()]
    return pb.TokenLogprobs(token_id=token, logprob=logprobs[token], top=top)


def completion_chunk(c: CompletionOutput, text_from: int = 0, tokens_from: int = 0) -> pb.CompletionChunk:
    ids = c.token_ids[tokens_from:]
    chunk = pb.CompletionChunk(index=c.index, text=c.text[text_from:], token_ids=ids,
                               finish_reason=c.finish_reason or "")
    if c.logprobs is not None:   # the engine's list keeps growing: cut it at this output's length
        chunk.logprobs.extend(map(token_logprobs, ids, c.logprobs[tokens_from:len(c.token_ids)]))
    if isinstance(c.stop_reason, str):
        chunk.stop_str = c.stop_reason
    elif isinstance(c.stop_reason, int):
        chunk.stop_token_id = c.stop_reason
    return chunk


def usage(out: RequestOutput) -> pb.Usage:
    return pb.Usage(prompt_tokens=len(out.prompt_token_ids),
                    completion_tokens=sum(len(c.token_ids) for c in out.outputs))


def delta_response(out: RequestOutput, sent: dict[int, tuple[int, int, bool]]) -> pb.GenerateResponse:
    """What changed since `sent` (index -> chars, tokens, finished already sent), which it updates."""
    response = pb.GenerateResponse(request_id=out.request_id, finished=out.finished)
    for c in out.outputs:
        chars, tokens, done = sent.get(c.index, (0, 0, False))
        if len(c.text) > chars or len(c.token_ids) > tokens or (c.finish_reason is not None and not done):
            response.outputs.append(completion_chunk(c, chars, tokens))
            sent[c.index] = (len(c.text), len(c.token_ids), c.finish_reason is not None)
    if out.finished:
        response.usage.CopyFrom(usage(out))
        response.prompt_logprobs.extend(prompt_logprobs(out))
    return response


def full_response(out: RequestOutput) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=out.request_id, finished=out.finished,
                               outputs=[completion_chunk(c) for c in out.outputs], usage=usage(out),
                               prompt_logprobs=prompt_logprobs(out))


def prompt_logprobs(out: RequestOutput) -> list[pb.TokenLogprobs]:
    """Prompt tokens from the second on (the first has no context), each with its top-k."""
    if out.prompt_logprobs is None:
        return []
    return [token_logprobs(t, lp) for t, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]


def detokenize(engine: LLMEngine, ids, skip_special_tokens: bool) -> str:
    """ids: a sequence (a protobuf repeated field), counted before it is converted."""
    vocab = engine.loaded.config.vocab_size
    if engine.tokenizer is None:
        raise ValueError("token_ids: this model has no tokenizer")
    if len(ids) > engine.cfg.max_model_len:   # no sequence is longer: more is work on the shared tokenizer thread
        raise ValueError(f"token_ids: at most max_model_len={engine.cfg.max_model_len} ids, got {len(ids):,}")
    if any(not 0 <= t < vocab for t in ids):
        raise ValueError(f"token_ids must be in [0, {vocab})")
    return engine.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def model_info(engine: LLMEngine, model_name: str) -> pb.ModelInfoResponse:
    mc, cfg = engine.loaded.config, engine.cfg
    return pb.ModelInfoResponse(
        model=model_name, arch=mc.arch, dtype=str(engine.loaded.model.embed_tokens.embedding[...].dtype),
        device=jax.devices()[0].device_kind, vocab_size=mc.vocab_size, max_model_len=cfg.max_model_len,
        num_layers=mc.num_layers, hidden_size=mc.hidden_size, num_heads=mc.num_heads,
        num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, eos_token_ids=engine.eos_token_ids,
        has_tokenizer=engine.tokenizer is not None, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens)
