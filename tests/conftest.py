"""Session setup for every test folder: the hypothesis profiles and a fresh tuning cache.

Profiles (hypothesis): ``ci`` is the default, whether or not ``CI`` is set: derandomized
(the same examples on every run and machine) and without an example database, so ``make
test`` passes or fails the same way for a new user as in CI.  Random exploration is opt-in
with ``HYPOTHESIS_PROFILE``: ``thorough`` (random, 16x the examples, an example database:
for hunting bugs locally, e.g. ``HYPOTHESIS_PROFILE=thorough .venv/bin/pytest tests/x.py``)
or ``dev`` (random, the default counts).  A failure found that way prints the example (and
its ``@reproduce_failure`` blob); add it as an explicit test.  Example counts are kept
modest: ``evaluate`` folds elements one at a time in Python, and the whole suite must stay
within a few minutes on two cores.

The shared helpers (strategies, comparisons, factories) live in tests/support/: a conftest
is pytest's, not a module to import from.
"""

from __future__ import annotations

import os
import tempfile

from hypothesis import HealthCheck, Phase, settings

_COMMON = dict(
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)
# Kernels read the tuning database by default: the tests must neither depend on what a user
# tuned nor write to the real cache, so the whole session gets a fresh cache directory.
os.environ["REDFUSER_CACHE"] = tempfile.mkdtemp(prefix="redfuser-test-cache-")
# Likewise torch.compile's on-disk caches (inductor's FX graphs, AOTAutograd's joint graphs):
# a graph cached by another run, of older code, would be loaded without tracing the ops'
# registered backwards again, so a test would check what an earlier version traced.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="redfuser-test-inductor-")

# The two pytest workers share the cores: after each of torch's parallel ops libgomp's idle
# workers spin ~10 ms (300000 turns) on the core the other worker's kernel waits for; the
# training notebook took 137 s beside the bfloat16 Mixtral test, 27 s with them asleep.
# libgomp reads this when torch loads, which no test module has done yet.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

settings.register_profile("ci", derandomize=True, database=None, print_blob=True, **_COMMON)
settings.register_profile("dev", print_blob=True, **_COMMON)
settings.register_profile("thorough", **{**_COMMON, "max_examples": 400,  # local bug hunts
                                         "print_blob": True})
# a bug hunt that reports the first failure as drawn: shrinking a kernel-compiling example
# can take longer than finding it
settings.register_profile("hunt", **{**_COMMON, "max_examples": 60, "print_blob": True},
                          phases=[Phase.explicit, Phase.generate])
# Deterministic unless asked: a random profile by default made a fresh clone's `make test`
# fail on examples CI never drew (module docstring).
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

