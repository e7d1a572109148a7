"""rlhfkit: Ray-based RLHF and post-training for Hugging Face causal LMs."""

from rlhfkit import package_map

__version__ = "0.1.0"

# Before anything imports Transformers: its import-time scan of every installed distribution, from a cache
# (rlhfkit/package_map.py; 0.4-0.6 s of each process's start).
package_map.install()
