"""EAGLE-3 draft heads (Li et al., 2025), in the published checkpoint layout: one decoder layer that reads the
target's hidden states and proposes the next tokens over a reduced draft vocabulary.

The head's sequence is one entry per target position p: the token after p and the target's features at p (the
hidden states entering three of the target's layers, fused by `fc` from 3 x the target's width). Its layer
normalises the token's embedding and the features apart (`input_layernorm`, `hidden_norm`), attends over their
concatenation (q/k/v read 2 x hidden) at rope position p, and its MLP output plus the features is both the next
entry's features (drafting feeds it back) and, through `norm` and `lm_head`, the logits of the draft vocabulary;
draft id d is target token d + d2t[d].

Checkpoint (safetensors or PyTorch `.bin`, with a Llama `config.json` holding `draft_vocab_size`):
`fc.weight` [H, 3 H_target], `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`,
`lm_head.weight` [draft vocab, H], `d2t` [draft vocab] and `t2d` (unused); `embed_tokens.weight` when the head
has its own, else it shares the target's. The target's layers read: config `eagle_aux_hidden_state_layer_ids`
(top level or under `eagle_config`), else (2, L // 2, L - 3) of its L layers, as vLLM and SGLang take them;
`norm_before_residual: true` (some heads) adds the normalised features to the attention output."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig, model_config_from_hf
from jaxserve.models.errors import ModelLoadError, blamed_on
from jaxserve.models.llama import MLP, Attention, RMSNorm, _linear
from jaxserve.models.loader import LoadedModel, _read_json, build_model, check_finite, resolve_model_path
from jaxserve.models.tensor_file import read_safetensors


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    layer: ModelConfig          # the head's decoder layer (num_layers 1; vocab_size: the target's)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]   # the target layers whose input hidden states are the features
    norm_before_residual: bool = False   # the residual takes the features after hidden_norm (some heads' training)


class Eagle3Layer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, norm_before_residual: bool = False):
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)
        self.norm_before_residual = norm_before_residual

    def __call__(self, embeds, features, positions, kv_layer, paged):
        normed = self.hidden_norm(features)
        x = jnp.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        h, kv_layer = self.self_attn(x, positions, kv_layer, paged)
        x = (normed if self.norm_before_residual else features) + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_layer


class Eagle3Head(nnx.Module):
    def __init__(self, cfg: Eagle3Config, dtype, rngs: nnx.Rngs):
        lc = cfg.layer
        self.fc = _linear(3 * cfg.target_hidden_size, lc.hidden_size, dtype, rngs)
        self.embed_tokens = nnx.Embed(lc.vocab_size, lc.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.midlayer = Eagle3Layer(lc, dtype, rngs, cfg.norm_before_residual)
        self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps, dtype)
        self.lm_head = _linear(lc.hidden_size, cfg.draft_vocab_size, dtype, rngs)
        self.d2t = nnx.Param(jnp.zeros((cfg.draft_vocab_size,), jnp.int32))
        self.aux_layers = cfg.aux_layers

    def features(self, aux: list) -> jax.Array:
        """The target's hidden states entering aux_layers, [T, H_target] each -> the head's features [T, H]."""
        return self.fc(jnp.concatenate(aux, axis=-1).astype(self.fc.kernel.dtype))

    def __call__(self, token_ids, features, positions, kv_layer=None, paged=None):
        """Entries (token ids [T], features [T, H]) at positions [T] -> (the next features [T, H], kv_layer)."""
        return self.midlayer(self.embed_tokens(token_ids), features, positions, kv_layer, paged)

    def propose(self, features) -> jax.Array:
        """Features [N, H] -> the greedy draft, as target token ids [N]."""
        draft = jnp.argmax(self.lm_head(self.norm(features)).astype(jnp.float32), axis=-1)
        return (draft + self.d2t[...][draft]).astype(jnp.int32)


def eagle3_config(hf: dict, target: ModelConfig) -> Eagle3Config:
    """The head's config.json against its target: a ValueError naming what does not fit."""
    layer = model_config_from_hf({**hf, "num_hidden_layers": 1})
    draft_vocab = hf.get("draft_vocab_size") or layer.vocab_size
    if layer.vocab_size != target.vocab_size:
        raise ValueError(f"vocab_size {layer.vocab_size} is not the model's {target.vocab_size}: an EAGLE-3 head "
                         "must be trained for the model it drafts for")
    if not 0 < draft_vocab <= layer.vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {layer.vocab_size}], got {draft_vocab}")
    if hf.get("target_hidden_size", target.hidden_size) != target.hidden_size:
        raise ValueError(f"target_hidden_size {hf['target_hidden_size']} is not the model's hidden size "
                         f"{target.hidden_size}: an EAGLE-3 head must be trained for the model it drafts for")
    n, eagle = target.num_layers, hf.get("eagle_config") or {}
    aux = tuple(hf.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
                or (2, n // 2, n - 3))
    if len(aux) != 3 or not all(isinstance(i, int) and 0 <= i < n for i in aux):
        raise ValueError(f"the target layers whose hidden states the head reads must be 3 of 0..{n - 1}, got "
                         f"{list(aux)} (config eagle_aux_hidden_state_layer_ids, else 2, L // 2, L - 3)")
    return Eagle3Config(layer, draft_vocab, target.hidden_size, aux, bool(hf.get("norm_before_residual", False)))


def head_tensors(path: Path):
    """(name, array, shape, bytes) of the checkpoint's tensors: model.safetensors files, else a PyTorch .bin."""
    if files := sorted(path.glob("*.safetensors")):
        yield from read_safetensors(files)
        return
    if not (bins := sorted(path.glob("*.bin"))):
        raise ModelLoadError(path, "no *.safetensors or *.bin weights found")
    import torch   # the published heads that predate safetensors
    for f in bins:
        for name, t in torch.load(f, map_location="cpu", weights_only=True).items():
            array = t.float().numpy() if t.is_floating_point() else t.numpy()
            yield name, array, tuple(array.shape), array.nbytes


def load_eagle3(path: str | Path, target: LoadedModel) -> LoadedModel:
    """An EAGLE-3 head for `target`, in its dtype on its mesh."""
    path = resolve_model_path(str(path))
    print(f"loading the EAGLE-3 head {path}", file=sys.stderr)
    with blamed_on(path / "config.json"):
        hf = _read_json(path / "config.json")
        cfg = eagle3_config(hf, target.config)
    tensors = {name: (name, w, shape, nbytes) for name, w, shape, nbytes in head_tensors(path) if name != "t2d"}
    shared = "embed_tokens.weight" not in tensors
    embed = target.model.embed_tokens
    if shared:   # placed as a copy, then replaced by the target's own array: one table in memory (a table kept as
        table = embed.embedding[...] if isinstance(embed, nnx.Embed) else embed.dequantized()   # GGUF blocks: a copy)
        tensors["embed_tokens.weight"] = ("embed_tokens.weight", table, table.shape, table.nbytes)
    if "d2t" not in tensors:   # the full vocabulary: draft id = token id
        tensors["d2t"] = ("d2t", np.zeros(cfg.draft_vocab_size, np.int32), (cfg.draft_vocab_size,), 0)
    dtype = target.dtype
    abstract = nnx.eval_shape(lambda: Eagle3Head(cfg, dtype, nnx.Rngs(0)))
    head, _ = build_model(cfg.layer, dtype, tensors.values(), path, target.mesh, abstract=abstract)
    check_finite(head, path)
    if shared and isinstance(embed, nnx.Embed):
        head.embed_tokens.embedding.set_value(embed.embedding[...])
    d2t = np.asarray(head.d2t[...])
    if (ids := np.arange(len(d2t)) + d2t).min() < 0 or ids.max() >= target.config.vocab_size:
        raise ModelLoadError(path, f"d2t maps draft ids outside the model's vocabulary of {target.config.vocab_size}")
    return LoadedModel(cfg.layer, head, None, str(path))


def save_random_eagle3(path: str | Path, target: ModelConfig, *, hidden_size: int | None = None,
                       num_heads: int | None = None, num_kv_heads: int | None = None,
                       intermediate_size: int | None = None, draft_vocab_size: int | None = None,
                       aux_layers: tuple[int, ...] | None = None, with_embeddings: bool = False, seed: int = 0,
                       std: float = 0.02) -> Path:
    """A random head for `target` in the published layout (config.json + model.safetensors), of the target's
    widths unless given: benchmarks and tests (no trained head can be downloaded here)."""
    from safetensors.numpy import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    h, heads = hidden_size or target.hidden_size, num_heads or target.num_heads
    kv, inter = num_kv_heads or target.num_kv_heads, intermediate_size or target.intermediate_size
    d, vd = h // heads, draft_vocab_size or target.vocab_size
    rng = np.random.default_rng(seed)
    rand = lambda *shape: (rng.standard_normal(shape) * std).astype(np.float32)
    tensors = {"fc.weight": rand(h, 3 * target.hidden_size), "norm.weight": np.ones(h, np.float32),
               "lm_head.weight": rand(vd, h),
               "d2t": (np.sort(rng.choice(target.vocab_size, vd, replace=False)) - np.arange(vd)).astype(np.int64),
               "t2d": np.zeros(target.vocab_size, np.bool_)}
    tensors["t2d"][np.arange(vd) + tensors["d2t"]] = True
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"midlayer.{norm}.weight"] = np.ones(h, np.float32)
    for name, shape in (("q_proj", (heads * d, 2 * h)), ("k_proj", (kv * d, 2 * h)), ("v_proj", (kv * d, 2 * h)),
                        ("o_proj", (h, heads * d))):
        tensors[f"midlayer.self_attn.{name}.weight"] = rand(*shape)
    for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
        tensors[f"midlayer.mlp.{name}.weight"] = rand(*shape)
    if with_embeddings:
        tensors["embed_tokens.weight"] = rand(target.vocab_size, h)
    save_file(tensors, str(path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter,
              "num_hidden_layers": 1, "vocab_size": target.vocab_size, "draft_vocab_size": vd,
              "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
              "max_position_embeddings": target.max_position_embeddings, "tie_word_embeddings": False,
              "target_hidden_size": target.hidden_size}
    if target.rope_scaling:
        config["rope_scaling"] = target.rope_scaling
    if aux_layers is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path
