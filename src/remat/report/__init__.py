"""Tables, plots and reports (matplotlib is imported lazily, only by the plotting functions)."""

from remat.report.html import write_report
from remat.report.plots import (
    plot_comparison,
    plot_heatmap,
    plot_timelines,
    plot_tradeoff,
    write_bench_plots,
    write_charts,
)
from remat.report.tables import bench_table, plan_tree, plans_table, profile_table

__all__ = [
    "bench_table",
    "plan_tree",
    "plans_table",
    "profile_table",
    "plot_timelines",
    "plot_tradeoff",
    "plot_heatmap",
    "plot_comparison",
    "write_charts",
    "write_bench_plots",
    "write_report",
]
