"""Schedule search: the space of plans, an analytic cost model, a measured search and the
tuning database.  It imports ``lowering`` and ``runtime``, never ``kernel``: candidates are
timed through a ``measure`` callable (``runtime.time_plan`` unless a ``Kernel`` passes its own).

- ``space``: which ``Plan`` parameters apply to a rule at a geometry, and their values.
- ``work``: operation counts read off the rule's components; ``cost``: predicted time.
- ``machine``: bandwidth and throughput figures, measured once per machine and cached.
- ``db``: the tuning database (JSON under the cache directory; ``store``: checked reads,
  locked atomic writes, nothing unreadable overwritten); ``share``: ``redfuser db``.
- ``search``: ``tune`` ranks with the model, measures the best few, keeps the fastest.

``redfuser.compile(spec, tune=True)`` searches each new shape once (and remembers),
``tune="model"`` takes the cost model's pick without measuring;
``redfuser tune "<spec>" --shape x=4096x4096`` does it from the command line.
"""

from ..lowering import shape_geometry  # re-exported: the search's users build geometries
from ..lowering.plan import Param  # re-exported: a space's parameters
from .cost import Estimate, predict
from .db import TuningDB, cache_dir, entry_key, spec_key
from .machine import Machine, machine, machine_id
from .search import Trial, TuneResult, describe, model_plan, rank, tune, tuned_plan
from .space import Space, plan_from_params, plan_params, space
from .store import DatabaseError
from .work import Work, rule_work

__all__ = ["DatabaseError", "Estimate", "Machine", "Param", "Space", "Trial", "TuneResult",
           "TuningDB", "Work", "cache_dir", "describe", "entry_key", "machine", "machine_id",
           "model_plan", "plan_from_params", "plan_params", "predict", "rank", "rule_work",
           "shape_geometry", "space", "spec_key", "tune", "tuned_plan"]
