"""The memory planner behind --dry_run: byte arithmetic, the plan, and advice when it does not fit."""
