"""ascendbind: bind Ascend NPU inference workers to the CPUs close to their NPU."""

__version__ = "0.1.0"
