"""Checkpoints of a job's data state: save, find the newest, load, and check against a plan.

The public home of :mod:`overlord.state.checkpoint`, where the files are written and read
(the state document itself is :mod:`overlord.state.format`)::

    from overlord import checkpoint

    path = checkpoint.save("ckpt", loader.state_dict())
    state = checkpoint.load(checkpoint.latest("ckpt"))

``classify(state, plan, before=None)`` says what resuming ``state`` with a changed
``plan`` would do, change by change (:mod:`overlord.state.changes`).
"""

from overlord.state.changes import classify
from overlord.state.checkpoint import check_state, latest, load, save

__all__ = ["check_state", "classify", "latest", "load", "save"]
