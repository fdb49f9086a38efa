"""The Python batch-generation API, shaped like vLLM's: `LLM(model=...).generate(prompts, params)`."""
from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

from tqdm import tqdm

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.sampling_params import DEFAULT_MAX_TOKENS, RequestOutputKind, SamplingParams, default_max_tokens
from jaxserve.engine.sequence import RequestOutput
from jaxserve.models.loader import DEFAULT_MODEL, LoadedModel, load_model
from jaxserve.sharding import make_mesh


@dataclass(slots=True)
class StreamDelta:
    index: int            # which of the request's n outputs
    text: str             # new text since the last delta
    token_ids: list[int]  # new tokens since the last delta
    finish_reason: str | None


def final_only(params: SamplingParams) -> SamplingParams:
    """params whose request gives one output, when it finishes (a copy: replace would count unset fields as set)."""
    params = copy.copy(params)
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(tokenizer.chat_template)


def apply_chat_template(tokenizer, conversation, add_generation_prompt: bool = True,
                        tools: list[dict] | None = None) -> str:
    """A conversation ([{"role", "content"}, ...]) as the prompt text of the model's chat template; `tools`: the
    functions the template shows the model (OpenAI's tool objects)."""
    if not has_chat_template(tokenizer):
        raise ValueError("messages: this model has no chat template")
    return tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


class LLM:
    """LLM(model=None) loads the embedded SmolLM2; model may also be a GGUF file, a HF checkpoint directory or
    a directory written by `jaxserve convert`. quantization="fp8": the linear layers' weights in FP8 (a
    pre-quantized checkpoint is FP8 by itself). Engine knobs (EngineConfig fields, kv_cache_dtype="fp8" among
    them) pass as keyword arguments; a model loaded here is placed on tensor_parallel_size devices (a LoadedModel
    must already be on them). Sampling fields a request leaves unset take the model's generation config (its
    temperature, top_p, ...; generation_config="vllm": vLLM's defaults)."""

    def __init__(self, model: str | LoadedModel | None = DEFAULT_MODEL, dtype: str | None = None,
                 config: EngineConfig | None = None, quantization: str | None = None, **engine_kwargs):
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_kwargs) - known
        if unknown:
            raise ValueError(f"unknown engine arguments {sorted(unknown)}; known: {sorted(known)}")
        cfg = replace(config or EngineConfig(), **engine_kwargs)
        if isinstance(model, LoadedModel) and quantization not in (None, model.quantization):
            raise ValueError(f"quantization={quantization!r}: the LoadedModel given was loaded with "
                             f"{model.quantization!r}; load it with quantization={quantization!r}")
        loaded = model if isinstance(model, LoadedModel) else load_model(
            model, dtype, make_mesh(cfg.tensor_parallel_size), quantization, cfg.compile_cache_dir)
        self.engine = LLMEngine(loaded, cfg)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Prompts: a string, token ids, or a list of either. Returns one RequestOutput per prompt, in order."""
        prompts = self._as_list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        ids = [self.engine.add_request(p, final_only(sp or self.get_default_sampling_params()))
               for p, sp in zip(prompts, params)]
        return self._run(ids, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate, chat and stream use when given none (vLLM's name): the model's generation config over
        vLLM's defaults; its max_new_tokens, when it has one, bounds the output (else 16 tokens)."""
        return SamplingParams(max_tokens=default_max_tokens(self.engine.sampling_defaults, DEFAULT_MAX_TOKENS))

    def chat(self, messages, sampling_params: SamplingParams | None = None, *, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"}) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, conversation, add_generation_prompt: bool = True) -> str:
        return apply_chat_template(self.engine.tokenizer, conversation, add_generation_prompt)

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield text deltas of one request as they are generated (stop strings held back safely)."""
        rid = self.engine.add_request(prompt, sampling_params or self.get_default_sampling_params())
        sent: dict[int, tuple[int, int]] = {}
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    for c in out.outputs:
                        n_text, n_tok = sent.get(c.index, (0, 0))
                        if len(c.text) > n_text or len(c.token_ids) > n_tok or c.finish_reason:
                            sent[c.index] = (len(c.text), len(c.token_ids))
                            yield StreamDelta(c.index, c.text[n_text:], c.token_ids[n_tok:], c.finish_reason)
                    if out.finished:
                        return
        finally:
            self.engine.abort(rid)

    def _as_list(self, prompts) -> list:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            return [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty string, token-id list, or list of those")
        return list(prompts)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="generating", unit="req", file=sys.stderr,
                  disable=None if use_tqdm else True) as bar:
            while len(done) < len(wanted) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[r] for r in request_ids]
