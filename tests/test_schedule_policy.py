"""SchedulePolicy: lpm, dfs-weight, fcfs, random, over a small RadixCache."""

from dataclasses import dataclass

import pytest
import torch

from strand.radix_cache import RadixCache, SchedulePolicy


@dataclass
class Req:
    name: str
    match_key: list
    arrival_time: float
    namespace: str | None = None


def names(reqs):
    return [r.name for r in reqs]


def make_cache(*keys, disable=False, namespace=None):
    cache = RadixCache(lambda slots: None, disable=disable)
    next_slot = 0
    for key in keys:
        cache.insert(key, torch.arange(next_slot, next_slot + len(key)), namespace)
        next_slot += len(key)
    return cache


def policy(name, cache, now=10.0, aging_seconds=1000.0, **kw):
    """A policy whose clock reads `now`; nothing ages unless a test asks for it."""
    return SchedulePolicy(name, cache, aging_seconds=aging_seconds, clock=lambda: now, **kw)


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="'shortest-job'"):
        SchedulePolicy("shortest-job", make_cache())


def test_lpm_orders_by_match_length_then_arrival():
    cache = make_cache([1, 2, 3, 4, 5], [7, 7])
    waiting = [Req("none", [9, 9], 1.0), Req("two", [1, 2, 8], 2.0),
               Req("five", [1, 2, 3, 4, 5, 6], 3.0), Req("two-b", [7, 7, 1], 4.0),
               Req("one", [1, 9], 5.0)]
    assert names(policy("lpm", cache).order(waiting)) == ["five", "two", "two-b", "one", "none"]
    assert names(waiting) == ["none", "two", "five", "two-b", "one"]      # input untouched


def test_lpm_is_read_only():
    cache = make_cache([1, 2, 3, 4], [1, 2, 5])
    before, nodes = cache.pretty_print(), cache.stats().num_nodes
    policy("lpm", cache).order([Req("a", [1, 2, 3, 9], 1.0), Req("b", [1], 2.0)])
    policy("dfs-weight", cache).order([Req("a", [1, 2, 3, 9], 1.0), Req("b", [1], 2.0)])
    assert cache.pretty_print() == before and cache.stats().num_nodes == nodes


def test_lpm_respects_namespaces():
    cache = make_cache([1, 2, 3], namespace="a")
    waiting = [Req("b", [1, 2, 3], 1.0, "b"), Req("a", [1, 2, 3], 2.0, "a")]
    assert names(policy("lpm", cache).order(waiting)) == ["a", "b"]


def test_lpm_falls_back_to_fcfs_past_threshold():
    cache = make_cache([1, 2, 3])
    waiting = [Req("x", [9], 1.0), Req("y", [8], 2.0), Req("hit", [1, 2, 3], 3.0)]
    assert names(policy("lpm", cache, lpm_fallback_queue_len=3).order(waiting))[0] == "hit"
    assert names(policy("lpm", cache, lpm_fallback_queue_len=2).order(waiting)) == [
        "x", "y", "hit"]


def test_aging_lets_an_old_request_go_first():
    cache = make_cache([1, 2, 3])
    waiting = [Req("hit", [1, 2, 3], 9.0), Req("old-b", [8], 2.0), Req("old-a", [9], 1.0),
               Req("fresh-miss", [7], 9.5)]
    for name in ("lpm", "dfs-weight"):
        order = names(policy(name, cache, now=10.0, aging_seconds=5.0).order(waiting))
        assert order[:3] == ["old-a", "old-b", "hit"], name
    # Not yet aged: the match wins.
    assert names(policy("lpm", cache, now=5.0, aging_seconds=5.0).order(waiting))[0] == "hit"


def test_dfs_weight_keeps_subtrees_together_heaviest_first():
    # Tree: [1 1 1] -> {[2 2], [3 3]}; [5 5 5]
    cache = make_cache([1, 1, 1, 2, 2], [1, 1, 1, 3, 3], [5, 5, 5])
    waiting = [
        Req("five-1", [5, 5, 5, 0], 1.0),
        Req("two-1", [1, 1, 1, 2, 2, 0], 2.0),
        Req("three-1", [1, 1, 1, 3, 3, 0], 3.0),
        Req("five-2", [5, 5, 5, 1], 4.0),
        Req("two-2", [1, 1, 1, 2, 2, 1], 5.0),
        Req("miss", [8], 6.0),
        Req("two-3", [1, 1, 1, 2, 9], 7.0),     # ends part-way into [2 2]: same subtree
        Req("ones", [1, 1, 1, 4], 8.0),
    ]
    order = names(policy("dfs-weight", cache).order(waiting))
    # [1 1 1] (weight 5) before [5 5 5] (weight 2); inside it [2 2] (3) before [3 3] (1), then
    # its own request; the request that matches nothing (the root's own) comes last.
    assert order == ["two-1", "two-2", "two-3", "three-1", "ones", "five-1", "five-2", "miss"]


def test_dfs_weight_separates_namespaces():
    cache = make_cache([1, 1], namespace="a")
    cache.insert([1, 1], torch.tensor([10, 11]), namespace="b")
    waiting = [Req("a1", [1, 1, 0], 1.0, "a"), Req("b1", [1, 1, 0], 2.0, "b"),
               Req("a2", [1, 1, 2], 3.0, "a"), Req("b2", [1, 1, 2], 4.0, "b"),
               Req("b3", [1, 1, 3], 5.0, "b")]
    assert names(policy("dfs-weight", cache).order(waiting)) == ["b1", "b2", "b3", "a1", "a2"]


def test_fcfs_orders_by_arrival():
    cache = make_cache([1, 2, 3])
    waiting = [Req("c", [1, 2, 3], 3.0), Req("a", [9], 1.0), Req("b", [1], 2.0)]
    assert names(policy("fcfs", cache).order(waiting)) == ["a", "b", "c"]


def test_random_is_a_seeded_permutation():
    cache = make_cache()
    waiting = [Req(str(i), [i], float(i)) for i in range(20)]
    first = names(policy("random", cache, seed=1).order(waiting))
    assert sorted(first, key=int) == names(waiting)
    assert first != names(waiting)
    assert names(policy("random", cache, seed=1).order(waiting)) == first
    p = policy("random", cache, seed=1)
    assert names(p.order(waiting)) == first and names(p.order(waiting)) != first


def test_disabled_cache_degrades_to_fcfs():
    cache = make_cache([1, 2, 3], disable=True)
    waiting = [Req("hit", [1, 2, 3], 3.0), Req("a", [9], 1.0), Req("b", [1], 2.0)]
    for name in ("lpm", "dfs-weight", "fcfs"):
        assert names(policy(name, cache).order(waiting)) == ["a", "b", "hit"], name
    assert sorted(names(policy("random", cache).order(waiting))) == ["a", "b", "hit"]
