"""Double-buffered DMA of K/V pages from HBM into VMEM, shared by the TPU decode and prefill kernels.

A chunk is `pages_per_chunk` consecutive logical blocks of one sequence, counted from `first_page`
(0, or the first block a sliding window needs: earlier blocks are never copied); page p of a
chunk lands in rows [p*S, (p+1)*S) of a [C, D] VMEM buffer slot (C = pages_per_chunk * S). Pages
at or past `num_pages` are neither copied nor looked up in the block table, so their buffer rows
keep stale data (NaN in the interpreter): callers mask scores and zero values past the context.
"""

import jax
import jax.numpy as jnp

from pallas_kernels._compat import pl, pltpu


def chunk_scratch(chunk_tokens, head_dim, dtype):
    """Scratch shapes: K and V buffers [2, C, D] (two slots) and one DMA semaphore per slot each."""
    return [pltpu.VMEM((2, chunk_tokens, head_dim), dtype),
            pltpu.VMEM((2, chunk_tokens, head_dim), dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SemaphoreType.DMA((2,))]


class ChunkFetcher:
    """Starts and waits for the page copies of one chunk into one buffer slot.

    k_pages, v_pages: [N, S, D] HBM refs of one kv head; block_tables: flat SMEM ref read at
    table_offset + logical block; num_pages: blocks of this sequence that may be read; chunk 0
    starts at logical block first_page (None: block 0, with no offset computed).
    """

    def __init__(self, k_pages, v_pages, k_buffer, v_buffer, k_sems, v_sems, block_tables, *,
                 table_offset, pages_per_chunk, num_pages, first_page=None):
        self._pages = (k_pages, v_pages)
        self._buffers = (k_buffer, v_buffer)
        self._sems = (k_sems, v_sems)
        self._block_tables = block_tables
        self._table_offset = table_offset
        self._pages_per_chunk = pages_per_chunk
        self._num_pages = num_pages
        self._first_page = first_page
        self._block_size = k_pages.shape[1]

    def _logical_block(self, chunk, page_in_chunk):
        block = chunk * self._pages_per_chunk + page_in_chunk
        return block if self._first_page is None else block + self._first_page

    def _copies(self, chunk, slot, page_in_chunk):
        logical_block = self._logical_block(chunk, page_in_chunk)
        physical_block = self._block_tables[self._table_offset + logical_block]
        rows = pl.ds(page_in_chunk * self._block_size, self._block_size)
        return [pltpu.make_async_copy(pages.at[physical_block], buffer.at[slot, rows], sems.at[slot])
                for pages, buffer, sems in zip(self._pages, self._buffers, self._sems)]

    def _for_each_valid_page(self, chunk, slot, action):
        for page_in_chunk in range(self._pages_per_chunk):
            is_valid = self._logical_block(chunk, page_in_chunk) < self._num_pages

            @pl.when(is_valid)
            def _(page_in_chunk=page_in_chunk):
                for copy in self._copies(chunk, slot, page_in_chunk):
                    action(copy)

    def start(self, chunk, slot):
        self._for_each_valid_page(chunk, slot, lambda copy: copy.start())

    def wait(self, chunk, slot):
        """Wait for the chunk's copies; return its (keys, values) values, [C, D] each."""
        self._for_each_valid_page(chunk, slot, lambda copy: copy.wait())
        k_buffer, v_buffer = self._buffers
        return k_buffer[slot], v_buffer[slot]


def fold_chunks(fetcher: ChunkFetcher, num_chunks, step, init):
    """fori_loop over num_chunks chunks with chunk i+1's DMA in flight while chunk i is used.

    step(chunk, keys [C, D], values [C, D], carry) -> carry.
    """
    @pl.when(num_chunks > 0)
    def _():
        fetcher.start(0, 0)

    def body(chunk, carry):
        slot = chunk % 2

        @pl.when(chunk + 1 < num_chunks)
        def _():
            fetcher.start(chunk + 1, 1 - slot)

        keys, values = fetcher.wait(chunk, slot)
        return step(chunk, keys, values, carry)

    return jax.lax.fori_loop(0, num_chunks, body, init)


def zero_stale_rows(values, first_token, end_token):
    """Zero the rows of a [C, D] chunk whose token (first_token + row) is >= end_token.

    Stale rows may hold NaN, and 0 * NaN = NaN would leak through the probabilities' dot.
    """
    token = first_token + jax.lax.broadcasted_iota(jnp.int32, values.shape, 0)
    return jnp.where(token < end_token, values, jnp.zeros_like(values))
