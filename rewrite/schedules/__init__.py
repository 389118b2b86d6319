"""Pipeline schedules as pure tables: `Action`s per rank, the named schedules, reading, checking,
simulating and printing tables. No process group, no model: shared by plan/, the runner and `show`.
"""

from .actions import KINDS, Action, Table, placement
from .named import SCHEDULE_NAMES, SCHEDULES, STAGES_PER_RANK, stages_needed
from .simulate import bubble, simulate
from .table import (
    build_table, custom_table, format_table, last_backward_reaches_all, parse_row, peak_in_flight, plan_table,
    rows_from_csv, schedule_rules, splits_backward, table_problems,
)

__all__ = [
    "Action", "Table", "bubble", "KINDS", "SCHEDULES", "SCHEDULE_NAMES", "STAGES_PER_RANK", "stages_needed", "placement", "build_table", "custom_table",
    "parse_row", "rows_from_csv", "format_table", "table_problems", "simulate", "peak_in_flight", "plan_table",
    "schedule_rules", "splits_backward", "last_backward_reaches_all",
]
