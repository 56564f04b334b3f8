"""Peak RSS of a stretch of code, for the tests and benchmarks that measure memory: Linux VmHWM, reset to the
current RSS through /proc/self/clear_refs."""
from __future__ import annotations

import gc


def status(key: str) -> int:
    """Bytes of a /proc/self/status entry ("VmRSS:", "VmHWM:")."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def reset_peak() -> int:
    """Collect garbage, reset VmHWM (the peak RSS) to the current RSS, and return that RSS."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS:")
