"""Order in which waiting requests are admitted, optionally cache-aware.

A waiting request is any object with `match_key: list[int]`, `namespace: str | None` and
`arrival_time: float` (`time.monotonic()` seconds). The policy only reads the cache
(`peek_prefix`), so ordering never changes the tree's shape or its LRU order.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from strand.radix_cache.cache import RadixCache, TreeNode

POLICIES = ("lpm", "dfs-weight", "fcfs", "random")


class SchedulePolicy:
    """lpm: longest cached prefix first; fcfs once more than `lpm_fallback_queue_len` wait.
    dfs-weight: requests grouped by the tree node their match ends in, tree walked depth-first,
    heaviest subtree (most waiting requests) first, a node's own requests after its subtree's.
    lpm and dfs-weight: a request waiting longer than `aging_seconds` goes before all others
    (fcfs among such), so a request sharing nothing is not starved.
    fcfs: by arrival time. random: shuffled with a `random.Random(seed)` owned by the policy.
    With the cache disabled every policy but random is fcfs.
    """

    def __init__(self, policy: str, cache: RadixCache, lpm_fallback_queue_len: int = 128,
                 aging_seconds: float = 5.0, *, seed: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r}; expected one of {POLICIES}")
        self.policy = policy
        self.cache = cache
        self.lpm_fallback_queue_len = lpm_fallback_queue_len
        self.aging_seconds = aging_seconds
        self._rng = random.Random(seed)
        self._clock = clock

    def order(self, waiting: list) -> list:
        """The waiting requests in admission order (a new list; `waiting` is not modified)."""
        if self.policy == "random":
            shuffled = list(waiting)
            self._rng.shuffle(shuffled)
            return shuffled
        if (self.policy == "fcfs" or self.cache.disable
                or (self.policy == "lpm" and len(waiting) > self.lpm_fallback_queue_len)):
            return _fcfs(waiting)
        now = self._clock()
        aged = [r for r in waiting if now - r.arrival_time > self.aging_seconds]
        fresh = [r for r in waiting if now - r.arrival_time <= self.aging_seconds]
        if self.policy == "lpm":
            lens = {id(r): self.cache.peek_prefix_len(r.match_key, r.namespace) for r in fresh}
            fresh.sort(key=lambda r: (-lens[id(r)], r.arrival_time))
        else:
            fresh = self._dfs_weight(fresh)
        return _fcfs(aged) + fresh

    def _dfs_weight(self, reqs: list) -> list:
        groups: dict[TreeNode, list[Any]] = {}
        for r in _fcfs(reqs):
            _, node = self.cache.peek_prefix(r.match_key, r.namespace)
            groups.setdefault(node, []).append(r)
        # weight: waiting requests in the subtree; first: earliest arrival there (tie-break).
        weight: dict[TreeNode, int] = {}
        first: dict[TreeNode, float] = {}
        for node, group in groups.items():
            t = group[0].arrival_time
            while node is not None:
                weight[node] = weight.get(node, 0) + len(group)
                first[node] = min(first.get(node, t), t)
                node = node.parent

        def heaviest_first(nodes: list[TreeNode]) -> list[TreeNode]:
            return sorted(nodes, key=lambda n: (-weight[n], first[n]))

        # Post-order: a subtree's deeper (longer-matching) requests before the node's own.
        out: list[Any] = []
        stack = [(n, False) for n in heaviest_first([n for n in weight if n.parent is None])[::-1]]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                out.extend(groups.get(node, ()))
                continue
            stack.append((node, True))
            children = [c for c in node.children.values() if c in weight]
            stack.extend((c, False) for c in heaviest_first(children)[::-1])
        return out

def _fcfs(reqs: list) -> list:
    return sorted(reqs, key=lambda r: r.arrival_time)
