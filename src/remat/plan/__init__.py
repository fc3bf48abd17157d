"""Strategies and solvers: each reads a Profile and returns a Plan."""

from remat.core.ops import Keep, Op, Recompute, RecomputeSub
from remat.plan.chain import Chain
from remat.plan.frontier import Frontier, FrontierPoint, frontier
from remat.plan.planner import SOLVERS, plan
from remat.plan.solver import Simulation, simulate
from remat.plan.strategies import STRATEGIES, Strategy, parse_strategy
from remat.plan.types import Plan

__all__ = [
    "Chain",
    "Keep",
    "Op",
    "Recompute",
    "RecomputeSub",
    "SOLVERS",
    "Frontier",
    "FrontierPoint",
    "frontier",
    "plan",
    "Simulation",
    "simulate",
    "STRATEGIES",
    "Strategy",
    "parse_strategy",
    "Plan",
]
