"""TVM's thread pool as a neighbour: redfuser tells it not to spin by default.

After a parallel kernel TVM's idle workers busy-wait (``TVM_THREAD_POOL_SPIN_COUNT``, TVM's
default 300000 turns), which halved the speed of torch ops in the same process on 2 cores
(``redfuser/tvm/__init__.py``, ``python -m redfuser.tools.neighbour``).  The pool reads the
variable once, so each check runs in a fresh interpreter; no timing is asserted (shared,
noisy machines): what is checked is the value TVM sees when it loads.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from redfuser.tvm import THREAD_POOL_SPIN_COUNT

SPIN = "TVM_THREAD_POOL_SPIN_COUNT"

# Records the variable as it is when ``tvm`` itself is first imported (what the pool will
# read), then imports redfuser's TVM package the way every TVM-using module does.
PROBE = f"""
import importlib.abc, os, sys

class Watch(importlib.abc.MetaPathFinder):
    seen = "not imported"

    def find_spec(self, name, path=None, target=None):
        if name == "tvm" and Watch.seen == "not imported":
            Watch.seen = os.environ.get({SPIN!r}, "unset")
        return None

sys.meta_path.insert(0, Watch())
import redfuser.tvm.ir
print(Watch.seen, os.environ.get({SPIN!r}, "unset"))
"""


def spin_seen(env_value: str | None) -> tuple[str, str]:
    """(the spin count when tvm is imported, the one after) in a fresh interpreter whose
    environment has ``env_value`` for it (None: not set)."""
    env = {k: v for k, v in os.environ.items() if k != SPIN}
    if env_value is not None:
        env[SPIN] = env_value
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    at_import, after = done.stdout.split()
    return at_import, after


def test_the_pool_does_not_spin_unless_the_user_asks():
    """Unset: TVM loads with redfuser's short spin count (before the fix it loaded with
    none, i.e. TVM's 300000)."""
    assert spin_seen(None) == (THREAD_POOL_SPIN_COUNT,) * 2
    assert int(THREAD_POOL_SPIN_COUNT) <= 3000


@pytest.mark.parametrize("value", ["300000", "1000", "0"])
def test_a_spin_count_the_user_set_is_kept(value):
    assert spin_seen(value) == (value, value)
