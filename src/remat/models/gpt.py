"""A small GPT (decoder-only transformer), with attention written out so its memory is realistic.

Attention is computed explicitly (``q @ k^T``, causal mask, softmax, dropout, ``@ v``) rather than
with ``F.scaled_dot_product_attention``: the ``[B, heads, T, T]`` score tensors are then saved for
backward as in a textbook transformer, so checkpointing the attention has a measurable payoff and
the memory and results do not depend on which fused kernel a backend picks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import RematError
from remat.models import Workload, _check_positive, _place, _seeded

__all__ = ["GPT", "Block", "CausalSelfAttention", "MLP", "gpt", "gpt_workload"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention.

    Args:
        d_model: Width of the residual stream (channels).
        n_heads: Number of heads; must divide ``d_model``.
        seq_len: Longest sequence the causal mask covers (tokens).
        dropout: Dropout probability on the attention weights and on the output.
    """

    mask: torch.Tensor

    def __init__(self, d_model: int, n_heads: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        # Not persistent: derived from seq_len, so it stays out of the state_dict.
        causal = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
        self.register_buffer("mask", causal.view(1, 1, seq_len, seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attends each position to itself and the positions before it.

        Args:
            x: Input of shape ``[B, T, d_model]``.

        Returns:
            Output of shape ``[B, T, d_model]``.
        """
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)  # [B, h, T, hd]
        k = k.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        v = v.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # [B, h, T, T]
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """The transformer's feed-forward layer: Linear, GELU, Linear, Dropout.

    Args:
        d_model: Width of the residual stream (channels).
        hidden: Width of the hidden layer (channels).
        dropout: Dropout probability on the output.
    """

    def __init__(self, d_model: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the layer position-wise.

        Args:
            x: Input of shape ``[B, T, d_model]``.

        Returns:
            Output of shape ``[B, T, d_model]``.
        """
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.

    Args:
        d_model: Width of the residual stream (channels).
        n_heads: Number of attention heads.
        seq_len: Longest sequence (tokens).
        mlp_ratio: Hidden width of the MLP as a multiple of ``d_model``.
        dropout: Dropout probability.
    """

    def __init__(self, d_model: int, n_heads: int, seq_len: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, seq_len, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, mlp_ratio * d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Runs the block.

        Args:
            x: Input of shape ``[B, T, d_model]``.

        Returns:
            Output of shape ``[B, T, d_model]``.
        """
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer language model (build it with :func:`gpt`).

    Args:
        vocab_size: Number of token ids.
        d_model: Width of the residual stream (channels).
        n_heads: Number of attention heads; must divide ``d_model``.
        n_layers: Number of :class:`Block` s.
        seq_len: Longest sequence (tokens).
        mlp_ratio: Hidden width of each MLP as a multiple of ``d_model``.
        dropout: Dropout probability (embeddings, attention weights, residual branches).
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_heads: int,
        n_layers: int,
        seq_len: int,
        mlp_ratio: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, seq_len, mlp_ratio, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        self.apply(_init_weights)
        # GPT-2's scaling keeps the residual stream's variance flat as blocks are added.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Predicts the next token at every position.

        Args:
            idx: Token ids, a LongTensor of shape ``[B, T]`` with ``T <= seq_len``.

        Returns:
            Logits of shape ``[B, T, vocab_size]``.

        Raises:
            RematError: If ``T`` exceeds ``seq_len``.
        """
        t = idx.size(1)
        if t > self.seq_len:
            raise RematError(
                f"gpt: input has {t} tokens but the model was built for seq_len {self.seq_len}; "
                f"pass at most {self.seq_len} tokens or build it with a larger seq_len."
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def gpt(
    *,
    vocab_size: int,
    d_model: int,
    n_heads: int,
    n_layers: int,
    seq_len: int,
    mlp_ratio: int = 4,
    dropout: float = 0.1,
) -> GPT:
    """Builds a GPT with freshly initialised weights (from the current CPU generator), on the CPU.

    Args:
        vocab_size: Number of token ids.
        d_model: Width of the residual stream (channels).
        n_heads: Number of attention heads; must divide ``d_model``.
        n_layers: Number of transformer blocks.
        seq_len: Longest sequence (tokens).
        mlp_ratio: Hidden width of each MLP as a multiple of ``d_model``.
        dropout: Dropout probability, in ``[0, 1)``.

    Returns:
        The model, in training mode.

    Raises:
        RematError: If a size is not a positive int, ``n_heads`` does not divide ``d_model``, or
            ``dropout`` is outside ``[0, 1)``.
    """
    _check_positive(
        "gpt",
        vocab_size=vocab_size,
        d_model=d_model,
        n_heads=n_heads,
        n_layers=n_layers,
        seq_len=seq_len,
        mlp_ratio=mlp_ratio,
    )
    if d_model % n_heads:
        raise RematError(
            f"gpt: n_heads {n_heads} does not divide d_model {d_model}; pick d_model as a multiple of n_heads."
        )
    if not 0.0 <= dropout < 1.0:
        raise RematError(f"gpt: dropout must be in [0, 1), got {dropout!r}; pass e.g. dropout=0.1.")
    return GPT(vocab_size, d_model, n_heads, n_layers, seq_len, mlp_ratio, dropout)


def gpt_workload(
    *,
    n_layers: int = 8,
    d_model: int = 128,
    n_heads: int = 4,
    seq_len: int = 128,
    batch: int = 4,
    vocab_size: int = 512,
    dropout: float = 0.1,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Workload:
    """A GPT on a batch of random token ids, with cross entropy against random next tokens.

    Args:
        n_layers: Number of transformer blocks.
        d_model: Width of the residual stream (channels).
        n_heads: Number of attention heads; must divide ``d_model``.
        seq_len: Sequence length of the batch and of the model (tokens).
        batch: Number of sequences in the batch.
        vocab_size: Number of token ids.
        dropout: Dropout probability, in ``[0, 1)``.
        seed: Seed of the weights, the batch and the targets (see NOTE [ Model seeding ]).
        device: Device of the model and the batch.
        dtype: Floating-point dtype of the parameters.

    Returns:
        The workload; ``inputs`` is a LongTensor of shape ``[batch, seq_len]`` and the model's
        output is ``[batch, seq_len, vocab_size]`` logits.

    Raises:
        RematError: If a size is invalid (see :func:`gpt`) or ``dtype`` is not floating point.
    """
    _check_positive("gpt", batch=batch)
    with _seeded(seed):
        model = gpt(
            vocab_size=vocab_size,
            d_model=d_model,
            n_heads=n_heads,
            n_layers=n_layers,
            seq_len=seq_len,
            dropout=dropout,
        )
        idx = torch.randint(vocab_size, (batch, seq_len))
        targets = torch.randint(vocab_size, (batch, seq_len))
    _place(model, "gpt", device, dtype)
    idx, targets = idx.to(device), targets.to(device)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    return Workload(
        name="gpt",
        model=model,
        inputs=idx,
        loss_fn=loss_fn,
        description=f"GPT {n_layers}x(d={d_model}, h={n_heads}), batch {batch}x{seq_len} tokens, vocab {vocab_size}",
    )
