"""A small modern GPT: fused QKV, grouped-query attention, RoPE, RMSNorm, SwiGLU, QK-norm, tied embeddings,
attention through ``scaled_dot_product_attention`` (flash / memory-efficient kernels on GPUs), optional
activation checkpointing per block, and an initialisation scaled for depth."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int = 256           # byte-level tokens by default
    block_size: int = 128           # longest context the model sees
    n_layer: int = 4                # transformer blocks
    n_head: int = 4                 # query heads
    n_kv_head: int = 2              # key/value heads (grouped-query attention; n_head must be a multiple)
    n_embd: int = 128               # residual width
    mlp_ratio: float = 8 / 3        # SwiGLU hidden width / n_embd (8/3 keeps the params of a 4x GELU MLP)
    rope_base: float = 10000.0      # RoPE frequency base
    qk_norm: bool = True            # RMSNorm on queries and keys per head
    grad_checkpointing: bool = False  # recompute each block in backward instead of storing activations

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError("the head size n_embd / n_head must be even for RoPE")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(head_dim: int, length: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x1, x2) of each head by position-dependent angles; x: (B, H, T, D)."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.n_kv_head) * self.head_dim, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.q_norm = RMSNorm(self.head_dim) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim) if cfg.qk_norm else nn.Identity()

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split([self.n_head * self.head_dim, self.n_kv_head * self.head_dim,
                                     self.n_kv_head * self.head_dim], dim=-1)
        q = self.q_norm(q.view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = int(cfg.mlp_ratio * cfg.n_embd)
        self.gate_up = nn.Linear(cfg.n_embd, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1, self.attn = RMSNorm(cfg.n_embd), Attention(cfg)
        self.norm2, self.mlp = RMSNorm(cfg.n_embd), SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied input/output embeddings
        cos, sin = rope_tables(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    def _init_weights(self):
        """Normal(0, 0.02); the projections that write into the residual stream scaled by 1/sqrt(2 n_layer)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.down):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * self.cfg.n_layer))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights count once

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if idx.shape[1] > self.cfg.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds block_size {self.cfg.block_size}")
        x = self.embed(idx)
        for block in self.blocks:
            if self.cfg.grad_checkpointing and self.training:
                x = checkpoint(block, x, self.rope_cos, self.rope_sin, use_reentrant=False)
            else:
                x = block(x, self.rope_cos, self.rope_sin)
        logits = self.head(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8, top_k: int | None = 40,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        for _ in range(new_tokens):
            logits, _ = self(idx[:, -self.cfg.block_size:])
            logits = logits[:, -1, :].float() / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            idx = torch.cat([idx, torch.multinomial(logits.softmax(-1), 1, generator=generator)], dim=1)
        return idx
