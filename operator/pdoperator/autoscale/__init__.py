"""Autoscaling: the planner that sizes prefill and decode together (``planner``)."""
