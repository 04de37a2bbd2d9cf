"""A job's state as data: the state document, checkpoints of it, and the planner's journal.

- :mod:`overlord.state.format`: the versioned JSON document a checkpoint holds.
- :mod:`overlord.state.checkpoint`: atomic saves, the newest checkpoint, loads and checks.
- :mod:`overlord.state.journal`: the planner's write-ahead record, replayed on restart.
"""
