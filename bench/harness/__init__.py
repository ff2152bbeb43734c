"""The benchmark suite behind ``mcgraph bench`` (see :mod:`bench.harness.cli`).

Rows (:class:`~bench.harness.records.Row`) are the product: every table, plot
and the Markdown summary is made from them (:mod:`bench.harness.report`).
Importing this package runs nothing and probes no GPU.
"""

from .agreement import Outcome, Verdict, check_equal, check_same_law
from .runner import CaseRunner, Settings, run_cases
from .measure import LinearFit, MaxM, Probe, max_feasible_m, parse_bytes, parse_count
from .records import COLUMNS, Row, read_json, write_csv, write_json
from .workloads import ALL_METHODS, KL_PAIRS, Case, KLCase, KLPair, LastLayerCase, register_kl_pair

__all__ = [
    "ALL_METHODS", "COLUMNS", "Case", "CaseRunner", "KLCase", "KLPair", "KL_PAIRS", "LastLayerCase", "LinearFit",
    "MaxM", "Outcome", "Probe", "Row", "Settings", "Verdict", "check_equal", "check_same_law",
    "max_feasible_m", "parse_bytes", "parse_count", "read_json", "register_kl_pair", "run_cases", "write_csv",
    "write_json",
]
