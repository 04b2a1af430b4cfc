"""A prefix cache as a tree: each edge is one full block of tokens, each node the block holding it.

The path from the root to a node spells a prefix, one ``block_size`` tuple of token ids per
edge, so a lookup walks down the tree block by block; two prompts sharing a system prompt
share the path's first nodes and branch where they differ. This is the shape of SGLang's radix
tree (with edges fixed at one block rather than compressed runs of tokens) and answers exactly
what ``HashPrefixCache`` answers.

An evicted node whose subtree still caches blocks stays as a placeholder without a block, so
the blocks below it come back into reach when that prefix is cached again, as they do in the
hash backend. An empty leaf is removed.
"""

from __future__ import annotations

from typing import Sequence

from infra_lib.serving.prefix_cache import PrefixCache


class _Node:
    __slots__ = ("key", "parent", "children", "block_id")

    def __init__(self, key: tuple[int, ...], parent: "_Node | None"):
        self.key, self.parent = key, parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.block_id: int | None = None


class RadixPrefixCache(PrefixCache):
    """A tree of block-sized token tuples; ``_node_of`` finds a cached block's node for eviction."""

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.root = _Node((), None)
        self._node_of: dict[int, _Node] = {}

    def _edges(self, token_ids: Sequence[int], count: int):
        bs = self.block_size
        return (tuple(int(t) for t in token_ids[i * bs : (i + 1) * bs]) for i in range(count))

    def longest_prefix(self, token_ids, max_blocks):
        hits, node = [], self.root
        for key in self._edges(token_ids, min(max_blocks, len(token_ids) // self.block_size)):
            node = node.children.get(key)
            if node is None or node.block_id is None:
                break
            hits.append(node.block_id)
        return hits

    def insert(self, token_ids, block_ids):
        keys = list(self._edges(token_ids, self._full_blocks(token_ids, block_ids)))
        node = self.root
        for key, b in zip(keys, block_ids):  # check first, so a refused insert changes nothing
            node = node.children.get(key) if node is not None else None
            if b in self._node_of and self._node_of[b] is not node:
                raise ValueError(f"block {b} already caches another prefix; evict it before reusing it")
        node = self.root
        for key, b in zip(keys, block_ids):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, node)
            if child.block_id is None:
                child.block_id, self._node_of[b] = b, child
            node = child

    def evict(self, block_id):
        node = self._node_of.pop(block_id, None)
        if node is None:
            return False
        node.block_id = None
        while node is not self.root and node.block_id is None and not node.children:
            del node.parent.children[node.key]
            node = node.parent
        return True

    def is_cached(self, block_id):
        return block_id in self._node_of

    def cached_blocks(self):
        return set(self._node_of)

    def num_nodes(self) -> int:
        """Nodes below the root, placeholders included."""
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            count += len(node.children)
            stack.extend(node.children.values())
        return count

    def check_invariants(self):
        seen: dict[int, _Node] = {}
        stack = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            for key, child in node.children.items():
                if child.key != key or child.parent is not node:
                    raise AssertionError(f"node at depth {depth + 1} is linked under the wrong key or parent")
                if len(key) != self.block_size:
                    raise AssertionError(f"an edge holds {len(key)} tokens, not a block of {self.block_size}")
                if child.block_id is None and not child.children:
                    raise AssertionError(f"an empty leaf at depth {depth + 1} was not pruned")
                if child.block_id is not None:
                    if child.block_id in seen:
                        raise AssertionError(f"block {child.block_id} sits at two nodes")
                    seen[child.block_id] = child
                stack.append((child, depth + 1))
        if self.root.block_id is not None:
            raise AssertionError("the root holds a block")
        if seen.keys() != self._node_of.keys() or any(self._node_of[b] is not n for b, n in seen.items()):
            raise AssertionError(f"tree blocks {sorted(seen)} disagree with the index {sorted(self._node_of)}")
