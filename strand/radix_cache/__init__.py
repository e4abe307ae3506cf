"""Prefix tree over token ids -> KV slots; LRU eviction; cache-aware request ordering.

Imports nothing else of Strand (torch and the stdlib only).
"""

from strand.radix_cache.cache import CacheStats, MatchResult, RadixCache, TreeNode
from strand.radix_cache.policy import SchedulePolicy

__all__ = ["CacheStats", "MatchResult", "RadixCache", "SchedulePolicy", "TreeNode"]
