"""Modules a model holds twice: a module registered under two names is one block (NOTE [ One module, two
names ] in remat/blocks.py); with ``split=True`` a stateless child called at two places (CCT's DropPath) or
sitting at two slots of a Sequential (AutoencoderTiny's ReLU) stays code between blocks (helper-86)."""

import torch
import torch.nn as nn

import remat


class _Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2, self.drop = (
            nn.LayerNorm(d),
            nn.Linear(d, 4 * d),
            nn.Linear(4 * d, d),
            nn.Dropout(0.1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.relu(self.fc1(self.norm(x)))))


class _Stack(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _Updater(nn.Module):  # performer-pytorch's ProjectionUpdater: a back-reference to the stack
    def __init__(self, instance: nn.Module) -> None:
        super().__init__()
        self.instance = instance

    def tick(self) -> None:
        pass


class _Net(nn.Module):
    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.emb, self.net, self.head = nn.Linear(8, d), _Stack(d, n), nn.Linear(d, 1)
        self.updater = _Updater(self.net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.updater.tick()
        return self.head(self.net(self.emb(x)))


def _grads(model, x, loss_fn):
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(0)
    loss_fn(model(x)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_module_with_two_names_is_one_block_and_plans_bitwise() -> None:
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(16, 64, 8)
    loss_fn = lambda o: o.pow(2).mean()  # noqa: E731
    blocks = remat.blocks(model)
    assert [b.name for b in blocks] == [f"net.layers.{i}" for i in range(4)]
    assert [b.name for b in remat.blocks(model, split=True)][:2] == ["net.layers.0.norm", "net.layers.0.fc1"]
    ref = _grads(model, x, loss_fn)
    prof = remat.profile(model, x, loss_fn, repeats=1)
    plan = remat.plan(prof, budget="70%")
    remat.apply(model, plan)
    try:
        got = _grads(model, x, loss_fn)
        peak = remat.measure(model, x, loss_fn).peak_bytes
    finally:
        remat.remove(model)
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    assert peak <= plan.budget_bytes * 1.05


class _DropPath(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep = x.new_empty(x.shape[0], 1, 1).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class _CCTLayer(nn.Module):  # vit-pytorch's CCT: one DropPath for both residual branches
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(d), nn.Linear(d, d), nn.LayerNorm(d)
        self.fc1, self.act, self.fc2, self.drop_path = (
            nn.Linear(d, 4 * d),
            nn.GELU(),
            nn.Linear(4 * d, d),
            _DropPath(0.1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.fc2(self.act(self.fc1(self.norm2(x)))))


class _CCT(nn.Module):
    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_CCTLayer(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_shared_droppath_is_no_split_block_and_plans_bitwise() -> None:
    torch.manual_seed(0)
    model, x = _CCT(d=32, n=4), torch.randn(4, 32, 32)
    loss_fn = lambda o: o.pow(2).mean()  # noqa: E731
    blocks = remat.blocks(model, split=True)
    names = [b.name for b in blocks]
    assert "layers.0.drop_path" not in names and "layers.0.act" in names
    ref = _grads(model, x, loss_fn)
    prof = remat.profile(model, x, loss_fn, blocks=blocks, repeats=1)
    plan = remat.plan(prof, budget="50%")
    remat.apply(model, plan)
    try:
        got = _grads(model, x, loss_fn)
        peak = remat.measure(model, x, loss_fn).peak_bytes
    finally:
        remat.remove(model)
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    assert peak <= plan.budget_bytes * 1.05
    assert abs(peak / plan.predicted_peak_bytes - 1) <= 0.05


class _Shared(torch.nn.Module):
    """diffusers' AutoencoderTiny block: one ReLU object at two places of a Sequential."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        act = torch.nn.ReLU()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, d), act, torch.nn.Linear(d, d), act, torch.nn.Linear(d, d))
            for _ in range(4)
        )

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_shared_relu_in_sequential_is_no_split_block() -> None:
    torch.manual_seed(0)
    model, x = _Shared(), torch.randn(256, 32)
    loss_fn = lambda o: o.pow(2).mean()  # noqa: E731
    blocks = remat.blocks(model, split=True)
    assert [b.name for b in blocks][:3] == ["layers.0.0", "layers.0.2", "layers.0.4"]
    ref = _grads(model, x, loss_fn)
    prof = remat.profile(model, x, loss_fn, blocks=blocks, repeats=1)
    try:  # the ReLU outputs are held between blocks: nothing below the plain peak may be reachable
        plan = remat.plan(prof, budget="70%")
    except remat.BudgetInfeasibleError as e:
        plan = remat.plan(prof, budget=e.min_peak_bytes)
    remat.apply(model, plan)
    try:
        got = _grads(model, x, loss_fn)
        peak = remat.measure(model, x, loss_fn).peak_bytes
    finally:
        remat.remove(model)
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    assert peak <= plan.budget_bytes * 1.05
    plan = remat.plan(prof, strategy=remat.full())
    remat.apply(model, plan)
    try:
        got = _grads(model, x, loss_fn)
    finally:
        remat.remove(model)
    assert all(torch.equal(ref[n], got[n]) for n in ref)
