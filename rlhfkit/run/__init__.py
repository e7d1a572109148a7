"""Run assembly, the loop skeleton every trainer shares, and the pause points tests use."""
