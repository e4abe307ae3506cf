"""Radix tree over token ids -> KV slot ids, with lock counts and LRU eviction.

The tree owns the KV slots it stores: they go back to the allocator through `free_slots` when a
node is evicted, when `reset()` empties the tree, and when `insert` is handed slots that duplicate
tokens the tree already holds. Slots handed out by `match_prefix` stay owned by the tree; a caller
that uses them must `inc_lock_ref(last_node)` so eviction cannot free them under it.

Each namespace (tenant salt) has its own root, so a prefix is shared only inside one namespace.
Eviction is global: one LRU heap over the leaves of every namespace. Access times come from a
monotonic counter, not the wall clock, so the order is deterministic.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

Key = tuple[int, ...]


class TreeNode:
    """One edge of the radix tree: a run of tokens and the KV slots that hold them.

    `lock_ref` counts the lock holders at or below this node; a node with `lock_ref > 0` is never
    evicted. A root (`parent is None`) holds no tokens and is never locked or evicted.
    """

    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access",
                 "namespace", "evicted")

    def __init__(self, key: Key, value: torch.Tensor, parent: TreeNode | None,
                 namespace: str | None, last_access: int = 0) -> None:
        self.key = key                                  # token ids on this edge
        self.value = value                              # [len(key)] int64 KV slot ids
        self.parent = parent
        self.children: dict[int, TreeNode] = {}         # first token -> child
        self.lock_ref = 0
        self.last_access = last_access
        self.namespace = namespace
        self.evicted = False

    @property
    def is_root(self) -> bool:
        return self.parent is None and not self.evicted

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        head = list(self.key[:8])
        more = "..." if len(self.key) > 8 else ""
        return (f"TreeNode(ns={self.namespace!r}, key={head}{more}, len={len(self.key)}, "
                f"lock_ref={self.lock_ref}, last_access={self.last_access})")


@dataclass(frozen=True, eq=False)
class MatchResult:
    slots: torch.Tensor         # [match_len] int64 KV slot ids of the matched prefix
    last_node: TreeNode         # deepest node of the match; lock it to keep the slots alive


@dataclass
class CacheStats:
    hit_tokens: int
    query_tokens: int
    evicted_tokens: int
    num_nodes: int
    total_size: int
    evictable_size: int
    protected_size: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def _as_key(key: Sequence[int] | torch.Tensor) -> Key:
    if isinstance(key, torch.Tensor):
        return tuple(key.tolist())
    return tuple(key)


def _common_len(key: Key, start: int, edge: Key) -> int:
    """Length of the common prefix of key[start:] and edge."""
    n = len(edge)
    if key[start:start + n] == edge:     # the usual case, compared in C
        return n
    n = min(n, len(key) - start)
    i = 0
    while i < n and key[start + i] == edge[i]:
        i += 1
    return i


class RadixCache:
    """Prefix cache over token ids. See the module docstring for who owns which slots."""

    def __init__(self, free_slots: Callable[[torch.Tensor], None], disable: bool = False,
                 device: torch.device | str | None = None) -> None:
        """`free_slots(int64 [n] slot ids)` gives slots back to the KV allocator.

        `device`: where stored slots live; None keeps each inserted tensor on its own device
        (then empty match results are on the CPU).
        """
        self._free_slots = free_slots
        self._disable = disable
        self.device = torch.device(device) if device is not None else None
        self._clock = itertools.count(1)           # LRU time: a counter, not wall time
        self._seq = itertools.count()              # heap tie-break, so nodes are never compared
        self._hit_tokens = 0
        self._query_tokens = 0
        self._evicted_tokens = 0
        self._clear()

    def _clear(self) -> None:
        self._roots: dict[str | None, TreeNode] = {}
        self._default_root = self._root(None)
        # (last_access, seq, node) for leaves; stale entries are skipped when popped.
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._evictable_size = 0
        self._protected_size = 0
        self._num_nodes = 0

    # ---- sizes ---------------------------------------------------------------------------------

    @property
    def disable(self) -> bool:
        return self._disable

    @property
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes."""
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected_size

    @property
    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def stats(self) -> CacheStats:
        return CacheStats(hit_tokens=self._hit_tokens, query_tokens=self._query_tokens,
                          evicted_tokens=self._evicted_tokens, num_nodes=self._num_nodes,
                          total_size=self.total_size, evictable_size=self._evictable_size,
                          protected_size=self._protected_size)

    def record_hit(self, matched: int, queried: int) -> None:
        """Count one admitted request: `matched` of its `queried` prompt tokens came from cache."""
        self._hit_tokens += matched
        self._query_tokens += queried

    # ---- lookup --------------------------------------------------------------------------------

    def match_prefix(self, key: Sequence[int], namespace: str | None = None) -> MatchResult:
        """Longest cached prefix of `key` within `namespace`.

        Mutates: splits the node the match ends inside of, so `last_node` ends exactly at the
        match; marks every node on the path as just used. Locks nothing: call
        `inc_lock_ref(result.last_node)` before anything can evict. Disabled: empty, root.
        """
        if self._disable:
            return MatchResult(self._empty(), self._default_root)
        key = _as_key(key)
        root = self._roots.get(namespace)
        if root is None or not key:
            return MatchResult(self._empty(), root if root is not None else self._default_root)
        now = next(self._clock)
        node, i, values = root, 0, []
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = _common_len(key, i, child.key)
            if n < len(child.key):
                child = self._split(child, n)    # the next lookup then misses and ends the walk
            values.append(child.value)
            self._touch(child, now)
            node, i = child, i + n
        slots = torch.cat(values) if values else self._empty()
        return MatchResult(slots, node)

    def peek_prefix_len(self, key: Sequence[int], namespace: str | None = None) -> int:
        """Length of the longest cached prefix of `key`; changes neither shape nor LRU."""
        return self.peek_prefix(key, namespace)[0]

    def peek_prefix(self, key: Sequence[int],
                    namespace: str | None = None) -> tuple[int, TreeNode]:
        """(match length, node the match ends in) without changing the tree.

        The node is the one the match ends inside of (a match may stop part-way along its edge),
        or the namespace root when nothing matches. Returns (0, default root) when disabled.
        """
        if self._disable:
            return 0, self._default_root
        key = _as_key(key)
        root = self._roots.get(namespace)
        if root is None:
            return 0, self._default_root
        node, i = root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = _common_len(key, i, child.key)
            node, i = child, i + n
            if n < len(child.key):
                break
        return i, node

    # ---- insert --------------------------------------------------------------------------------

    def insert(self, key: Sequence[int], slots: torch.Tensor,
               namespace: str | None = None) -> int:
        """Add `key -> slots` in `namespace`; returns how many leading tokens were already cached.

        Ownership: after the call the caller owns none of `slots`. New tokens' slots are stored.
        For the already-cached prefix, caller slots that are the tree's own ids (from an earlier
        `match_prefix`, kept locked until now) stay the tree's; any other id there is a duplicate
        and is freed here through `free_slots`. Slots are stored as int64 (on `self.device` if set).
        Disabled: stores nothing, frees nothing and returns 0 -- the caller still owns all of
        `slots` and must free them itself.
        Raises ValueError if `len(key) != len(slots)`.
        """
        key = _as_key(key)
        if slots.dim() != 1 or len(key) != slots.numel():
            raise ValueError(f"insert: key has {len(key)} tokens but slots has shape "
                             f"{tuple(slots.shape)}")
        if self._disable or not key:
            return 0
        device = self.device if self.device is not None else slots.device
        slots = slots.to(device=device, dtype=torch.int64)
        now = next(self._clock)
        node, i, duplicates = self._root(namespace), 0, []
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                leaf = TreeNode(key[i:], slots[i:].clone(), node, namespace, now)
                node.children[key[i]] = leaf
                self._num_nodes += 1
                self._evictable_size += len(leaf)
                self._push(leaf)
                break
            n = _common_len(key, i, child.key)
            mine = slots[i:i + n]
            duplicates.append(mine[mine != child.value[:n]])
            if n < len(child.key) and i + n < len(key):
                child = self._split(child, n)    # the rest of key branches off below the split
            self._touch(child, now)
            node, i = child, i + n
        if duplicates:
            freed = torch.cat(duplicates)
            if freed.numel():
                self._free_slots(freed)
        return i

    # ---- locks ---------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock `node` and its ancestors (roots excepted) against eviction.

        Raises RuntimeError if `node` was evicted.
        """
        if node.evicted:
            raise RuntimeError(f"inc_lock_ref on an evicted node: {node!r}")
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable_size -= len(node)
                self._protected_size += len(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one `inc_lock_ref(node)`. Raises RuntimeError if `node` is not locked."""
        if node.evicted or (node.parent is not None and node.lock_ref <= 0):
            raise RuntimeError(f"dec_lock_ref on an unlocked node: {node!r}")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected_size -= len(node)
                self._evictable_size += len(node)
                if node.is_leaf:
                    self._push(node)
            node = node.parent

    # ---- eviction ------------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free whole unlocked leaves, least recently used first, until `num_tokens` are freed
        or nothing is evictable; a parent left childless joins the queue. Returns tokens freed
        (may exceed `num_tokens` by the rest of the last node). Frees through `free_slots`.
        """
        freed_tokens, freed = 0, []
        while freed_tokens < num_tokens and self._heap:
            last_access, _, node = heapq.heappop(self._heap)
            if (node.evicted or node.children or node.lock_ref
                    or node.last_access != last_access):
                continue                          # stale entry: a fresher one exists if needed
            parent = node.parent
            del parent.children[node.key[0]]
            node.evicted, node.parent = True, None
            self._num_nodes -= 1
            self._evictable_size -= len(node)
            freed_tokens += len(node)
            freed.append(node.value)
            if parent.parent is None:
                if not parent.children and parent.namespace is not None:
                    del self._roots[parent.namespace]   # forget tenants with nothing cached
            elif parent.is_leaf and parent.lock_ref == 0:
                self._push(parent)
        if freed:
            self._free_slots(torch.cat(freed))
        self._evicted_tokens += freed_tokens
        return freed_tokens

    def reset(self) -> None:
        """Free every slot in the tree and empty it. Raises RuntimeError if anything is locked
        (a running request still reads those slots). Hit/query/evicted counters are kept."""
        if self._protected_size:
            raise RuntimeError(f"reset() while {self._protected_size} tokens are locked")
        values = [n.value for n in self._iter_nodes()]
        for node in self._iter_nodes():
            node.evicted = True
        self._clear()
        if values:
            self._free_slots(torch.cat(values))

    # ---- debugging -----------------------------------------------------------------------------

    def pretty_print(self) -> str:
        lines = [f"RadixCache(total={self.total_size}, evictable={self._evictable_size}, "
                 f"protected={self._protected_size}, nodes={self._num_nodes})"]
        for ns, root in self._roots.items():
            lines.append(f"[namespace {ns!r}]")
            stack = [(c, 1) for c in reversed(list(root.children.values()))]
            while stack:
                node, depth = stack.pop()
                head = " ".join(map(str, node.key[:12])) + (" ..." if len(node) > 12 else "")
                lines.append(f"{'  ' * depth}[{head}] len={len(node)} lock={node.lock_ref} "
                             f"t={node.last_access}")
                stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
        return "\n".join(lines)

    def _check_invariants(self) -> None:
        """Recompute the counters from the tree and compare (tests and debugging only)."""
        evictable = protected = nodes = 0
        queued = {(id(n), t) for t, _, n in self._heap if not n.evicted}
        for node in self._iter_nodes():
            nodes += 1
            assert len(node) > 0 and len(node) == node.value.numel(), node
            assert node.parent.children[node.key[0]] is node, node
            for first, child in node.children.items():
                assert child.key[0] == first and child.lock_ref <= node.lock_ref, child
            if node.lock_ref:
                protected += len(node)
            else:
                evictable += len(node)
                if node.is_leaf:
                    assert (id(node), node.last_access) in queued, f"leaf not queued: {node!r}"
        assert (evictable, protected, nodes) == (
            self._evictable_size, self._protected_size, self._num_nodes), (
            evictable, protected, nodes, self.stats())

    # ---- internals -----------------------------------------------------------------------------

    def _root(self, namespace: str | None) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = TreeNode((), self._empty(), None, namespace)
            self._roots[namespace] = root
        return root

    def _empty(self) -> torch.Tensor:
        device = self.device if self.device is not None else "cpu"
        return torch.empty(0, dtype=torch.int64, device=device)

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut `node` after `n` tokens; returns the new parent holding the first `n`.

        `node` keeps its identity as the lower half, so a caller holding it (e.g. as a locked
        `last_node`) still refers to the same full prefix.
        """
        parent = node.parent
        top = TreeNode(node.key[:n], node.value[:n].clone(), parent, node.namespace,
                       node.last_access)
        top.lock_ref = node.lock_ref     # same lock holders: they are all at or below `node`
        node.key, node.value = node.key[n:], node.value[n:].clone()
        node.parent = top
        top.children[node.key[0]] = node
        parent.children[top.key[0]] = top
        self._num_nodes += 1
        return top

    def _touch(self, node: TreeNode, now: int) -> None:
        node.last_access = now
        if node.is_leaf:
            self._push(node)

    def _push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
        # Lazy deletion leaves stale entries behind; rebuild once they outnumber live nodes.
        if len(self._heap) > 2 * self._num_nodes + 1024:
            self._heap = [(n.last_access, next(self._seq), n) for n in self._iter_nodes()
                          if n.is_leaf and n.lock_ref == 0]
            heapq.heapify(self._heap)

    def _iter_nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, all namespaces."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())
