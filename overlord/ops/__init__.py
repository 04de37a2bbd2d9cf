"""Operator tools: the ``overlord`` command, the demo, run reports and the live status table.

Nothing else in the package imports these modules.
"""
