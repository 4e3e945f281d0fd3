"""`psd bench`: what psd does on this machine, next to the peers a user would pick, in one run.

Workloads (each reported as figures and, for peers, as psd/peer ratios):

- *limit*: the update kernel ``w -= lr*g`` over one vector, in the same native
  code as the server, 1 and N threads (three streams per element: read g,
  read w, write w), twice: from DRAM (vectors several times the last-level
  cache, read from sysfs) and in cache (a working set within half of it);
- *kernels*: the update written four ways (scalar, the compiler's vectorised
  loop, vectors unrolled 4 and 8 times), in cache and over the DRAM limit's vector;
- *update loop*: the server's loop applying pre-filled rings, as GB/s and as a
  fraction of the limit at the same size, from DRAM and in cache;
- *round trip*: null learners (the gradient is precomputed) doing push + pull
  against a live server, for several learner counts and model sizes:
  updates/s, GB/s of model traffic (gradient in, weights out for each pull
  actually made: GaDei's Table 7 measure), pulls per update, p50/p99 push and
  step latency, with the default pull (a copy) and with pull="view" (no copy);
  beside torch.multiprocessing Hogwild (with and without a copy of the weights
  per step, which is what a pull is) and DistributedDataParallel's all_reduce
  over gloo;
- *training*: the shipped MLP workload at several mini-batch sizes and learner
  counts: samples/s and accuracy (psd with either pull), beside Hogwild training
  the same model.

Every process sets one torch thread, so N learners do not oversubscribe the cores.
Each measurement runs ``reps`` times with psd and its peers taking turns, and
the median run is reported (with the least and most of its runs), so that a
noisy spell on a shared machine does not decide a ratio.

The measurements live in modules by kind: ``kernels`` (the limits, the kernel variants, the update loop,
the idle cost), ``round_trip``, ``training``, their ``peers``, and ``report`` (one whole run).
"""

from psd.bench._common import BenchConfig
from psd.bench.kernels import idle_cpu, kernels, last_level_cache, limit, limits, update_loop
from psd.bench.report import main_json, run
from psd.bench.round_trip import gpu_round_trip, host_device_gbs, round_trip
from psd.bench.training import training

__all__ = ["BenchConfig", "gpu_round_trip", "host_device_gbs", "idle_cpu", "kernels", "last_level_cache", "limit",
           "limits", "main_json", "round_trip", "run", "training", "update_loop"]
