"""``mode=check``: re-measure a run's settings and flag the partitions whose readings moved beyond noise."""
from kareus.check.run import DRIFT_EXIT, run_check

__all__ = ["DRIFT_EXIT", "run_check"]
