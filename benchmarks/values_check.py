"""The cost of the VALUES check in the update loop's sgd kernel.

    .venv/bin/python benchmarks/values_check.py

w -= lr * g through `_native.apply_sgd` (the loop's kernel: each value of g loaded once, checked finite and used,
kernels.h psd_take1) against `_native.apply_sgd_kernel(..., 2)` (the unrolled kernel without the check, which the
loop ran before the trust boundary's rule VALUES), one thread, in the same run, medians of 15 interleaved reps.
Prints one line per size and a JSON object; `ratio` is unchecked time over checked time (1.0: the check is free).
"""

import json
import statistics
import time

import numpy as np

from psd import _native

UNROLL4 = 2  # enum psd_kernel


def main() -> None:
    res = {}
    for n in (10**4, 10**5, 10**6, 10**7):
        w = np.zeros(n, dtype=np.float32)
        g = np.random.default_rng(0).standard_normal(n).astype(np.float32)
        iters = max(3, int(2e7 // n))
        t: dict[str, list[float]] = {"checked": [], "unchecked": []}
        for _ in range(15):
            for name in t:
                t0 = time.perf_counter()
                for _ in range(iters):
                    if name == "checked":
                        _native.apply_sgd(w, g, 1e-3, 1)
                    else:
                        _native.apply_sgd_kernel(w, g, 1e-3, UNROLL4)
                t[name].append((time.perf_counter() - t0) / iters)
        a, b = statistics.median(t["checked"]), statistics.median(t["unchecked"])
        res[str(n)] = {"checked_us": round(a * 1e6, 2), "unchecked_us": round(b * 1e6, 2), "ratio": round(b / a, 3)}
        print(n, res[str(n)], flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
