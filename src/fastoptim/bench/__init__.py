"""``fastoptim bench``: optimizer step times, level against level and against peers, in one process."""

from .report import bytes_per_param, markdown, print_tables, to_dict, write_json
from .runner import Row, rows_for, run_workload, time_schedulers
from .workloads import WORKLOADS, numel, parse_count, shapes_for

__all__ = ["Row", "rows_for", "run_workload", "time_schedulers", "WORKLOADS", "numel", "parse_count", "shapes_for",
           "bytes_per_param", "markdown", "print_tables", "to_dict", "write_json"]
