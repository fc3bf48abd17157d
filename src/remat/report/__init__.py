"""Tables, plots and reports (matplotlib is imported lazily, only by the plotting functions).

The tables, charts and documents draw values (:class:`ReportData`) and never plan or measure;
:func:`collect` and :func:`bench_plans` run the pipeline that makes those values.
"""

from remat.report.data import ReportData, heatmap_plan
from remat.report.html import Written, build, write_report
from remat.report.pipeline import bench_plans, collect
from remat.report.plots import (
    CHARTS,
    Chart,
    plot_comparison,
    plot_heatmap,
    plot_timelines,
    plot_tradeoff,
    write_bench_plots,
    write_charts,
)
from remat.report.tables import bench_table, plan_tree, plans_table, profile_table

__all__ = [
    "ReportData",
    "collect",
    "bench_plans",
    "build",
    "Written",
    "heatmap_plan",
    "bench_table",
    "plan_tree",
    "plans_table",
    "profile_table",
    "Chart",
    "CHARTS",
    "plot_timelines",
    "plot_tradeoff",
    "plot_heatmap",
    "plot_comparison",
    "write_charts",
    "write_bench_plots",
    "write_report",
]
