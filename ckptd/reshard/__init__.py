"""Resharding: layout specs, pure layouts and planner, and the streaming executor."""
