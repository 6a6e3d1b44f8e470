"""Prefix caching over a model's block pool (engine/kv_cache.py BlockPool): what a server does
with it for each request.

`begin` gives a request's session its blocks: the longest run of cached full blocks that
starts its prompt (shared, reference-counted) and fresh blocks for the rest of its prompt and
its generation, all at once, so that a request admitted never runs out of room halfway. The
session starts at the end of the shared run: only the rest of the prompt is read. Before each
prompt chunk, `catch_up` takes the blocks of that rest that another request has published
since (requests that arrive together with one system prompt read it once, not each). At least the
prompt's last token is always read (its logits give the first token), so a shared block is
never written. `publish` makes the full blocks of the prompt read so far findable (keyed by
the chain hash of their tokens, kv_cache.block_key); only blocks a prompt read wrote are
published, never ones decode steps wrote: a cached block holds what reading its prefix as a
prompt writes. `end` releases the request's blocks: the published ones stay cached until the
pool needs their room (least recently released first), the others are free at once.

Hybrid models (qwen35, qwen35moe): the attention layers' keys and values are in blocks as for
any model, but a delta-net layer's state is one per sequence, summing every token before it.
So the prompt read of a hybrid stops at its last block boundary before its last token
(`snapshot_at`), and the recurrent state there is kept (`take_snapshot`) on the block that
ends there. A later request reuses a cached run only up to the last block that carries a
snapshot: the blocks' keys and values and the state are restored, and everything after is
read again. A conversation's next turn thus resumes at the end of the previous turn's prompt
(to within a block), and reads again the previous reply and the new message.
"""

from __future__ import annotations


from .kv_cache import BLOCK_TOKENS, BlockPool, PoolExhausted, block_key, blocks_for


class PrefixCache:
    """A server's requests' blocks in `pool`; `enabled` False: blocks per request, none shared.
    `snapshots_kept`: recurrent-state snapshots kept at most (a hybrid's state per sequence
    may be tens of MB; the least recently used go first)."""

    def __init__(self, pool: BlockPool, enabled: bool = True, snapshots_kept: int = 16):
        self.pool, self.enabled = pool, enabled
        self.snapshots_kept = snapshots_kept
        cfg = pool.cfg
        self.hybrid = any(cfg.is_recurrent(il) for il in range(cfg.n_layer))
        self.cached_tokens = 0          # prompt tokens not read thanks to the cache, all requests
        self.prompt_tokens = 0          # prompt tokens of the requests begun

    def fits(self, n_tokens: int) -> bool:
        """Whether a request of n_tokens positions can ever have its blocks (the whole pool)."""
        return blocks_for(n_tokens) <= self.pool.n_blocks

    def keys(self, prompt_ids: list[int]) -> list[bytes]:
        """The chain keys of the prompt's full blocks."""
        out, prev = [], b""
        for i in range(len(prompt_ids) // BLOCK_TOKENS):
            prev = block_key(prev, prompt_ids[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])
            out.append(prev)
        return out

    def match(self, prompt_ids: list[int], keys: list[bytes]) -> list[int]:
        """The cached blocks that start the prompt, at most up to its last token's block
        (exclusive), cut for a hybrid to the last one with a state snapshot."""
        if not self.enabled:
            return []
        got = []
        for i, key in enumerate(keys[:(len(prompt_ids) - 1) // BLOCK_TOKENS]):
            b = self.pool.lookup(key, prompt_ids[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])
            if b is None:
                break
            got.append(b)
        if self.hybrid:
            while got and got[-1] not in self.pool.snapshots:
                got.pop()
        return got

    def begin(self, session, prompt_ids: list[int], n_tokens: int) -> int:
        """Give `session` (reset, over this pool) its blocks for a request of `prompt_ids`
        and n_tokens positions in all, its position after the shared prefix, and (hybrid) the
        recurrent state there. Returns the prompt tokens it need not read. Raises
        PoolExhausted, holding nothing, when the pool cannot give the rest now."""
        keys = self.keys(prompt_ids)
        shared = self.match(prompt_ids, keys)
        for b in shared:
            self.pool.share(b)
        try:
            fresh = self.pool.allocate(blocks_for(n_tokens) - len(shared))
        except PoolExhausted:
            self.pool.release(shared)
            raise
        session.reset()
        session.cache.assign(shared + fresh)
        session.cache.keys = keys
        n = len(shared) * BLOCK_TOKENS
        if shared and self.hybrid:
            snap = self.pool.snapshots.pop(shared[-1])
            self.pool.snapshots[shared[-1]] = snap      # most recently used last
            rs = session.cache.recurrent
            with self.pool.backend.activate():
                for il, (conv, ssm) in snap.items():
                    rs.conv[il][0] = conv
                    rs.ssm[il][0] = ssm
        session.n_past = n
        self.cached_tokens += n
        self.prompt_tokens += len(prompt_ids)
        return n

    def catch_up(self, session, prompt_ids: list[int], n_read: int) -> int:
        """Before a request reads its next prompt chunk: the cached blocks that have appeared
        since it began for the prompt's blocks from n_read on (another request read the same
        prefix meanwhile: requests arriving together all begin before any has published a
        block), taken in place of the session's own unwritten ones, up to the first block not
        cached (at most up to its last token's block, as `match`). Returns the prompt tokens it
        then need not read (0 for a hybrid: its state would have to be restored at the block
        it stops at). Its blocks' keys and values are then what reading that prefix as a prompt
        writes, as for the prefix `begin` shares."""
        if not self.enabled or self.hybrid or n_read % BLOCK_TOKENS:
            return 0
        keys, table = session.cache.keys, [int(b) for b in session.cache.table]
        i = n_read // BLOCK_TOKENS
        mine = []
        while i < min(len(keys), (len(prompt_ids) - 1) // BLOCK_TOKENS):
            b = self.pool.lookup(keys[i], prompt_ids[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])
            if b is None or b == table[i]:
                break
            self.pool.share(b)
            mine.append(table[i])
            table[i] = b
            i += 1
        if not mine:
            return 0
        session.cache.assign(table)
        self.pool.release(mine)          # never written: free again at once
        n = len(mine) * BLOCK_TOKENS
        session.n_past += n
        self.cached_tokens += n
        return n

    def snapshot_at(self, prompt_ids: list[int]) -> int:
        """For a hybrid with caching on, the position where its prompt read stops to keep a
        state snapshot (the last block boundary before the prompt's last token); else 0."""
        if not (self.enabled and self.hybrid):
            return 0
        return (len(prompt_ids) - 1) // BLOCK_TOKENS * BLOCK_TOKENS

    def publish(self, session, prompt_ids: list[int], n_read: int):
        """Register the full blocks of the first n_read prompt tokens (read as a prompt)."""
        if not self.enabled:
            return
        keys, table = session.cache.keys, session.cache.table
        for i in range(min(n_read // BLOCK_TOKENS, len(keys))):
            b = int(table[i])
            if not self.pool.registered(b):
                self.pool.register(b, keys[i], prompt_ids[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])

    def take_snapshot(self, session, prompt_ids: list[int], n_read: int):
        """Keep the session's recurrent state (after n_read prompt tokens, a block boundary) on
        the cached block that ends there."""
        i = n_read // BLOCK_TOKENS - 1
        if not (self.enabled and self.hybrid) or i < 0 or n_read % BLOCK_TOKENS:
            return
        b = self.pool.lookup(session.cache.keys[i], prompt_ids[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])
        if b is None:
            return
        rs = session.cache.recurrent
        with self.pool.backend.activate():
            self.pool.snapshots.pop(b, None)
            self.pool.snapshots[b] = {il: (rs.conv[il][0].copy(), rs.ssm[il][0].copy())
                                      for il in rs.layers}
        while len(self.pool.snapshots) > self.snapshots_kept:
            self.pool.snapshots.pop(next(iter(self.pool.snapshots)))

    def end(self, session):
        """Release the request's blocks."""
        session.cache.release()
        session.cache.keys = []

    def counts(self) -> dict[str, int]:
        return self.pool.counts()


# The share of the device's free memory (after the weights are loaded) a server's block pool
# may take by default: the rest is for the activations, the captured graphs' working sets and
# the prompt GEMMs' float16 weight copies.
KV_MEMORY_SHARE = 0.5


def default_blocks(parallel: int, n_ctx: int, model=None) -> int:
    """The pool a server gets unless told: room for `parallel` sequences of the whole context
    at once (what the per-sequence caches it replaces could hold); blocks no sequence holds
    keep cached prefixes until needed. On a backend that reports its free device memory
    (`free_memory`), at most KV_MEMORY_SHARE of it, but at least one whole context."""
    want = parallel * blocks_for(n_ctx)
    free = getattr(getattr(model, "backend", None), "free_memory", None)
    if free is None:
        return want
    per_block = BlockPool.block_bytes(model.config)
    return max(blocks_for(n_ctx), min(want, int(KV_MEMORY_SHARE * free() // max(1, per_block))))


__all__ = ["PrefixCache", "default_blocks", "PoolExhausted"]
