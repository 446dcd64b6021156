"""KV-cache blocks: free list, reference counts, block tables and the prefix cache.

The manager only does bookkeeping with block ids; the tensors live in the
model runner. A block is in exactly one of three states:

- free: ref count 0, no hash, on the free list;
- in use: ref count > 0 (shared by every sequence whose table holds it);
- evictable: ref count 0 but still holding a cached full block; it sits in an
  LRU and is reused (dropping its hash) only when the free list is empty.

Prefix caching hashes a block once all of its tokens are computed. The hash
is chained, BLAKE2b over the parent's hash and the block's tokens, so one hash
names the whole prefix up to the end of that block. The hash is cryptographic
because the cache is shared by every tenant: with a fast non-cryptographic
hash (Python's own ``hash``, which reduces integers modulo 2**61 - 1), a
crafted prompt could be made to name another tenant's prefix and be served,
or make that tenant be served, KV computed from other tokens. The block's
tokens are stored as well and compared on lookup.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence as Tokens
from dataclasses import dataclass

from scheduler.sequence import Sequence

ROOT_HASH = b""
"""Parent hash of a sequence's first block."""
HASH_BYTES = 32


@dataclass(frozen=True)
class CachedPrefix:
    """The longest run of cached full blocks matching a sequence's leading tokens."""

    block_ids: list[int]
    block_hashes: list[bytes]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


def chain_hash(parent_hash: bytes, block_token_ids: Tokens[int]) -> bytes:
    """The hash naming the prefix that ends with this block: its parent's hash, then its tokens as 64-bit ints."""
    digest = hashlib.blake2b(parent_hash, digest_size=HASH_BYTES)
    digest.update(array("q", block_token_ids).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}
        """Chained hash -> block id holding that block."""
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0

    # ---- capacity -------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out: truly free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, prefix: CachedPrefix | None = None,
        released: Iterable[Sequence] = (), num_reserved: int = 0,
    ) -> bool:
        """Whether ``num_new_tokens`` more tokens fit, after taking ``prefix`` if given.

        ``released``: sequences whose blocks would be freed first (preemption
        candidates); a block comes back only if no one else holds it.
        ``num_reserved``: free blocks already promised to others (a static group's earlier members).
        """
        num_needed = self.num_new_blocks_needed(seq, num_new_tokens)
        if prefix is None and num_needed <= self.num_free_blocks - num_reserved:
            return True  # releasing sequences only adds free blocks (a decode inside its last block needs none)
        freed = Counter(b for s in released for b in s.block_table)
        num_free = self.num_free_blocks - num_reserved + sum(1 for b, n in freed.items() if self._ref_counts[b] == n)
        if prefix is not None:
            # Taking a hit block that is evictable removes it from the pool.
            num_needed = max(0, self.num_blocks_for(
                prefix.num_blocks * self.block_size + num_new_tokens) - prefix.num_blocks)
            num_free -= sum(1 for b in prefix.block_ids if self._ref_counts[b] == freed[b])
        return num_needed <= num_free

    # ---- prefix cache ---------------------------------------------------

    def lookup_prefix(self, token_ids: list[int], memo: list[bytes] | None = None) -> CachedPrefix:
        """Longest chain of cached full blocks for ``token_ids``, without taking them.

        Never covers the last token: one token must still be computed to get
        the logits the next token is sampled from. ``memo``: the chain hashes of
        these tokens' leading blocks computed so far (a sequence's
        ``token_hashes``), used and extended; tokens are only ever appended, so
        they stay right, and a request waiting at the head of the queue is not
        hashed again every step.
        """
        block_ids: list[int] = []
        hashes: list[bytes] = []
        if not self.enable_prefix_caching:
            return CachedPrefix(block_ids, hashes)
        max_blocks = (len(token_ids) - 1) // self.block_size
        memo = [] if memo is None else memo
        parent = ROOT_HASH
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            if i == len(memo):
                memo.append(chain_hash(parent, tokens))
            h = memo[i]
            block = self._cached.get(h)
            if block is None or self._block_tokens[block] != tokens:
                break
            block_ids.append(block)
            hashes.append(h)
            parent = h
        return CachedPrefix(block_ids, hashes)

    def take_prefix(self, seq: Sequence, prefix: CachedPrefix) -> None:
        """Start an empty sequence's table with the cached blocks; marks their tokens computed."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        for block in prefix.block_ids:
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
        seq.block_table = list(prefix.block_ids)
        seq.block_hashes = list(prefix.block_hashes)
        seq.num_computed_tokens = prefix.num_blocks * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        if self.enable_prefix_caching:
            self.prefix_cache_query_tokens += seq.num_tokens
            self.prefix_cache_hit_tokens += seq.num_cached_tokens

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Hash every block of ``seq`` that has become full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if len(seq.block_hashes) >= num_full:
            return
        token_ids = seq.token_ids
        memo = seq.token_hashes
        for i in range(len(memo), num_full):
            memo.append(chain_hash(memo[-1] if memo else ROOT_HASH, token_ids[i * self.block_size:(i + 1) * self.block_size]))
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = memo[i]
            block = seq.block_table[i]
            # Another sequence may have computed the same block first; keep
            # that one cached and leave this copy to be freed normally.
            if h not in self._cached and self._block_hash[block] is None:
                self._cached[h] = block
                self._block_hash[block] = h
                self._block_tokens[block] = tokens
            seq.block_hashes.append(h)

    # ---- allocation -----------------------------------------------------

    def allocate_for(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give ``seq`` the blocks for its next ``num_new_tokens`` tokens (check first)."""
        num_needed = self.num_new_blocks_needed(seq, num_new_tokens)
        assert num_needed <= self.num_free_blocks, "allocate_for without can_allocate"
        for _ in range(num_needed):
            seq.block_table.append(self._pop_free_block())

    def trim_to_computed(self, seq: Sequence) -> None:
        """Free the blocks past ``seq``'s computed tokens (KV of rejected speculative tokens).

        The table becomes a new list, so a holder of the old one (the runner's device row) sees it changed.
        Those blocks were never hashed: hashing covers computed tokens only.
        """
        keep = self.num_blocks_for(seq.num_computed_tokens)
        if len(seq.block_table) <= keep:
            return
        for block in reversed(seq.block_table[keep:]):
            assert self._ref_counts[block] == 1 and self._block_hash[block] is None, f"block {block} is shared"
            self._ref_counts[block] = 0
            self._free.append(block)
        seq.block_table = seq.block_table[:keep]

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; cached ones become evictable, the rest free."""
        # Release the tail first so that, among this sequence's cached blocks,
        # the deepest ones are evicted first and shared prefixes live longest.
        for block in reversed(seq.block_table):
            assert self._ref_counts[block] > 0, f"double free of block {block}"
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if self._block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table = []
        seq.block_hashes = []

    def _pop_free_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            h = self._block_hash[block]
            assert h is not None and self._cached.get(h) == block
            del self._cached[h]
            self._block_hash[block] = None
            self._block_tokens[block] = None
        assert self._ref_counts[block] == 0
        self._ref_counts[block] = 1
        return block

    def check_invariants(self) -> None:
        """Assert the three block states partition the pool (used by tests)."""
        free = set(self._free)
        evictable = set(self._evictable)
        assert len(free) == len(self._free), "block twice on the free list"
        assert not free & evictable
        for block in range(self.num_blocks):
            in_use = self._ref_counts[block] > 0
            assert in_use + (block in free) + (block in evictable) == 1, f"block {block} state"
            if block in evictable:
                assert self._block_hash[block] is not None
            if block in free:
                assert self._block_hash[block] is None
        for h, block in self._cached.items():
            assert self._block_hash[block] == h
