"""``blocks(model, split=True)`` on a layer that calls a child with weights at two places (Pegasus-X's
encoder layer runs ``final_layer_norm``, ``fc1`` and ``fc2`` on its tokens and again on its global
tokens): such a child would run twice per step, which no block may, and the profile refused the whole
split model; the layer now stays one block, its siblings' layers are still split (helper-112)."""

import torch
import torch.nn as nn

import remat


class _TwoStreamLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(d), nn.Linear(d, d)
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x)) + g.mean(1, keepdim=True)
        x = x + self.fc2(torch.relu(self.fc1(self.norm(x))))
        g = g + self.fc2(torch.relu(self.fc1(self.norm(g))))  # the same weights on the global tokens
        return x, g


class _PlainLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class _Net(nn.Module):
    def __init__(self, d: int = 32, n: int = 3) -> None:
        super().__init__()
        self.enc = nn.ModuleList(_TwoStreamLayer(d) for _ in range(n))
        self.dec = nn.ModuleList(_PlainLayer(d) for _ in range(n))
        self.glob = nn.Parameter(torch.randn(1, 4, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.glob.expand(x.shape[0], -1, -1)
        for layer in self.enc:
            x, g = layer(x, g)
        for layer in self.dec:
            x = layer(x)
        return x + g.mean(1, keepdim=True)


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    model(x).pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_layer_calling_a_weighted_child_twice_stays_whole_and_plans_bitwise() -> None:
    torch.manual_seed(0)
    model, x = _Net(n=2), torch.randn(8, 64, 32)
    loss_fn = lambda o: o.pow(2).mean()  # noqa: E731
    blocks = remat.blocks(model, split=True)
    names = [b.name for b in blocks]
    assert names[:2] == ["enc.0", "enc.1"]
    assert names[2:5] == ["dec.0.norm", "dec.0.fc1", "dec.0.fc2"]
    ref = _grads(model, x)
    prof = remat.profile(model, x, loss_fn, blocks=blocks, repeats=1)
    for target in (remat.plan(prof, budget="60%"), remat.plan(prof, strategy=remat.full())):
        remat.apply(model, target)
        try:
            got = _grads(model, x)
            peak = remat.measure(model, x, loss_fn).peak_bytes
        finally:
            remat.remove(model)
        assert ref.keys() == got.keys() and all(torch.equal(ref[n], got[n]) for n in ref)
        if target.budget_bytes is not None:
            assert peak <= target.budget_bytes * 1.05
        assert abs(peak / target.predicted_peak_bytes - 1) <= 0.05, (peak, target.predicted_peak_bytes)
    _check_pre_post_is_split()


class _PrePostLayer(nn.Module):  # OPT's do_layer_norm_before: the norm is named twice, runs once
    def __init__(self, d: int, before: bool) -> None:
        super().__init__()
        self.before, self.norm, self.fc1, self.fc2 = before, nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        if self.before:
            h = self.norm(h)
        h = x + self.fc2(torch.relu(self.fc1(h)))
        if not self.before:
            h = self.norm(h)
        return h


class _PrePost(nn.Module):
    def __init__(self, d: int = 32, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_PrePostLayer(d, before=True) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _check_pre_post_is_split() -> None:
    # A child named under opposite conditions (OPT's ``if self.do_layer_norm_before:`` then ``if not ...:``)
    # runs once: its layer is still split.
    torch.manual_seed(0)
    model, x = _PrePost(), torch.randn(4, 16, 32)
    blocks = remat.blocks(model, split=True)
    assert [b.name for b in blocks][:3] == ["layers.0.norm", "layers.0.fc1", "layers.0.fc2"]
    prof = remat.profile(model, x, lambda o: o.pow(2).mean(), blocks=blocks, repeats=1)
    assert len(prof.block_profiles) == 9
