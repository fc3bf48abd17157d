"""``Profile.summary()``: a quick look at what was measured, in a few lines."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from remat.profile.types import Profile
from remat.units import format_bytes, format_ms


def test_profile_summary_names_the_model_its_blocks_and_the_largest(run: dict[str, Any]) -> None:
    prof: Profile = run["profile"]
    lines = prof.summary().splitlines()
    assert (
        lines[0]
        == f"{prof.model} on {prof.device}: {len(prof.blocks)} blocks ({prof.blocks[0].name} to {prof.blocks[-1].name})"
    )
    assert (
        f"plain step: peak {format_bytes(prof.peak_bytes)} above the {format_bytes(prof.held_bytes)} held" in lines[1]
    )
    assert lines[1].endswith(format_ms(prof.step_ms))
    largest = max(zip(prof.blocks, prof.block_profiles), key=lambda b: b[1].saved_bytes)
    assert f"the most: {largest[0].name} {format_bytes(largest[1].saved_bytes)}" in lines[2]
    assert "form a chain" in prof.summary() and "stateful" not in prof.summary()
    assert f"attention / MLP found in {len(prof.blocks)} of {len(prof.blocks)} blocks" in prof.summary()


def test_profile_summary_says_why_blocks_are_not_a_chain_and_which_are_stateful(run: dict[str, Any]) -> None:
    prof: Profile = run["profile"]
    bps = list(prof.block_profiles)
    bps[1] = replace(bps[1], linked=False, stateful=("counter",))
    bps[0] = replace(bps[0], reused_bytes=4096)
    text = replace(prof, block_profiles=tuple(bps), is_chain=False).summary()
    b0, b1 = prof.blocks[0].name, prof.blocks[1].name
    assert (
        f"the blocks do not form a chain (no segment goes on across 1 of 2 block boundaries): a later "
        f"block reuses the output of {b0}, {b1} takes inputs made between blocks"
    ) in text
    bps[2] = replace(bps[2], linked=False)
    text = replace(prof, block_profiles=tuple(bps), is_chain=False).summary()
    assert "the blocks do not form a chain (the solvers recompute blocks one at a time)" in text
    assert text.splitlines()[-1] == f"  stateful blocks, always kept: {b1} (counter)"
