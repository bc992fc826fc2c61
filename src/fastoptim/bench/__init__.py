"""``fastoptim bench``: optimizer step times, level against level and against peers, in one process."""

from .matmul import gemm_rate, newton_schulz_flops, newton_schulz_rows, settings_flops
from .report import bytes_per_param, environment, environment_line, markdown, print_tables, to_dict, write_json
from .runner import NS_OPTIONS, PEER_MODES, Row, rows_for, run_workload, time_schedulers
from .plot import plot
from .workloads import WORKLOADS, check_workload, numel, parse_count, shapes_for

__all__ = ["NS_OPTIONS", "PEER_MODES", "Row", "rows_for", "run_workload", "time_schedulers", "WORKLOADS",
           "check_workload", "plot", "numel", "parse_count", "shapes_for", "bytes_per_param", "markdown",
           "print_tables", "to_dict", "write_json", "environment", "environment_line", "gemm_rate",
           "newton_schulz_flops", "newton_schulz_rows", "settings_flops"]
