"""Tables, plots and reports (matplotlib is imported lazily, only by the plotting functions)."""

from remat.report.tables import bench_table, plan_tree, plans_table, profile_table

__all__ = ["bench_table", "plan_tree", "plans_table", "profile_table"]
