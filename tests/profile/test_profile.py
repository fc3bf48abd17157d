"""remat.profile: measured sizes against known ones, the model left exactly as it was, JSON."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, Recompute
from remat.errors import BlockSelectionError, RematError
from remat.models import Workload, workload
from remat.plan.chain import chain_of
from remat.plan.planner import plan_from_ops
from remat.plan.solver import simulate
from remat.profile import Profile


def test_sizes_match_what_autograd_must_save() -> None:
    # Each block is Linear(8 -> 32) then ReLU. For a batch of 4 in float32, autograd keeps the
    # Linear's input (4*8*4 = 128 bytes; the weight is a parameter, excluded) and the ReLU's output
    # (4*32*4 = 512 bytes), which is also the block's output.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(8, 32), nn.ReLU()),
        nn.Sequential(nn.Linear(32, 8), nn.ReLU()),
    )
    x = torch.randn(4, 8)
    prof = remat.profile(model, x, lambda out: out.sum(), repeats=1)
    first, second = prof.block_profiles
    assert (first.input_bytes, first.output_bytes, first.saved_bytes, first.output_saved_bytes) == (128, 512, 640, 512)
    # Block 2 saves its input (512, the same storage as block 1's output) and its ReLU output (4*8*4).
    assert (second.input_bytes, second.output_bytes, second.saved_bytes, second.output_saved_bytes) == (
        512,
        128,
        640,
        128,
    )
    assert first.fwd_flops == 2 * 4 * 8 * 32 and second.fwd_flops == 2 * 4 * 32 * 8
    assert first.bwd_flops == 2 * 4 * 8 * 32  # weight grad only: the input needs no grad
    assert second.bwd_flops == 2 * (2 * 4 * 32 * 8)  # input and weight grads
    assert prof.is_chain


def test_profile_peak_is_the_measured_plain_peak_and_the_model_reproduces_it(small_gpt: Workload) -> None:
    w = small_gpt
    prof = remat.profile(w.model, w.inputs, w.loss_fn, repeats=1)
    measured = remat.measure(w.model, w.inputs, w.loss_fn, steps=1)
    assert prof.peak_bytes == measured.peak_bytes
    predicted = simulate(chain_of(prof), remat.plan(prof, strategy=remat.none()).ops).peak_bytes
    assert abs(predicted - prof.peak_bytes) <= 0.02 * prof.peak_bytes
    assert prof.held_bytes == measured.held_bytes > 0
    assert all(bp.fwd_ms > 0 and bp.bwd_ms > 0 and bp.fwd_flops > 0 for bp in prof.block_profiles)
    assert all(len(bp.subs) == 2 for bp in prof.block_profiles)  # each layer's attention and MLP


def test_profiling_leaves_the_model_exactly_as_it_was(small_resnet: Workload) -> None:
    w = small_resnet
    model = w.model
    for p in list(model.parameters())[::3]:
        p.grad = torch.randn_like(p)
    model.layer1.eval()  # a mixed train/eval model
    remat.apply(model, remat.every_nth(2))
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    before_modes = [m.training for m in model.modules()]
    torch.manual_seed(123)
    before_rng = torch.get_rng_state()
    prof = remat.profile(model, w.inputs, w.loss_fn, repeats=1)
    assert torch.equal(torch.get_rng_state(), before_rng)
    after_state = model.state_dict()
    assert all(torch.equal(after_state[k], v) for k, v in before_state.items())  # BatchNorm statistics included
    for p, g in zip(model.parameters(), before_grads):
        assert (p.grad is None and g is None) or torch.equal(p.grad, g)  # type: ignore[arg-type]
    assert [m.training for m in model.modules()] == before_modes
    plan = remat.applied(model)
    assert plan is not None and plan.strategy == "every_nth(n=2)"
    assert len(prof.blocks) == 2
    # The profile itself saw the plain model: every block ran its forward once.
    assert remat.measure(model, w.inputs, w.loss_fn, steps=1).forward_counts == {"layer1": 2, "layer2": 1}


def test_json_round_trip(small_mlp: Workload) -> None:
    prof = remat.profile(small_mlp.model, small_mlp.inputs, small_mlp.loss_fn, repeats=1)
    assert Profile.from_json(prof.to_json()) == prof
    with pytest.raises(RematError, match="schema_version None is not 1"):
        Profile.from_json("{}")


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(self.b(x)))


class _OwnCheckpoint(nn.Module):
    """Checkpoints its layers itself (as HF's gradient_checkpointing_enable) or runs one under no_grad."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if self.how == "checkpoint":
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            elif self.how == "no_grad" and i == 1:
                with torch.no_grad():
                    x = layer(x)
            else:
                x = layer(x)
        return x


def test_blocks_recomputed_by_the_model_or_run_without_gradients_are_refused() -> None:
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(BlockSelectionError, match=r"'layers.0' ran again in the backward \(3 of 3 blocks did\)"):
        remat.profile(_OwnCheckpoint("checkpoint"), x, lambda y: y.sum(), repeats=1)
    with pytest.raises(BlockSelectionError, match=r"'layers.1' ran with gradients off \(1 of 3 blocks did"):
        remat.profile(_OwnCheckpoint("no_grad"), x, lambda y: y.sum(), repeats=1)
    assert len(remat.profile(_OwnCheckpoint("plain"), x, lambda y: y.sum(), repeats=1).block_profiles) == 3


def test_blocks_must_run_once_each_in_order() -> None:
    model = Twice()
    x = torch.randn(2, 4)
    with pytest.raises(BlockSelectionError, match=r"blocks must run exactly once per step, but \[\('b', 2\)\]"):
        remat.profile(model, x, lambda y: y.sum(), blocks=remat.blocks(model, named=[["a"], ["b"]]), repeats=1)
    with pytest.raises(BlockSelectionError, match=r"'b' ran 2 times: a module called more than once.*split=False"):
        remat.profile(model, x, lambda y: y.sum(), blocks=remat.blocks(model, split=True), repeats=1)
    with pytest.raises(RematError, match="repeats=0 and warmup=1 must both be >= 1"):
        remat.profile(model, x, lambda y: y.sum(), repeats=0)
    with pytest.raises(RematError, match="loss_fn returned a tensor of shape \\(2, 4\\)"):
        remat.profile(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), x, lambda y: y, repeats=1)


class _EditsItsInput(nn.Module):
    """Scales its input in place before its Linear (a recomputation would scale it twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(1.01)
        return self.fc(x)


class _JitterMLP(nn.Module):
    """Mixtral's router jitter in miniature: the MLP scales its input in place."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h *= 1.01
        return self.down(self.act(self.up(h)))


class _JitterLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.mlp = _JitterMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return x + self.mlp(x.clone())


@pytest.mark.parametrize("layer", [_EditsItsInput, _JitterLayer])
def test_what_edits_its_input_in_place_is_recomputed_only_with_the_block_that_made_it(layer: type[nn.Module]) -> None:
    # apply refuses to recompute a module that edits its argument in place; the profile sees it, so the
    # planner keeps such a block (and offers no sub-module variant for such a sub-module), and every
    # budget it can meet runs exactly, never refused.
    torch.manual_seed(0)
    model = nn.Sequential(*[layer() for _ in range(4)])
    x = torch.randn(4, 8, 16)
    prof = remat.profile(model, x, lambda y: y.square().mean(), repeats=1)
    block_edits = layer is _EditsItsInput
    assert [bp.edits_input for bp in prof.block_profiles] == [block_edits] * 4
    subs = [s.fqn for bp in prof.block_profiles for s in bp.subs]
    assert not any(f.endswith("mlp") for f in subs) and (block_edits or len(subs) == 4)
    # Blocks 1-3 edit the previous block's output: recomputed with it, never at a segment's start (NOTE [
    # In-place edits of a member's output ] in remat.core.runtime); block 0 edits the model's input.
    assert [bp.edits_own_link for bp in prof.block_profiles] == [False, block_edits, block_edits, block_edits]
    assert chain_of(prof).recomputable[:4] == (not block_edits, True, True, True)
    assert chain_of(prof).startable[:4] == (not block_edits,) * 4
    if not block_edits:  # ffn_only would checkpoint the MLP alone: refused at planning, with the reason
        with pytest.raises(RematError, match=r"checkpoints 0\.mlp alone.*edits its input in place"):
            remat.plan(prof, strategy=remat.ffn_only())
    for budget in ("40%", "70%", "90%"):
        try:
            plan = remat.plan(prof, budget)
        except remat.BudgetInfeasibleError:
            continue
        assert remat.check_gradients(model, plan, x, lambda y: y.square().mean()).equal, plan.describe()


def test_flops_are_flop_counters_and_a_reversible_model_is_refused() -> None:
    # FLOPs come from torch.utils.flop_counter's formulas, without FlopCounterMode's module tracker,
    # whose hooks fail on transformers' Reformer (layers run inside a custom autograd Function). Its
    # layers run with gradients off and save nothing (they recompute themselves in the backward): the
    # profile says so instead of measuring a backward it cannot see (it predicted 2x the real peak).
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import ReformerConfig, ReformerModelWithLMHead

    config = ReformerConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, attention_head_size=16, feed_forward_size=64,
        attn_layers=["local", "local"], axial_pos_embds=False, max_position_embeddings=16,
        local_attn_chunk_length=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        local_attention_probs_dropout_prob=0.0, is_decoder=True, use_cache=False, pad_token_id=0, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = ReformerModelWithLMHead(config)
    ids = torch.randint(3, 64, (2, 16))
    inputs = {"input_ids": ids, "labels": ids}
    with pytest.raises(
        BlockSelectionError, match=r"'reformer.encoder.layers.0' ran again in the backward \(2 of 2 blocks"
    ):
        remat.profile(model, inputs, lambda out: out.loss, repeats=1)
    w = remat.models.workload("mlp")
    prof = remat.profile(w.model, w.inputs, w.loss_fn, repeats=1, ops=False)
    with FlopCounterMode(display=False) as counter:
        w.loss_fn(w.model(w.inputs)).backward()
    total = sum(bp.fwd_flops + bp.bwd_flops for bp in prof.block_profiles)
    assert 0 < total <= counter.get_total_flops()


class _Mul(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class _TanhOf(_Mul):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + self.w)


class _MadeBetween(nn.Module):
    """Block 1 frees block 0's output (tanh saves only its own), then ``z = 2 * o`` is made between
    blocks 1 and 2, of the size of that output, often at its freed address."""

    def __init__(self, n: int = 1024) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Mul(n), _TanhOf(n), _Mul(n), _TanhOf(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = self.layers[1](self.layers[0](x))
        z = o * 2
        return self.layers[3](self.layers[2](z))


def test_an_input_made_between_blocks_at_a_freed_address_is_not_linked() -> None:
    # A storage pointer does not name a storage over time: an input made between blocks at the address
    # of a freed earlier tensor passed as "a tensor that existed before" (in 8 of 50 steps here), so
    # the solvers joined segments across that boundary (a split BatchNorm net measured 1.06x its budget).
    from remat.core.probe import probe

    model, x = _MadeBetween(), torch.randn(1024, requires_grad=True)
    blocks = remat.blocks(model, include="layers.*")
    linked = []
    for _ in range(50):
        with probe(model, blocks, lambda kind, i: None, track=True) as tracked:
            model(x).sum().backward()
        linked.append(tracked.linked[2])
    assert not any(linked)


def test_draws_between_blocks_are_seen_and_not_joined_across() -> None:
    # A segment's recording keeps one RNG state, and another only for a call after the model's own code
    # drew random numbers (runtime._Frame.end_rng): the per-op profile sees those draws, the chain
    # charges the copy and the solvers do not join segments across such a boundary.
    from tests.zoo.models import ZOO

    for name, between in (("dropout_between", True), ("dropout", False)):
        case = ZOO[name]()
        prof = remat.profile(case.model, case.inputs, case.loss_fn, repeats=1)
        fresh = [b.fresh_rng for b in prof.block_profiles]
        assert fresh[1:] == [between] * (len(fresh) - 1), (name, fresh)
        chain = chain_of(prof)
        assert chain.rng_copy_bytes[1:-1] == (prof.ckpt_state_bytes if between else 0,) * (len(fresh) - 1)
        if between:
            assert not any(chain.joinable[:-2])


def test_loss_that_wants_the_targets_too_is_told_to_close_over_them() -> None:
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    close_over = r"loss_fn is called with the model's output only, so close over your targets: lambda out"
    with pytest.raises(RematError, match=rf"^profile: loss_fn cross_entropy cannot be called .*{close_over}"):
        remat.profile(model, x, F.cross_entropy, repeats=1)
    with pytest.raises(RematError, match=rf"^profile: .*{close_over}"):  # the step's check, without op profiling
        remat.profile(model, x, F.cross_entropy, repeats=1, ops=False)
    with pytest.raises(RematError, match=rf"^measure: .*{close_over}"):
        remat.measure(model, x, F.cross_entropy, steps=1)
    with pytest.raises(RematError, match=r"^profile: loss_fn returned a tensor of shape \(2, 4\)"):
        remat.profile(model, x, lambda y: y, repeats=1)
    with pytest.raises(RematError, match=r"^measure: loss_fn returned a tensor of shape \(2, 4\)"):
        remat.measure(model, x, lambda y: y, steps=1)

    def own_bug(out: torch.Tensor) -> torch.Tensor:
        return out.sum(wrong=True)  # a TypeError inside a loss that takes one argument is the user's own

    with pytest.raises(TypeError, match="wrong"):
        remat.profile(model, x, own_bug, repeats=1)


def test_a_loss_that_differentiates_through_the_blocks_is_refused_clearly() -> None:
    # A WGAN-GP gradient penalty: torch.autograd.grad(create_graph=True) inside the loss. The profile's
    # no-save run gave torch's "unpack_hook expected to be a Tensor" TypeError.
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)))
    x = torch.randn(4, 8, requires_grad=True)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return out.mean() + (g.norm(dim=1) - 1).square().mean()

    with pytest.raises(RematError, match=r"profile: loss_fn differentiates through the model's blocks"):
        remat.profile(model, x, loss_fn, repeats=1)


class _Aux(nn.Module):
    """A block that also computes a branch the loss never reaches (its graph is freed unused)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.branch: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.branch.append(torch.sigmoid(self.fc(x)))  # saves its own output
        self.branch.clear()
        return torch.tanh(self.fc(x))


def test_profiling_leaves_no_graph_of_its_runs_alive() -> None:
    # NOTE [ Saved outputs make cycles ]: a pack hook returning the saved tensor itself kept every graph
    # no backward ran through alive for good (the per-op profile's forwards: ~3 forwards of activations
    # per remat.profile call).
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(8, 16), nn.Sigmoid(), nn.Linear(16, 8), _Aux(), nn.Linear(8, 8))
    refs: list[weakref.ref[torch.Tensor]] = []
    hooks = [
        model[1].register_forward_hook(lambda _m, _a, out: refs.append(weakref.ref(out))),
        model[3].register_forward_hook(lambda _m, _a, out: refs.append(weakref.ref(out))),
    ]
    prof = remat.profile(model, torch.randn(4, 8), lambda o: o.pow(2).mean(), progress=False, repeats=1)
    for h in hooks:
        h.remove()
    gc.collect()
    assert prof.block_ops and len(refs) > 4  # the per-op profile's forwards ran
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} of {len(refs)} outputs of the profile's runs are still alive"


class _SplitMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("hook", ["forward_new", "forward_none", "forward_in_place", "backward_pre"])
def test_a_member_hook_that_hands_the_next_member_another_tensor_unlinks_the_boundary(hook: str) -> None:
    # NOTE [ Links are what the forward sees ] in remat.core.probe: the runtime links a member's argument
    # to the previous member's output as the forwards see them. A forward hook returning a new tensor (or
    # editing the output), or the wrapping of a module's arguments for its full backward hooks, hands the
    # next member an external argument that a segment across the boundary holds: a split MLP's smallest
    # plan measured 1.3x its budget while the profile called the boundary linked.
    def build() -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        model = _SplitMLP()
        if hook == "forward_new":
            model.act.register_forward_hook(lambda m, a, out: out + 0.1)
        elif hook == "forward_none":
            model.act.register_forward_hook(lambda m, a, out: None)
        elif hook == "forward_in_place":
            model.act.register_forward_hook(lambda m, a, out: (out.mul_(2.0), None)[1])
        else:
            model.fc2.register_full_backward_pre_hook(lambda m, go: (go[0] * 2.0,))
        return model, torch.randn(64, 32, requires_grad=True)

    model, x = build()
    blocks = remat.blocks(model, include=["fc1", "act", "fc2"])
    prof = remat.profile(model, x, lambda out: out.sum(), blocks=blocks, repeats=1, progress=False)
    boundary = prof.block_profiles[2]
    if hook == "forward_none":
        assert boundary.linked and boundary.unlinked_bytes == 0
    else:
        assert not boundary.linked and boundary.unlinked_bytes == 64 * 64 * 4
    plan = plan_from_ops(prof, (Keep(0), Recompute(1, 3, (Keep(1), Keep(2)))), "by hand")
    model, x = build()
    remat.apply(model, plan)
    measured = remat.measure(model, x, lambda out: out.sum(), steps=1, progress=False).peak_bytes
    assert measured <= simulate(chain_of(prof), plan.ops).peak_bytes


class _CallsForwardDirectly(nn.Module):
    """Calls its layers' forward directly, as HF SqueezeBERT's encoder does: no module hooks run."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer.forward(x))
        return x


def test_blocks_whose_forward_the_model_calls_directly_are_refused_with_that_reason() -> None:
    model = _CallsForwardDirectly()
    with pytest.raises(BlockSelectionError, match=r"did not run.*called its forward directly \(layer\.forward\(x\)"):
        remat.profile(model, torch.randn(4, 8), lambda out: out.sum(), progress=False)


def test_profiling_a_model_in_eval_mode_warns_that_its_plans_are_for_eval_steps() -> None:
    w = workload("gpt", n_layers=2, d_model=32, n_heads=2, seq_len=16, batch=2, vocab_size=32)
    w.model.eval()
    with pytest.warns(UserWarning, match=r"is in eval mode, so the profile and its plans are for eval-mode steps"):
        remat.profile(w.model, w.inputs, w.loss_fn, repeats=1, ops=False, progress=False)
