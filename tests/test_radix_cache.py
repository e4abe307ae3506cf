"""RadixCache: unit tests, then a hypothesis state machine against a plain reference model."""

from collections import Counter

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from strand.radix_cache import CacheStats, MatchResult, RadixCache, TreeNode


class FakeAllocator:
    """Slots 0..n-1; records every slot given back and checks none is freed twice."""

    def __init__(self, n: int = 0) -> None:
        # Unit tests use n=0 and make up slot ids; those ids come back through `free`.
        self.n = n
        self.free: list[int] = list(range(n))
        self.freed_log: list[int] = []

    def alloc(self, k: int) -> torch.Tensor | None:
        if k > len(self.free):
            return None
        out, self.free = self.free[:k], self.free[k:]
        return torch.tensor(out, dtype=torch.int64)

    def __call__(self, slots: torch.Tensor) -> None:
        assert slots.dtype == torch.int64 and slots.dim() == 1
        ids = slots.tolist()
        assert len(set(ids)) == len(ids), f"slot freed twice in one call: {ids}"
        assert not set(ids) & set(self.free), f"double free: {set(ids) & set(self.free)}"
        self.free.extend(ids)
        self.freed_log.extend(ids)


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def path_key(node: TreeNode) -> tuple:
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(tok for part in reversed(parts) for tok in part)


def tree_slots(cache: RadixCache) -> list[int]:
    return [s for node in cache._iter_nodes() for s in node.value.tolist()]


# ---- unit tests ---------------------------------------------------------------------------------

def test_match_on_empty_tree():
    cache = RadixCache(FakeAllocator())
    for ns in (None, "a"):
        m = cache.match_prefix([1, 2, 3], namespace=ns)
        assert isinstance(m, MatchResult)
        assert m.slots.dtype == torch.int64 and m.slots.numel() == 0
        assert m.last_node.is_root
    assert cache.match_prefix([]).slots.numel() == 0
    assert cache.peek_prefix_len([1, 2]) == 0
    assert cache.total_size == 0 and cache.stats().num_nodes == 0


def test_split_mid_node():
    cache = RadixCache(FakeAllocator())
    assert cache.insert([1, 2, 3, 4, 5], t(10, 11, 12, 13, 14)) == 0
    assert cache.stats().num_nodes == 1
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.slots.tolist() == [10, 11, 12]
    assert m.last_node.key == (1, 2, 3) and path_key(m.last_node) == (1, 2, 3)
    (child,) = m.last_node.children.values()
    assert child.key == (4, 5) and child.value.tolist() == [13, 14]
    assert cache.stats().num_nodes == 2 and cache.total_size == 5
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == [10, 11, 12, 13, 14]
    cache._check_invariants()


def test_peek_does_not_split_or_touch():
    cache = RadixCache(FakeAllocator())
    cache.insert([1, 2, 3, 4], t(0, 1, 2, 3))
    before = cache.pretty_print()
    assert cache.peek_prefix_len([1, 2, 7]) == 2
    n, node = cache.peek_prefix([1, 2, 7])
    assert n == 2 and node.key == (1, 2, 3, 4)       # the node the match ends inside of
    assert cache.pretty_print() == before


def test_insert_frees_exactly_the_duplicate_slots():
    alloc = FakeAllocator()
    cache = RadixCache(alloc)
    cache.insert([1, 2, 3, 4], t(0, 1, 2, 3))
    # Same ids as the tree for tokens 1,2 (kept); 7,8 duplicate tokens 3,4 (freed); 9,10 stored.
    assert cache.insert([1, 2, 3, 4, 5, 6], t(0, 1, 7, 8, 9, 10)) == 4
    assert sorted(alloc.freed_log) == [7, 8]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == [0, 1, 2, 3, 9, 10]
    # A key entirely inside the tree, all slots duplicates; no split is made for it.
    assert cache.insert([1, 2, 3], t(20, 21, 22)) == 3
    assert sorted(alloc.freed_log) == [7, 8, 20, 21, 22]
    assert cache.total_size == 6
    cache._check_invariants()


def test_insert_branches_off_mid_node():
    alloc = FakeAllocator()
    cache = RadixCache(alloc)
    cache.insert([1, 2, 3, 4], t(0, 1, 2, 3))
    assert cache.insert([1, 2, 9], t(0, 1, 5)) == 2
    assert alloc.freed_log == []
    assert cache.match_prefix([1, 2, 9]).slots.tolist() == [0, 1, 5]
    assert cache.match_prefix([1, 2, 3, 4]).slots.tolist() == [0, 1, 2, 3]
    assert cache.stats().num_nodes == 3 and cache.total_size == 5
    cache._check_invariants()


def test_insert_validates_lengths_and_accepts_tensor_keys():
    cache = RadixCache(FakeAllocator())
    with pytest.raises(ValueError, match="3 tokens"):
        cache.insert([1, 2, 3], t(0, 1))
    assert cache.insert(torch.tensor([1, 2]), t(0, 1)) == 0
    assert cache.match_prefix(torch.tensor([1, 2, 3])).slots.tolist() == [0, 1]
    assert cache.insert([], t()) == 0


def test_slots_stored_as_int64_copies():
    alloc = FakeAllocator()
    cache = RadixCache(alloc, device="cpu")
    row = torch.tensor([5, 6, 7], dtype=torch.int32)
    cache.insert([1, 2, 3], row)
    row[:] = 0                                         # the caller reuses its row
    m = cache.match_prefix([1, 2, 3])
    assert m.slots.dtype == torch.int64 and m.slots.tolist() == [5, 6, 7]
    cache.evict(3)
    assert alloc.freed_log == [5, 6, 7]


def test_lock_protects_from_evict():
    alloc = FakeAllocator()
    cache = RadixCache(alloc)
    cache.insert([1, 2, 3], t(0, 1, 2))
    cache.insert([5, 6], t(3, 4))
    m = cache.match_prefix([1, 2])           # splits [1 2 3] -> [1 2] + [3]
    cache.inc_lock_ref(m.last_node)
    assert (cache.protected_size, cache.evictable_size) == (2, 3)
    assert cache.evict(100) == 3
    assert sorted(alloc.freed_log) == [2, 3, 4]
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == [0, 1]
    assert cache.evict(100) == 0
    cache.dec_lock_ref(m.last_node)
    assert (cache.protected_size, cache.evictable_size) == (0, 2)
    assert cache.evict(1) == 2
    assert sorted(alloc.free) == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(m.last_node)      # evicted
    with pytest.raises(RuntimeError):
        cache.inc_lock_ref(m.last_node)


def test_lock_counts_nest_and_survive_a_split():
    cache = RadixCache(FakeAllocator())
    cache.insert([1, 2, 3, 4, 5, 6], t(0, 1, 2, 3, 4, 5))
    full = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    cache.inc_lock_ref(full)
    cache.inc_lock_ref(full)
    half = cache.match_prefix([1, 2, 3]).last_node   # splits the locked node
    assert path_key(full) == (1, 2, 3, 4, 5, 6)      # the caller's node still means the same prefix
    assert half.lock_ref == 2 and cache.protected_size == 6
    cache._check_invariants()
    cache.dec_lock_ref(full)
    assert cache.protected_size == 6
    cache.dec_lock_ref(full)
    assert (cache.protected_size, cache.evictable_size) == (0, 6)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(full)
    cache._check_invariants()
    cache.inc_lock_ref(half.parent)                   # the root: no-op
    assert cache.protected_size == 0


def test_evict_in_lru_order():
    alloc = FakeAllocator()
    cache = RadixCache(alloc)
    cache.insert([1, 1], t(0, 1))      # A
    cache.insert([2, 2], t(2, 3))      # B
    cache.insert([3, 3], t(4, 5))      # C
    cache.match_prefix([1, 1])         # A is now the most recent
    assert cache.evict(2) == 2 and alloc.freed_log == [2, 3]          # B
    assert cache.evict(1) == 2 and alloc.freed_log[2:] == [4, 5]      # C, whole node
    assert cache.evict(5) == 2 and alloc.freed_log[4:] == [0, 1]      # A, then nothing left
    assert cache.stats().evicted_tokens == 6


def test_evict_parent_follows_its_last_child():
    alloc = FakeAllocator()
    cache = RadixCache(alloc)
    cache.insert([1, 2, 3], t(0, 1, 2))
    cache.insert([1, 2, 4], t(0, 1, 3))      # [1 2] -> [3], [4]
    cache.insert([7], t(9))
    cache.match_prefix([7])                   # [7] is the most recent
    assert cache.evict(3) == 4               # whole nodes: 1 + 1 + 2
    assert alloc.freed_log == [2, 3, 0, 1]    # both leaves, then the parent they leave childless
    assert cache.match_prefix([7]).slots.tolist() == [9]
    cache._check_invariants()


def test_counters_exact():
    cache = RadixCache(FakeAllocator())
    cache.insert([1, 2, 3, 4], t(0, 1, 2, 3))
    cache.insert([1, 2, 5], t(0, 1, 4))
    s = cache.stats()
    assert (s.total_size, s.evictable_size, s.protected_size, s.num_nodes) == (5, 5, 0, 3)
    m = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(m.last_node)           # locks [1 2] and [3]; [4], [5] stay evictable
    s = cache.stats()
    assert (s.total_size, s.evictable_size, s.protected_size, s.num_nodes) == (5, 2, 3, 4)
    assert cache.evict(10) == 2
    s = cache.stats()
    assert (s.total_size, s.evictable_size, s.protected_size, s.num_nodes) == (3, 0, 3, 2)
    cache.dec_lock_ref(m.last_node)
    assert (cache.total_size, cache.evictable_size, cache.protected_size) == (3, 3, 0)
    cache._check_invariants()


def test_stats_hit_rate():
    cache = RadixCache(FakeAllocator())
    assert cache.stats().hit_rate == 0.0
    cache.record_hit(3, 4)
    cache.record_hit(0, 4)
    s = cache.stats()
    assert isinstance(s, CacheStats)
    assert (s.hit_tokens, s.query_tokens, s.hit_rate) == (3, 8, 3 / 8)


def test_namespaces_isolated():
    alloc = FakeAllocator()
    cache = RadixCache(alloc)
    cache.insert([1, 2, 3], t(0, 1, 2), namespace="a")
    assert cache.match_prefix([1, 2, 3]).slots.numel() == 0
    assert cache.match_prefix([1, 2, 3], namespace="b").slots.numel() == 0
    assert cache.peek_prefix_len([1, 2, 3], namespace="b") == 0
    assert cache.match_prefix([1, 2, 3], namespace="a").slots.tolist() == [0, 1, 2]
    # The same tokens under another namespace are new, not duplicates.
    assert cache.insert([1, 2, 3], t(3, 4, 5), namespace="b") == 0
    assert cache.insert([1, 2], t(6, 7)) == 0
    assert alloc.freed_log == []
    assert cache.match_prefix([1, 2, 3], namespace="b").slots.tolist() == [3, 4, 5]
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == [6, 7]
    assert cache.total_size == 8
    # Eviction is one LRU across namespaces: touch "a" and "b", so None's leaf is the oldest.
    cache.match_prefix([1, 2, 3], namespace="a")
    cache.match_prefix([1, 2, 3], namespace="b")
    assert cache.evict(1) == 2 and alloc.freed_log == [6, 7]       # None's [1 2]
    cache._check_invariants()


def test_reset_frees_all():
    alloc = FakeAllocator()
    cache = RadixCache(alloc)
    cache.insert([1, 2, 3], t(0, 1, 2))
    cache.insert([1, 2, 4], t(0, 1, 3))
    cache.insert([1, 2], t(4, 5), namespace="x")
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.record_hit(1, 2)
    cache.reset()
    assert sorted(alloc.free) == [0, 1, 2, 3, 4, 5]
    s = cache.stats()
    assert (s.total_size, s.num_nodes, s.hit_tokens) == (0, 0, 1)
    assert cache.match_prefix([1, 2, 3]).slots.numel() == 0
    assert cache.evict(10) == 0
    cache._check_invariants()


def test_disable_mode():
    alloc = FakeAllocator()
    cache = RadixCache(alloc, disable=True)
    assert cache.disable
    assert cache.insert([1, 2, 3], t(0, 1, 2)) == 0
    assert alloc.freed_log == []                       # the caller frees its own slots
    m = cache.match_prefix([1, 2, 3])
    assert m.slots.numel() == 0 and m.last_node.is_root
    cache.inc_lock_ref(m.last_node)
    cache.dec_lock_ref(m.last_node)
    assert cache.peek_prefix_len([1, 2, 3]) == 0
    assert cache.evict(10) == 0
    assert (cache.total_size, cache.evictable_size, cache.protected_size) == (0, 0, 0)
    cache.reset()
    assert alloc.freed_log == []


def test_heap_stays_bounded_under_repeated_access():
    cache = RadixCache(FakeAllocator())
    cache.insert([1, 2, 3], t(0, 1, 2))
    for _ in range(3000):
        cache.match_prefix([1, 2, 3])
    assert len(cache._heap) <= 2 * cache.stats().num_nodes + 1025
    cache._check_invariants()
    assert cache.evict(3) == 3


def test_pretty_print_mentions_namespaces_and_nodes():
    cache = RadixCache(FakeAllocator())
    cache.insert([1, 2, 3], t(0, 1, 2), namespace="tenant")
    out = cache.pretty_print()
    assert "'tenant'" in out and "[1 2 3] len=3" in out


# ---- state machine against a reference model ----------------------------------------------------

N_SLOTS = 40
NAMESPACES = st.sampled_from([None, "a", "b"])
KEYS = st.lists(st.integers(0, 3), min_size=1, max_size=12)


class RadixMachine(RuleBasedStateMachine):
    """Reference: (namespace, token prefix) -> slot, for every cached prefix. The tree caches a
    prefix-closed set per namespace, one slot per token, so the longest match is the longest
    prefix of the key that the reference holds. Evictions are followed through the allocator:
    each freed slot names the prefix that was evicted."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = FakeAllocator(N_SLOTS)
        self.cache = RadixCache(self.alloc)
        self.ref: dict[tuple, int] = {}
        self.owner: dict[int, tuple] = {}          # slot -> (namespace, prefix)
        self.locks: list[tuple] = []               # (node, namespace, prefix)
        self.lock_count: Counter = Counter()       # (namespace, prefix) -> holders

    # -- reference helpers

    def ref_match(self, ns, key) -> list[int]:
        slots = []
        for j in range(len(key)):
            slot = self.ref.get((ns, tuple(key[:j + 1])))
            if slot is None:
                break
            slots.append(slot)
        return slots

    def ref_add(self, ns, key, start: int, slots: list[int]) -> None:
        for j in range(start, len(key)):
            k = (ns, tuple(key[:j + 1]))
            assert k not in self.ref
            self.ref[k] = slots[j]
            self.owner[slots[j]] = k

    def evict(self, n: int) -> int:
        before = len(self.alloc.freed_log)
        freed = self.cache.evict(n)
        ids = self.alloc.freed_log[before:]
        assert len(ids) == freed
        assert freed >= n or self.cache.evictable_size == 0
        for slot in ids:
            k = self.owner.pop(slot)               # KeyError: freed a slot the tree did not own
            assert self.lock_count[k] == 0, f"evicted locked prefix {k}"
            del self.ref[k]
        for ns, prefix in self.ref:                # what is left is still prefix-closed
            assert len(prefix) == 1 or (ns, prefix[:-1]) in self.ref
        return freed

    def alloc_or_evict(self, k: int) -> torch.Tensor | None:
        if len(self.alloc.free) < k:
            self.evict(k - len(self.alloc.free))
        return self.alloc.alloc(k)

    def lock(self, node, ns, prefix) -> None:
        self.cache.inc_lock_ref(node)
        self.locks.append((node, ns, prefix))
        for j in range(len(prefix)):
            self.lock_count[(ns, prefix[:j + 1])] += 1

    def unlock(self, i: int) -> None:
        node, ns, prefix = self.locks.pop(i)
        self.cache.dec_lock_ref(node)
        for j in range(len(prefix)):
            self.lock_count[(ns, prefix[:j + 1])] -= 1

    # -- rules

    @rule(key=KEYS, ns=NAMESPACES)
    def match(self, key, ns):
        m = self.cache.match_prefix(key, ns)
        assert m.slots.tolist() == self.ref_match(ns, key)
        assert path_key(m.last_node) == tuple(key[:m.slots.numel()])

    @rule(key=KEYS, ns=NAMESPACES)
    def peek(self, key, ns):
        nodes = self.cache.stats().num_nodes
        assert self.cache.peek_prefix_len(key, ns) == len(self.ref_match(ns, key))
        assert self.cache.stats().num_nodes == nodes

    @rule(key=KEYS, ns=NAMESPACES)
    def insert_after_match(self, key, ns):
        """The scheduler's way: match, lock the prefix, allocate the rest, insert, unlock."""
        m = self.cache.match_prefix(key, ns)
        n = m.slots.numel()
        self.lock(m.last_node, ns, tuple(key[:n]))
        new = self.alloc_or_evict(len(key) - n)
        if new is not None:
            before = len(self.alloc.freed_log)
            assert self.cache.insert(key, torch.cat([m.slots, new]), ns) == n
            assert len(self.alloc.freed_log) == before         # nothing was a duplicate
            self.ref_add(ns, key, n, m.slots.tolist() + new.tolist())
        self.unlock(len(self.locks) - 1)

    @rule(key=KEYS, ns=NAMESPACES)
    def insert_fresh(self, key, ns):
        """Two requests computed the same prefix: the second's slots for it are duplicates."""
        new = self.alloc_or_evict(len(key))
        if new is None:
            return
        cached = len(self.ref_match(ns, key))
        before = len(self.alloc.freed_log)
        assert self.cache.insert(key, new, ns) == cached
        assert sorted(self.alloc.freed_log[before:]) == sorted(new[:cached].tolist())
        self.ref_add(ns, key, cached, new.tolist())

    @rule(key=KEYS, ns=NAMESPACES)
    def lock_prefix(self, key, ns):
        m = self.cache.match_prefix(key, ns)
        self.lock(m.last_node, ns, tuple(key[:m.slots.numel()]))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 1000))
    def unlock_one(self, i):
        self.unlock(i % len(self.locks))

    @rule(n=st.integers(0, 20))
    def evict_some(self, n):
        self.evict(n)

    @precondition(lambda self: not self.locks)
    @rule()
    def reset(self):
        self.cache.reset()
        self.ref.clear()
        self.owner.clear()
        assert sorted(self.alloc.free) == list(range(N_SLOTS))

    # -- checks after every step

    @invariant()
    def consistent(self):
        self.cache._check_invariants()
        c = self.cache
        locked = sum(1 for k in self.ref if self.lock_count[k] > 0)
        assert c.total_size == len(self.ref) == c.evictable_size + c.protected_size
        assert c.protected_size == locked
        in_tree = tree_slots(c)
        assert sorted(in_tree) == sorted(self.ref.values())
        assert sorted(in_tree + self.alloc.free) == list(range(N_SLOTS))   # each slot once

    def teardown(self):
        while self.locks:
            self.unlock(len(self.locks) - 1)
        self.evict(10**9)
        assert self.cache.total_size == 0 and self.cache.stats().num_nodes == 0
        assert sorted(self.alloc.free) == list(range(N_SLOTS))


RadixMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30,
                                          deadline=None)
TestRadixMachine = RadixMachine.TestCase
