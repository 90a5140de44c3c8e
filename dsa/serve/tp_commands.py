"""Serving under tensor parallelism (SPMD): rank 0 takes the requests, every rank steps the same engine.

Every rank holds a shard of the model and runs the same deterministic engine
(:mod:`dsa.model.parallel`). What is not deterministic comes from outside: new requests (token ids
and sampling parameters), aborts (a client that went away, a request timeout, a shutdown drain)
and the shutdown itself. Rank 0's :class:`~dsa.serve.engine_loop.EngineLoop` applies them between
steps as usual and, before each step, broadcasts the ones it applied (:meth:`TPCommands.send`);
every other rank runs :func:`follow`: it receives them, applies them to its engine in the same
order and steps when there is work, so every rank schedules the same batch. Only rank 0 answers.

The commands are pickled lists broadcast over a gloo group of the same ranks (CPU objects; the
model's collectives stay on its own group, NCCL on GPUs) that has its own timeout. While idle,
rank 0 sends an empty list every ``heartbeat_s`` seconds, so no rank waits longer than
``timeout_s`` for another: a rank that died is noticed when its sockets close (at once on
gloo), one that hangs after ``timeout_s``; either way the broadcast raises, and the servers stop
with one line (``dsa serve``).

Commands: ``("add", request id, prompt ids, SamplingParams)``, ``("abort", request id)``,
``("stop",)``. Every rank numbers requests in the order it adds them, so the ids agree; a
follower whose id differs from rank 0's raises (the engines diverged).
"""
import re
from datetime import timedelta

import torch.distributed as dist

TIMEOUT_S = 300.0  # how long a rank waits on the others (the command group's and dsa serve's process group's)
HEARTBEAT_S = 1.0  # an idle rank 0 sends an empty command list this often
SOURCE_PREFIX = re.compile(r"^\[[^]]*\.(cc|cpp|h):\d+\] ")


class TPCommands:
    """The command channel of a tensor-parallel group ``tp`` (a :class:`~dsa.model.parallel.TensorParallel`
    of more than one rank). Collective: every rank builds it at the same point."""

    def __init__(self, tp, timeout_s: float = TIMEOUT_S, heartbeat_s: float = HEARTBEAT_S):
        if tp.size < 2:
            raise ValueError(f"tp: TPCommands needs a tensor-parallel group of 2 or more ranks, got {tp.size}")
        if not timeout_s > heartbeat_s > 0:
            raise ValueError(f"timeout_s: expected more than heartbeat_s {heartbeat_s} > 0, got {timeout_s}")
        ranks = None if tp.group is None else dist.get_process_group_ranks(tp.group)
        self.group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s), backend="gloo")
        self.src = 0 if ranks is None else ranks[0]  # the global rank of tensor-parallel rank 0
        self.rank, self.size = tp.rank, tp.size
        self.timeout_s, self.heartbeat_s = timeout_s, heartbeat_s

    def send(self, commands: list) -> None:
        """Rank 0: broadcast the commands applied since the last step (possibly none)."""
        dist.broadcast_object_list([commands], src=self.src, group=self.group)

    def receive(self) -> list:
        """Other ranks: the next list rank 0 sends."""
        box = [None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]


def follow(engine, commands: TPCommands, on_output=None) -> None:
    """The loop of a rank other than 0: apply each list of commands rank 0 sends, then step if there
    is work; return at ``("stop",)``. ``on_output(delta)``: gets every request's deltas (the
    engine's callback). Raises what the broadcast or the step raises, and RuntimeError when this
    rank numbered a request differently from rank 0."""
    while True:
        for command in commands.receive():
            if command[0] == "stop":
                return
            if command[0] == "abort":
                engine.abort(command[1])
                continue
            _, rid, prompt_ids, sampling = command
            got = engine.add_request(prompt_ids, sampling=sampling, on_output=on_output)
            if got != rid:
                raise RuntimeError(f"tensor-parallel rank {commands.rank}: request {rid} of rank 0 got id {got} "
                                   "here: the ranks' engines diverged")
        if engine.has_work():
            engine.step()


def one_line(e: BaseException) -> str:
    """``Type: first line of the message``, less gloo's ``[source.cc:553]`` prefix (gloo's and
    NCCL's errors can span many lines)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {SOURCE_PREFIX.sub('', lines[0])}" if lines else type(e).__name__
