"""Measuring a model: per-block bytes, times, FLOPs."""

from remat.profile.profiler import profile
from remat.profile.types import BlockProfile, Profile, SubProfile

__all__ = ["profile", "Profile", "BlockProfile", "SubProfile"]
