"""Strategies and solvers: each reads a Profile (or, for a strategy, blocks or a model) and returns a Plan."""

from remat.core.ops import Keep, Op, Recompute, RecomputeSub
from remat.plan.chain import Chain
from remat.plan.frontier import Frontier, FrontierPoint, frontier
from remat.plan.planner import SOLVERS, Solver, plan, plan_from_ops, to_plan
from remat.plan.solver import Simulation, simulate
from remat.plan.strategies import STRATEGIES, Strategy, Target, parse_strategy
from remat.plan.types import Plan

__all__ = [
    "Chain",
    "Keep",
    "Op",
    "Recompute",
    "RecomputeSub",
    "SOLVERS",
    "Solver",
    "Frontier",
    "FrontierPoint",
    "frontier",
    "plan",
    "plan_from_ops",
    "to_plan",
    "Simulation",
    "simulate",
    "STRATEGIES",
    "Strategy",
    "Target",
    "parse_strategy",
    "Plan",
]
