"""The decoder stack of Llama-family checkpoints as one plain function over their own weights.

On the CPU a decode step of a small model is mostly framework time: transformers' forward
goes through about a dozen Python wrappers per layer (output capture, kwargs checks, module
hooks) and writes RoPE as seven elementwise ops per tensor. This runs the same arithmetic,
op for op, straight from the modules' parameters:

    x = embed(ids)
    per layer:  h = rmsnorm(x);  q, k, v = h Wq, h Wk, h Wv (+ biases; Qwen3: q, k RMSNorm per head)
                q, k = rope(q), rope(k);  x += attend(q, K/V pages) Wo
                h = rmsnorm(x);  x += (silu(h Wg) * h Wu) Wd
    logits = rmsnorm(x[rows that sample]) W_lm

with the engine's paged attention (read_pages, attend) where transformers would call the
registered attention function. cos and sin come from the model's own `rotary_emb` module, so
every RoPE scaling transformers knows is kept. RMSNorm in float32 is the C helper
(csrc/rms_norm.c, with the residual add before it: one call instead of about eleven tensor
ops; its sum of squares in double may move the last bit) or, without a C compiler,
`F.rms_norm` (the same result as transformers' pow-mean-rsqrt sequence); other dtypes take
transformers' own sequence.

Only the decoder classes in LAYERS, whose forward is exactly the above, run here; any other
model (or `EngineConfig.lean_forward=False`) runs through transformers' forward. Checked
against those classes' own forward (tests/engine/test_lean_forward.py: logits and greedy
outputs through both paths) on transformers 5.24.0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pdtb.engine.paged_attention import StepMetadata, attend, read_pages

# decoder layer class -> its RMSNorm class (weight * x / rms(x); Gemma's (1 + weight) is not one)
LAYERS = {"LlamaDecoderLayer": "LlamaRMSNorm", "MistralDecoderLayer": "MistralRMSNorm",
          "Qwen2DecoderLayer": "Qwen2RMSNorm", "Qwen3DecoderLayer": "Qwen3RMSNorm"}


def unsupported(model) -> str | None:
    """Why `model` cannot run here (None: it can)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "embed_tokens") or not hasattr(inner, "rotary_emb"):
        return f"{type(model).__name__} is not a decoder stack of the Llama family"
    if getattr(model.config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(model.config, 'hidden_act', None)!r} (silu only)"
    norm = LAYERS.get(type(layers[0]).__name__) if len(layers) else None
    if norm is None or any(type(layer).__name__ != type(layers[0]).__name__ for layer in layers):
        return f"decoder layers {type(layers[0]).__name__ if len(layers) else 'none'} (only {', '.join(LAYERS)})"
    norms = [inner.norm] + [m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(type(m).__name__ != norm for m in norms):
        return f"norm modules other than {norm}"
    return None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class LeanForward:
    """`model`'s forward over the paged pool: `(ids [1, T], positions [1, T], metadata,
    rows) -> logits [len(rows), vocab]` (rows: a tensor of flat rows, or 0 for every row)."""

    def __init__(self, model, norm=None) -> None:
        why = unsupported(model)
        if why:
            raise ValueError(f"lean forward: {why}")
        inner, cfg = model.model, model.config
        self.embed, self.rotary = inner.embed_tokens.weight, inner.rotary_emb
        self.norm = norm  # cpu_kernel.RmsNorm (float32): a norm and the residual add before it in one call
        self.final = (inner.norm.weight, inner.norm.variance_epsilon)
        self.lm_head = (model.lm_head.weight, model.lm_head.bias)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            qk_norm = (a.q_norm.weight, a.q_norm.variance_epsilon, a.k_norm.weight, a.k_norm.variance_epsilon) \
                if hasattr(a, "q_norm") else None
            self.layers.append((
                (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                *((p.weight, p.bias) for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj)), a.scaling, qk_norm,
                (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                *((p.weight, p.bias) for p in (m.gate_proj, m.up_proj, m.down_proj))))

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata, rows) -> torch.Tensor:
        hd, half = self.head_dim, self.head_dim // 2
        x = F.embedding(ids[0], self.embed)  # [T, hidden]
        n = x.shape[0]
        cos, sin = self.rotary(x[None], positions)  # [1, T, head_dim] each
        if cos.shape[-1] != hd:
            raise ValueError(f"lean forward: rotary size {cos.shape[-1]} against head size {hd}")
        cos = cos[0, :, None, :].to(x.dtype)
        # rotate_half(t) * sin == roll(t, half) * (sin with its first half negated): the products
        # are the same floats, so q and k match transformers' apply_rotary_pos_emb bit for bit
        sin = sin[0, :, None, :].to(x.dtype)
        sin = torch.cat((-sin[..., :half], sin[..., half:]), -1)
        mlp = None  # the last layer's MLP output, added to the residual stream with the next norm
        for i, (n1, q_p, k_p, v_p, o_p, scale, qk_norm, n2, g_p, u_p, d_p) in enumerate(self.layers):
            x, h = self._add_rms(x, mlp, n1)
            q = F.linear(h, *q_p).view(n, -1, hd)
            k = F.linear(h, *k_p).view(n, -1, hd)
            v = F.linear(h, *v_p).view(n, -1, hd)
            if qk_norm is not None:
                q, k = _rms(q, *qk_norm[:2]), _rms(k, *qk_norm[2:])
            q = (q * cos).add_(q.roll(half, -1).mul_(sin))
            k = (k * cos).add_(k.roll(half, -1).mul_(sin))
            meta.layers_run.append(i)
            kv = read_pages(meta, i, k.transpose(0, 1)[None], v.transpose(0, 1)[None])
            o = F.linear(attend(meta, q, kv, scale).reshape(n, -1), *o_p)
            x, h = self._add_rms(x, o, n2)
            mlp = F.linear(F.silu(F.linear(h, *g_p)).mul_(F.linear(h, *u_p)), *d_p)
        if not isinstance(rows, int):
            x, mlp = x[rows], mlp[rows]
        return F.linear(self._add_rms(x, mlp, self.final)[1], *self.lm_head)

    def _add_rms(self, x: torch.Tensor, add: torch.Tensor | None, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + add, rms_norm(x + add)); x is this forward's own tensor, updated in place."""
        if self.norm is not None and x.dtype == torch.float32:
            return x, self.norm(x, *norm, add=add)
        if add is not None:
            x = x + add
        return x, _rms(x, *norm)
