"""An EAGLE-3 draft head in PyTorch, written from the published equations, as a test reference.

Independent of eagle3_jax: it reads the released checkpoint's tensor names and PyTorch
``[out, in]`` layouts (``../shared/EAGLE3_REFERENCE.md`` §2, §6) and implements the layer from
the paper and the reference's description, not from our code:

    g0 = fc(concat(low, mid, high))                      (EAGLE-3.1: each tap RMS-normed first)
    x  = concat(input_layernorm(embed(token)), hidden_norm(g))              width 2D
    q, k, v = q_proj(x), k_proj(x), v_proj(x); RoPE (rotate-half) on q, k; GQA causal attention
    h  = r + o_proj(attn)      r = g, or hidden_norm(g) when norm_before_residual (speculators)
    h  = h + down(silu(gate(post_attention_layernorm(h))) * up(...))
    logits = lm_head(norm(h)) over the draft vocabulary
    next g = h, or norm(h) with norm_output (EAGLE-3.1)

RoPE frequencies follow the HF Llama definition (theta, optional llama3 / linear scaling).
"""

from __future__ import annotations

import math
from typing import Mapping

import torch


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _inv_freq(head_dim: int, theta: float, scaling: Mapping | None) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":  # Llama 3.1: long wavelengths slowed by `factor`, a smooth ramp between
        factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        middle = (wavelen <= old / low) & (wavelen >= old / high)
        return torch.where(middle, (1 - smooth) * inv / factor + smooth * inv, scaled)
    assert kind == "default", kind
    return inv


def _rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, H] rotated at positions [B, T] (rotate-half)."""
    angles = positions.to(torch.float64)[..., None] * inv_freq  # [B, T, H/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, :, None].to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, :, None].to(x.dtype)
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated_half * sin


class Eagle3Reference:
    """The draft head over a released checkpoint's tensors and ``config.json`` dict, in the
    flat layouts (SGLang / SpecForge, the reference: ``midlayer.*``; SpecForge's
    ``norm_output`` is the final norm, true in a standard head) or vLLM's speculators layout
    (``layers.0.*``, the Llama fields under ``transformer_layer_config``; ``norm_output`` there
    feeds the normed output back). EAGLE-3.1 tap norms are ``fc_norm.{0,1,2}.weight``."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], config: Mapping):
        self.w = {k.replace("layers.0.", "midlayer."): v.to(torch.float64)
                  for k, v in tensors.items()}
        speculators = "transformer_layer_config" in config
        c = {**config, **config.get("transformer_layer_config", {})}
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads") or self.heads
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.inv_freq = _inv_freq(self.head_dim, c.get("rope_theta") or 10000.0,
                                  c.get("rope_scaling"))
        self.fc_norm = bool(c.get("fc_norm", False))
        self.norm_output = speculators and bool(c.get("norm_output", False))
        self.norm_before_residual = bool(c.get("norm_before_residual", False))
        self.keys: list[torch.Tensor] = []  # per step: [B, T_i, K, H]
        self.values: list[torch.Tensor] = []

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [B, T, 3D] -> g [B, T, D]."""
        taps = taps.to(torch.float64)
        if self.fc_norm:
            b, t, _ = taps.shape
            per = taps.reshape(b, t, 3, -1)
            per = torch.stack([_rms(per[:, :, j], self.w[f"fc_norm.{j}.weight"], self.eps)
                               for j in range(3)], 2)
            taps = per.reshape(b, t, -1)
        return taps @ self.w["fc.weight"].T

    def step(self, embeds: torch.Tensor, g: torch.Tensor, positions: torch.Tensor):
        """T new tokens after everything earlier steps saw (causal over all of it).

        Returns (logits over the draft vocabulary [B, T, Vd], next feature [B, T, D])."""
        w, m = self.w, "midlayer."
        embeds, g = embeds.to(torch.float64), g.to(torch.float64)
        b, t, _ = g.shape
        normed_g = _rms(g, w[m + "hidden_norm.weight"], self.eps)
        x = torch.cat([_rms(embeds, w[m + "input_layernorm.weight"], self.eps), normed_g], -1)
        q = (x @ w[m + "self_attn.q_proj.weight"].T).reshape(b, t, self.heads, self.head_dim)
        k = (x @ w[m + "self_attn.k_proj.weight"].T).reshape(b, t, self.kv_heads, self.head_dim)
        v = (x @ w[m + "self_attn.v_proj.weight"].T).reshape(b, t, self.kv_heads, self.head_dim)
        q, k = _rotate(q, positions, self.inv_freq), _rotate(k, positions, self.inv_freq)
        self.keys.append(k)
        self.values.append(v)
        keys, values = torch.cat(self.keys, 1), torch.cat(self.values, 1)  # [B, S, K, H]
        s = keys.shape[1]
        group = self.heads // self.kv_heads
        keys = keys.repeat_interleave(group, dim=2)
        values = values.repeat_interleave(group, dim=2)
        scores = torch.einsum("bthd,bshd->bhts", q, keys) / math.sqrt(self.head_dim)
        visible = torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None]  # causal
        scores = scores.masked_fill(~visible, float("-inf"))
        attn = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), values).reshape(b, t, -1)
        residual = normed_g if self.norm_before_residual else g
        h = residual + attn @ w[m + "self_attn.o_proj.weight"].T
        y = _rms(h, w[m + "post_attention_layernorm.weight"], self.eps)
        mlp = torch.nn.functional.silu(y @ w[m + "mlp.gate_proj.weight"].T) * (
            y @ w[m + "mlp.up_proj.weight"].T)
        h = h + mlp @ w[m + "mlp.down_proj.weight"].T
        normed = _rms(h, w["norm.weight"], self.eps)
        logits = normed @ w["lm_head.weight"].T
        return logits, (normed if self.norm_output else h)


def ttt_loss(head: Eagle3Reference, embed: torch.Tensor, tokens: torch.Tensor,
             taps: torch.Tensor, target_logp: torch.Tensor, target_in_draft: torch.Tensor,
             loss_mask: torch.Tensor, segment_ids: torch.Tensor, positions: torch.Tensor,
             steps: int, mask_offset: int = 2, decay: float = 0.8) -> torch.Tensor:
    """Training-time test (EAGLE-3 §4) from its definition, over one packed batch [B, T].

    At step i the query at index t reads token x_{t+1+i} at position t + i with the feature
    fc(f_t) (i = 0) or its own step i-1 output at t, and attends to the step-0 keys of indices
    s <= t of its document plus its own keys of steps 1..i (a depth-i tree node's context and
    ancestors). It is scored against the target's distribution at t+1+i (the prediction of
    x_{t+2+i}), weighed by the loss mask at t + mask_offset + i (2: the predicted token; 0: the
    reference code's reading), the target's top token being in the draft vocabulary, and both
    indices in t's document. Loss = sum_i decay**i * (weighted mean cross-entropy at step i).
    """
    w, m = head.w, "midlayer."
    b, t = tokens.shape
    eps = head.eps

    def shifted(x, by, fill):
        out = torch.full_like(x, fill)
        if by < t:
            out[:, : t - by] = x[:, by:]
        return out

    g = head.fuse(taps)
    seg = segment_ids
    idx = torch.arange(t)
    causal = (idx[None, :, None] >= idx[None, None, :]) & (seg[:, :, None] == seg[:, None, :])
    causal &= (seg > 0)[:, :, None]  # [B, T, S]
    group = head.heads // head.kv_heads
    keys0 = values0 = None
    diag_k, diag_v = [], []
    total = torch.zeros((), dtype=torch.float64)
    for i in range(steps):
        e = embed[shifted(tokens, i + 1, 0)].to(torch.float64)
        normed_g = _rms(g, w[m + "hidden_norm.weight"], eps)
        x = torch.cat([_rms(e, w[m + "input_layernorm.weight"], eps), normed_g], -1)
        q = (x @ w[m + "self_attn.q_proj.weight"].T).reshape(b, t, head.heads, head.head_dim)
        k = (x @ w[m + "self_attn.k_proj.weight"].T).reshape(b, t, head.kv_heads, head.head_dim)
        v = (x @ w[m + "self_attn.v_proj.weight"].T).reshape(b, t, head.kv_heads, head.head_dim)
        q = _rotate(q, positions + i, head.inv_freq)
        k = _rotate(k, positions + i, head.inv_freq)
        if i == 0:
            keys0, values0 = k, v
        else:
            diag_k.append(k)
            diag_v.append(v)
        kc = keys0.repeat_interleave(group, 2)
        vc = values0.repeat_interleave(group, 2)
        scores = torch.einsum("bthd,bshd->bhts", q, kc) / math.sqrt(head.head_dim)
        scores = scores.masked_fill(~causal[:, None], -1e30)
        parts = [scores]
        for dk in diag_k:  # its own keys of steps 1..i, at its own index
            parts.append(torch.einsum("bthd,bthd->bht", q, dk.repeat_interleave(group, 2))[
                ..., None] / math.sqrt(head.head_dim))
        probs = torch.cat(parts, -1).softmax(-1)
        attn = torch.einsum("bhts,bshd->bthd", probs[..., :t], vc)
        for j, dv in enumerate(diag_v):
            attn = attn + probs[..., t + j].permute(0, 2, 1)[..., None] * dv.repeat_interleave(
                group, 2)
        residual = normed_g if head.norm_before_residual else g
        h = residual + attn.reshape(b, t, -1) @ w[m + "self_attn.o_proj.weight"].T
        y = _rms(h, w[m + "post_attention_layernorm.weight"], eps)
        h = h + (torch.nn.functional.silu(y @ w[m + "mlp.gate_proj.weight"].T)
                 * (y @ w[m + "mlp.up_proj.weight"].T)) @ w[m + "mlp.down_proj.weight"].T
        normed = _rms(h, w["norm.weight"], eps)
        logq = (normed @ w["lm_head.weight"].T).log_softmax(-1)
        label = shifted(target_logp.to(torch.float64), i + 1, 0.0).exp()
        later = i + max(1, mask_offset)
        weight = (shifted(loss_mask, i + mask_offset, False)
                  & shifted(target_in_draft, i + 1, False)
                  & (shifted(seg, later, 0) == seg) & (seg > 0)).to(torch.float64)
        per_pos = -(label * logq).sum(-1)
        total = total + decay ** i * (per_pos * weight).sum() / weight.sum().clamp(min=1.0)
        g = normed if head.norm_output else h
    return total
