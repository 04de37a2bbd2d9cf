"""Monitoring: the figures the planner counts and the Prometheus endpoint that shows them."""
