"""InputBatch: the running requests as the model runner keeps them across steps, one row each
(vLLM v1's persistent input batch): the request's token ids, its block table and its sampling
parameters.

The rows change only by a :class:`~dsa.engine.scheduler.SchedulerOutput`'s deltas
(:meth:`InputBatch.apply`): a request that left gives its row back; a new one (admitted, or resumed
after a preemption) fills a free row with its tokens, blocks and sampling; granted blocks extend a
row's table; a token the host learned takes its place. A step's inputs are then fancy indexes of
these tables, and no step reads a :class:`~dsa.engine.scheduler.Request`.

A step that samples a row's next token marks its place :data:`~dsa.engine.scheduler.PENDING`
(:meth:`InputBatch.expect`): the next step reads it on the device, from the tokens that step
sampled, unless the host learned it first. A row holds every token a later step reads; a token
some launched step already read may stay PENDING (nothing reads it again: a preempted request
comes back in a fresh row), and the places past a request's tokens hold whatever the row's
earlier requests left there.
"""
import numpy as np

from dsa.engine.sampling import SamplingRows
from dsa.engine.scheduler import PENDING


class InputBatch:
    """``rows`` rows (the most requests that run at once) of ``max_tokens`` token ids and
    ``max_blocks`` block ids."""

    def __init__(self, rows: int, max_tokens: int, max_blocks: int, vocab_size: int):
        self.token_ids = np.zeros((rows, max_tokens), np.int32)
        self.block_table = np.zeros((rows, max_blocks), np.int32)  # zeros past a row's blocks
        self.num_blocks = np.zeros(rows, np.int64)
        self.sampling = SamplingRows(rows, vocab_size)
        self.sampled_row = np.full(rows, -1, np.int64)  # where the last step run sampled the row's next token
        self.row_of: dict = {}  # request id -> row
        self.free_rows = list(range(rows - 1, -1, -1))

    def apply(self, out) -> None:
        """A step's deltas, in their order: requests that left, new ones, blocks, tokens."""
        for rid in out.finished:  # (one announced by a step that failed before it ran has no row)
            row = self.row_of.pop(rid, None)
            if row is not None:
                self.free_rows.append(row)
        for new in out.new:
            row = self.row_of[new.rid] = self.free_rows.pop()
            self.token_ids[row, :len(new.tokens)] = new.tokens
            n = len(new.blocks)
            self.block_table[row, :n] = new.blocks
            self.block_table[row, n:self.num_blocks[row]] = 0  # nothing of the row's last request stays
            self.num_blocks[row] = n
            self.sampling.set(row, new.sampling, new.seed)
        for rid, blocks in out.grants:
            row = self.row_of[rid]
            n = self.num_blocks[row]
            self.block_table[row, n:n + len(blocks)] = blocks
            self.num_blocks[row] = n + len(blocks)
        for rid, tokens in out.tokens.items():
            row = self.row_of[rid]
            for index, token in tokens:
                self.token_ids[row, index] = token

    def rows(self, rids: list) -> np.ndarray:
        """The rows of these requests, [B] int64."""
        return np.fromiter(map(self.row_of.__getitem__, rids), np.int64, len(rids))

    def input_ids(self, rows: np.ndarray, num_rows: np.ndarray, computed: np.ndarray, each: int | None) -> tuple:
        """``(ids [T] int32, src)``: the ids of the step's rows (request ``i``: positions
        ``computed[i] ..`` of row ``rows[i]``, ``num_rows[i]`` of them; ``each``: every request's
        count when they are all the same, else None), and ``src [T]``: for an id still PENDING, the
        row of the last step run that samples it (-1 elsewhere); None when no id is pending."""
        if each == 1:
            where, positions = rows, computed
        elif each is not None:  # a grid
            where, positions = np.repeat(rows, each), (computed[:, None] + np.arange(each)).reshape(-1)
        else:
            where = np.repeat(rows, num_rows)
            positions = np.arange(len(where)) - np.repeat(np.cumsum(num_rows) - num_rows - computed, num_rows)
        ids = self.token_ids[where, positions]
        pending = ids == PENDING
        return ids, (np.where(pending, self.sampled_row[where], -1) if pending.any() else None)

    def expect(self, rows: np.ndarray, positions: np.ndarray, sampled_rows: np.ndarray) -> None:
        """This step samples the tokens at ``positions`` of ``rows``, in its rows ``sampled_rows``."""
        self.token_ids[rows, positions] = PENDING
        self.sampled_row[rows] = sampled_rows
