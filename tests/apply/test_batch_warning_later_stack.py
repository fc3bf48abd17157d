"""A larger batch that only a later, kept stack sees (NOTE [ Batches larger than the profiled one ] in
remat/core/runtime.py): an encoder-decoder planned on short targets and trained on longer ones with the same
sources grows only in its decoder. Only block 0 was checked where kept, so such steps peaked at 1.44-2.93x the
budget on a T5 from config without a warning (helper-127); the first block taking inputs of a size no earlier
block took is now checked too."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

import remat


class _Enc(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class _Dec(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, y: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        y = y + torch.softmax(y @ memory.transpose(1, 2), -1) @ memory  # cross-attention, no weights
        return y + self.fc2(torch.tanh(self.fc1(y)))


class _Seq2Seq(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.src, self.tgt, self.head = nn.Linear(8, 32), nn.Linear(8, 32), nn.Linear(32, 4)
        self.encoder = nn.ModuleList(_Enc() for _ in range(n))
        self.decoder = nn.ModuleList(_Dec() for _ in range(n))

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.src(source)
        for layer in self.encoder:
            x = layer(x)
        y = self.tgt(target)
        for layer in self.decoder:
            y = layer(y, x)
        return self.head(y)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out**2).mean()


def _batch(tgt: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(tgt)
    return torch.randn(4, 32, 8, generator=g), torch.randn(4, tgt, 8, generator=g)


def test_longer_targets_with_the_same_sources_warn_once_where_the_decoder_is_kept() -> None:
    torch.manual_seed(0)
    model = _Seq2Seq()
    prof = remat.profile(model, _batch(16), _loss, repeats=1, ops=False, progress=False)
    assert [b.name for b in prof.blocks][3] == "decoder.0"
    plan = remat.plan(prof, strategy=remat.selective([0, 1, 2]))  # the encoder recomputed, the decoder kept
    assert plan.predicted_peak_bytes is not None
    for tgt, grows in ((16, False), (8, False), (64, True)):
        planned, plain = copy.deepcopy(model), copy.deepcopy(model)
        remat.apply(planned, plan)
        inputs = _batch(tgt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for m in (planned, plain):
                m.zero_grad(set_to_none=True)
                _loss(m(*inputs)).backward()
            got = [p.grad for p in planned.parameters()]
            want = [p.grad for p in plain.parameters()]
            assert all(a is not None and b is not None and torch.equal(a, b) for a, b in zip(got, want, strict=True))
            peak = remat.measure(planned, inputs, _loss, steps=1, progress=False).peak_bytes
            planned(*inputs)
        warned = [str(w.message) for w in caught if issubclass(w.category, remat.RematWarning)]
        if grows:  # the oracle: that step really peaks above the plan's prediction
            assert peak > plan.predicted_peak_bytes * 1.05, (tgt, peak, plan.predicted_peak_bytes)
            assert len(warned) == 1 and "module 'decoder.0' (block 3 of the plan" in warned[0], (tgt, warned)
        else:
            assert warned == [] and peak <= plan.predicted_peak_bytes * 1.05, (tgt, warned, peak)
        remat.remove(planned)
        assert not any(m._forward_pre_hooks for m in planned.modules())
