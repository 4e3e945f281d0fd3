"""The node link: one process per node that keeps several machines' copies of a job in step.

psd is one machine: a job's weights live in its arena. With ``--nnodes N``
each machine runs its own job (watchdog, server, learners) and its watchdog
starts this process beside the server. Every ``--sync-every K`` local updates
(the arena's clock; 1 by default) it reads the node's weights ``w``, all-reduces
the delta since the last agreed weights (``w - anchor``) with the other nodes
over torch.distributed's gloo, moves the agreed weights by the sum of the deltas
(``sum``, the default: every node's progress, as one node with all the learners
would make), their mean (``avg``) or DiLoCo's outer SGD with Nesterov momentum
on minus the mean delta (``nesterov``), and makes the node adopt them together
with the progress it made while the exchange ran: ``w += new_anchor -
w_at_exchange``. Inside a node training stays asynchronous (HPSGD); across
nodes it is asynchronous with a bounded lag (below), or local SGD / DiLoCo at a
large K.

Only the update loop writes weights concurrently, so every read and write here
happens while the loop is stopped by the *hold* (``Arena.hold``): the loop stops
by itself right after the update that reaches the hold's clock (or before any,
when it is there already) and says so in ``held``. Not the pause that
checkpoints use: the arena has one pauser slot, and a checkpoint's resume would
end our pause. The same hold at the exchange point D exchanges past the last
one adopted is ``--max-node-lag D`` (D = 0: lockstep).

Rendezvous and membership use a TCPStore that node 0's link hosts on
``--master-addr:--master-port``; each membership (an *epoch*) gets a fresh
``PrefixStore`` and a new ``ProcessGroupGloo`` whose timeout is
``--node-timeout``. Node 0 decides every epoch's members. A collective that
fails or times out makes the survivors form the next epoch without the dead
node; a node that comes back asks to join, node 0 raises a flag inside the
next all-reduce, and every member re-forms at that same round; the new epoch
starts with a broadcast of the agreed weights, outer momentum and round from a
node that was already a member. If node 0 dies, the rendezvous dies with it:
the other nodes train on alone and their links keep retrying until node 0 is
back (see the README's "Several machines").
"""

from __future__ import annotations

import argparse
import datetime
import enum
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psd import _native
from psd.arena import ArenaWatch, HeaderView
from psd.choices import OUTER_OPTIMIZERS  # its index travels in the join handshake
from psd.errors import Error, JobNotFound, Timeout
from psd.server import validate_nodes
from psd.signals import SignalFlag
from psd.watchdog.restarts import Backoff

__all__ = ["LinkState", "NodeLink", "agreed_path", "main", "read_state", "state_path"]

log = logging.getLogger("psd.nodelink")

_POLL_S = 0.001  # the clock is polled: the update loop announces nothing to other processes
# Every wait of the link polls through the one back-off (watchdog/restarts.py), at a fixed interval: what it
# waits for is due any moment and nothing announces it.
_CLOCK_POLL = Backoff.every(_POLL_S)  # the clock, the loop's `held`, a collective's completion
_ARENA_POLL = Backoff.every(0.05)  # the arena to hold weights (nothing announces READY to other processes)
_STORE_POLL = Backoff.every(0.02)  # node 0: the epoch's members at the rendezvous (the store announces nothing)
_ENTER_RETRY = Backoff.every(0.0)  # a later epoch, at once: each try waits for node 0 in _form itself
_ARENA_CHECK_S = 0.5  # how often the link looks whether its arena was replaced
# How long the link waits for a beating update loop to stop at its hold: at least this, and at least
# --node-timeout (one update of a large model, or a checkpoint's pause of the loop, can take seconds; a loop
# that stopped beating is not waited for).
_STOP_TIMEOUT_S = 5.0
_HUNG_S = 2.0  # a loop that has not beaten this long is hung (the watchdog's --heartbeat-timeout): nothing writes
_SAVE_EVERY_S = 60.0  # the agreed state on disk; also at a clean stop
_STATE_EVERY_S = 0.2  # the state file (psd status) after an exchange, at most this often; at every change of state


class LinkState(enum.Enum):
    """What the node link is doing (the ``state`` of its state file).

    CONNECTING -> FORMING      the rendezvous (node 0's TCPStore) answered
    FORMING    -> RUNNING      node 0 published this epoch's members and the agreed weights arrived
    FORMING    -> FAILED       a node never arrived (first epoch) or node 0 did not answer within
                               --node-timeout: the link exits non-zero; its watchdog restarts it
    RUNNING    -> FORMING      a collective failed or timed out (a node died), or a node asked to join
    RUNNING    -> STOPPED      SIGTERM (the watchdog stops the job): the hold is cleared
    any        -> FAILED       node 0's rendezvous is gone; the node trains on alone meanwhile
    """

    CONNECTING = "connecting"
    FORMING = "forming"
    RUNNING = "running"
    STOPPED = "stopped"
    FAILED = "failed"


class _Reform(Exception):
    """The current epoch is over (a peer died or a node asked to join): form the next one."""


def state_path(job: str) -> Path:
    """The node link's state file (JSON, for ``psd status``); outside /dev/shm, rewritten at each change of
    state and after a round, at most every ``_STATE_EVERY_S``."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "psd" / "nodes" / f"{job}.json"


def agreed_path(job: str) -> Path:
    """Where the link keeps the agreed state (anchor, outer momentum, round) for a job resumed with --resume."""
    return state_path(job).with_suffix(".agreed.safetensors")


def read_state(job: str) -> dict | None:
    """The node link's last written state for ``job``, with ``alive``; None when it has none."""
    try:
        st = json.loads(state_path(job).read_text())
    except (OSError, ValueError):
        return None
    st["alive"] = bool(_native.owner_alive(st.get("pid", 0), st.get("pid_start_time", 0)))
    return st


@dataclass
class _Agreed:
    """What every member holds alike: the agreed weights, the outer momentum buffer, the global round."""

    anchor: Any  # torch.Tensor, float32, n_train
    momentum: Any  # torch.Tensor or None
    round: int
    state: Any = None  # --node-state auto: the agreed optimizer state, float32 (vectors, n_train); else None
    steps: Any = None  # and each trainable tensor's agreed optimizer step count, int64 (n_pieces)


@dataclass
class _Local:
    """A node's own copy, read while its update loop applies nothing: weights, optimizer state, step counts."""

    w: Any
    state: Any = None
    steps: Any = None


# Per optimizer, the header field whose value each of its state vectors decays by in one update (None: kept
# whole, Adagrad's sum of squares); the momentum buffer decays by the momentum the loop applies now.
STATE_DECAYS = {"momentum": ("momentum_now",), "nesterov": ("momentum_now",), "adam": ("beta1", "beta2"),
                "adamw": ("beta1", "beta2"), "adagrad": (None,)}
_NONNEGATIVE = {"adam": (1,), "adamw": (1,), "adagrad": (0,)}  # sums of squares: kept >= 0 after an adoption


class _StateExchange:
    """What ``--node-state sum`` (and ``auto``, but for Adagrad) adds to an exchange: the optimizer state, combined
    as the weights are.

    Each state vector of the update loop's optimizer (native/optim.c: the momentum buffer; Adam's m and v;
    Adagrad's sum) moves by one update as ``s = beta s + (a term of the gradient)``. Node n, ``k_n`` updates
    of a tensor past the agreed state ``s0``, sends ``a_n = s_n - beta^k_n s0``, what its own gradients added,
    ``k_n ln(beta)`` and ``1 - beta^k_n`` (each per vector and tensor); with ``k = sum k_n``, the agreed state
    is ``beta^k s0 + (1 - beta^k) / sum(1 - beta^k_n) * sum a_n``: ``s0`` decayed by every node's updates, plus
    every node's additions, scaled for the decay each would have had under the other nodes' updates in one
    node applying all the gradients (exact where the gradients are alike), and each tensor's step count
    (Adam's bias correction) the sum of theirs. The plain sum of the additions overcounts the momentum buffer
    (Adam's m) by 2 / (1 + beta) at 2 nodes exchanging every update and up to N times at a large
    --sync-every: at --sync-every 20 the LM on 2 x 2 lost 18.1% with Adam against 14.4% for each node's own
    state, and 14.6% scaled. A node that ran on past its snapshot while the exchange was on the wire
    (--max-node-lag >= 1, the default), or alone while an epoch formed, adopts the agreed change decayed by
    the updates it applied meanwhile, as those updates decayed the snapshot (else the excess came back in its
    next additions). Without it each node keeps its own: Adam's moments average over each node's gradients
    alone, Adagrad's sums hold a node's squares (a step sqrt(N) times one node's), and the momentum buffer
    decays once per local update. ``auto`` keeps Adagrad's per node: combined, the matrix's LM lost 6.6% of
    loss on 2 x 2 where per node it is in band.
    Measured: benchmarks/results/matrix/README.md, "Two nodes: the optimizer state in the exchange"."""

    def __init__(self, arena: Any, optimizer: str) -> None:
        import torch

        from psd.arena import decode_spec, piece_geometry

        self.optimizer = optimizer
        self.decays = STATE_DECAYS[optimizer]
        self.lens = torch.tensor([n for n, _ in piece_geometry(decode_spec(arena.spec()))], dtype=torch.int64)
        self.n_pieces = len(self.lens)

    @staticmethod
    def applies(cfg: Any, training: dict) -> bool:
        """Whether a node of this job combines its optimizer state in the exchange."""
        opt = training["optimizer"]
        return (cfg.outer_optimizer == "sum" and training["sync"] in ("asp", "ssp") and opt in STATE_DECAYS
                and (cfg.node_state == "sum" or (cfg.node_state == "auto" and opt != "adagrad")))

    def views(self, arena: Any) -> tuple[list, Any]:
        """(the optimizer's state vectors, each a tensor over the mapping; each tensor's step count, over it)."""
        from psd.state import pieces_view
        from psd.watchdog.checkpoint import state_views

        h = arena.header()
        return state_views(arena, h)[: len(self.decays)], pieces_view(arena, h)[:, 0]

    def read(self, arena: Any) -> tuple[Any, Any]:
        import torch

        vecs, steps = self.views(arena)
        return torch.stack(vecs), steps.clone()  # stack copies

    def log_decays(self, arena: Any) -> Any:
        """ln(beta) of each state vector for one update, as the loop applies it now."""
        import math

        import torch

        h = arena.header()
        out = []
        for name in self.decays:
            beta = 1.0 if name is None else float(h[name])
            out.append(math.log(beta) if beta > 0 else -1e4)  # a momentum of 0 keeps nothing of s0
        return torch.tensor(out, dtype=torch.float64)

    def expand(self, per_piece: Any) -> Any:
        """(vectors, n_pieces) -> (vectors, n_train): each tensor's value over its elements."""
        import torch

        return torch.repeat_interleave(per_piece, self.lens, dim=1)

    def payload(self, arena: Any, local: _Local, agreed: _Agreed) -> Any:
        """This node's part of the state's all-reduce: its additions, its k ln(beta), 1 - beta^k, its k
        (float32)."""
        import torch

        k = (local.steps - agreed.steps).to(torch.float64)  # updates of each tensor since the agreed state
        lk = self.log_decays(arena)[:, None] * k[None, :]  # (vectors, n_pieces)
        adds = local.state - self.expand(torch.exp(lk).float()) * agreed.state
        return torch.cat([adds.flatten(), lk.flatten().float(), (-torch.expm1(lk)).flatten().float(), k.float()])

    def combine(self, summed: Any, agreed: _Agreed) -> tuple[Any, Any]:
        """The new agreed (state, steps) from the all-reduced payload."""
        import torch

        v, n = agreed.state.shape
        p = self.n_pieces
        adds = summed[: v * n].view(v, n)
        lk = summed[v * n: v * n + v * p].view(v, p).to(torch.float64)
        kept = summed[v * n + v * p: v * n + 2 * v * p].view(v, p).to(torch.float64)  # sum of 1 - beta^k_n
        k = summed[v * n + 2 * v * p:].to(torch.float64).round().to(torch.int64)
        whole = -torch.expm1(lk)  # 1 - beta^k, k = sum k_n
        # beta = 1 (Adagrad's sum) or no update anywhere: 0 / 0, the additions count whole
        scale = torch.where(kept > 1e-12, whole / kept.clamp(min=1e-12), torch.ones_like(kept))
        state = self.expand(torch.exp(lk).float()) * agreed.state + self.expand(scale.float()) * adds
        for i in _NONNEGATIVE.get(self.optimizer, ()):
            state[i].clamp_(min=0.0)
        return state, agreed.steps + k

    def adopt(self, arena: Any, d_state: Any, d_steps: Any, since: Any) -> None:
        """Add the agreed state's change to the node's own (the loop held); ``since``: the step counts of the
        state the change is against, whose later updates decay it."""
        import torch

        vecs, steps = self.views(arena)
        j = (steps - since).clamp(min=0).to(torch.float64)  # updates since, each tensor (0: held)
        d_state = d_state * self.expand(torch.exp(self.log_decays(arena)[:, None] * j[None, :]).float())
        for i, v in enumerate(vecs):
            v.add_(d_state[i])
        for i in _NONNEGATIVE.get(self.optimizer, ()):
            vecs[i].clamp_(min=0.0)
        steps.add_(d_steps)


class NodeLink:
    """One node's link: ``NodeLink(serve_config).run()``, until its ``stop`` flag is set (SIGINT/SIGTERM)."""

    def __init__(self, cfg: Any) -> None:
        validate_nodes(cfg)
        self.cfg = cfg
        self.rank = cfg.node_rank
        self.me = os.getpid()
        self.me_start = _native.proc_start_time(self.me)
        self.state = LinkState.CONNECTING
        self.epoch = -1
        self.members: list[int] = []
        self.bytes_sent = 0
        self.exchanges = 0
        self.last_exchange_unix = 0.0
        self.last_exchange_ms = 0.0
        self.reforms = 0
        self.store = None
        self.pg = None
        self._watch = ArenaWatch(cfg.job)  # the one arena reopen (psd/arena.py), as the watchdog's
        self.arena: _native.Arena | None = None
        self.agreed: _Agreed | None = None
        self._sx: _StateExchange | None = None  # --node-state where it applies: the state in the exchange
        self.base = 0  # the local clock that exchange point 0 stands for
        self.adopted = 0  # local exchanges adopted since `base`
        self.stop = SignalFlag()  # SIGINT/SIGTERM's handler sets it
        self._old_groups: list = []
        self._bound = -1  # the clock the update loop is held at (-1: none)
        self._saved_at = time.monotonic()
        self._written_at = 0.0  # the state file's last write, and the round it wrote
        self._written_round = -1
        self._checked_at = 0.0

    # -- the arena ------------------------------------------------------------

    def _open_arena(self, deadline: float) -> None:
        """Map the job's arena once it holds weights (the first learner's or a checkpoint's)."""
        job = self.cfg.job
        for _ in _ARENA_POLL.tries(deadline, self.stop):
            a = self._watch.current()  # kept while it waits, reopened if the arena is replaced meanwhile
            if a is not None and a.state == _native.ARENA_READY and HeaderView(a).n_params:
                a.remap()
                self.arena = a
                training = a.training()
                self._sx = _StateExchange(a, training["optimizer"]) if _StateExchange.applies(self.cfg, training) \
                    else None
                return
        raise JobNotFound(f"job {job!r} has no weights yet: the node link waits for the first learner "
                          f"to attach (start the node's learners, or give --init)")

    def _check_arena(self) -> None:
        """Raise if the node's arena was replaced (its server started over from a checkpoint): the link then
        exits, and the one its watchdog starts joins the others as a node that comes back."""
        now = time.monotonic()
        if now - self._checked_at < _ARENA_CHECK_S:
            return
        self._checked_at = now
        if self._watch.replaced():  # never followed: the new arena's hold waits for the next life
            raise Error(f"job {self.cfg.job!r}: the node's arena was replaced (its server started over); the link "
                        f"exits so that its next life rejoins with the agreed weights")

    def _weights(self):
        """The trainable prefix of the arena's weights (``state.weights_view``'s first ``n_train``), over the
        mapping; the three header fields it needs read alone (``HeaderView``), not the whole header."""
        import torch

        h = HeaderView(self.arena)
        return torch.frombuffer(self.arena, dtype=torch.float32, count=h.n_params, offset=h.weights_off)[: h.n_train]

    def _hold(self, clock: int) -> None:
        """Let the update loop run up to ``clock`` and hold it there (-1: no hold)."""
        self._bound = clock
        self.arena.hold(self.me, self.me_start, clock)

    def _point(self, j: int) -> int:
        return self.base + self.cfg.sync_every * j

    def _stopped(self):
        """A context in which the update loop applies nothing: it holds the loop at the current clock and
        waits until the loop says it is held (``held``, stored after the hold was seen); on leaving, the
        hold goes back to the exchange bound. Checkpoints pause a held loop as any other."""
        link = self

        class _Stop:
            def __enter__(self):
                a = link.arena
                a.hold(link.me, link.me_start, a.clock())
                h = HeaderView(a)
                limit = max(_STOP_TIMEOUT_S, link.cfg.node_timeout)
                for _ in _CLOCK_POLL.tries(time.monotonic() + limit):
                    # the loop announces its hold only in the header; no update loop runs: nothing writes
                    if h.held or not a.server_alive(_HUNG_S):
                        return
                a.hold(link.me, link.me_start, link._bound)
                raise Timeout(f"the update loop of job {link.cfg.job!r} did not stop within {limit:g} s; see "
                              f"`psd status --job {link.cfg.job}`")

            def __exit__(self, *exc):
                link.arena.hold(link.me, link.me_start, link._bound)

        return _Stop()

    # -- rendezvous and membership -----------------------------------------------

    def _connect(self) -> None:
        import torch.distributed as dist

        c = self.cfg
        try:
            self.store = dist.TCPStore(c.master_addr, c.master_port, None, self.rank == 0,
                                       datetime.timedelta(seconds=c.node_timeout), wait_for_workers=False)
        except (RuntimeError, OSError) as e:
            raise Timeout(f"node {self.rank}: the rendezvous at {c.master_addr}:{c.master_port} (node 0) did not "
                          f"answer within --node-timeout {c.node_timeout:g} s ({e}); start node 0 first, check "
                          f"--master-addr/--master-port, or raise --node-timeout") from None

    def _get(self, key: str) -> str:
        return self.store.get(key).decode()

    def _wait_keys(self, keys: list[str], timeout: float) -> bool:
        try:
            self.store.wait(keys, datetime.timedelta(seconds=timeout))
            return True
        except (RuntimeError, OSError) as e:
            if "timeout" in str(e).lower() or "wait" in str(e).lower():
                return False
            raise

    def _coordinate(self, epoch: int, expected: list[int], first: bool) -> None:
        """Node 0: wait for the epoch's expected members, then publish who is in it and who holds the state."""
        c = self.cfg
        present: list[int] = []
        for _ in _STORE_POLL.tries(time.monotonic() + c.node_timeout, self.stop):
            present = [r for r in expected if self.store.check([f"e{epoch}/ready/{r}"])]
            if len(present) == len(expected):
                break
        missing = sorted(set(expected) - set(present))
        if first and missing:
            self.store.set(f"e{epoch}/members", "failed")
            raise Timeout(f"node(s) {', '.join(map(str, missing))} did not arrive within --node-timeout "
                          f"{c.node_timeout:g} s: start `psd serve` / `psd run` with --nnodes {c.nnodes} "
                          f"--node-rank R --master-addr {c.master_addr} --master-port {c.master_port} on each, or "
                          f"raise --node-timeout")
        members = sorted(set(present) | {0})
        if first:
            self.store.add("epoch_started", 1)
        veterans = [r for r in members if r in self.members] or [0]
        self.store.set(f"e{epoch}/source", str(veterans[0] if not first else 0))
        self.store.set(f"e{epoch}/members", ",".join(map(str, members)))
        if missing:
            log.warning("node 0: node(s) %s did not come back within %g s; epoch %d goes on with nodes %s",
                        ", ".join(map(str, missing)), c.node_timeout, epoch, members)

    def _form(self, epoch: int, expected: list[int] | None, first: bool) -> None:
        """Join epoch ``epoch``: register, learn its members, build its process group, agree on the state."""
        import torch.distributed as dist

        c = self.cfg
        self._set_state(LinkState.FORMING)
        self.store.set(f"e{epoch}/ready/{self.rank}", str(self.me))
        if self.rank == 0:
            self.store.set("epoch", str(epoch))
            self._coordinate(epoch, expected or list(range(c.nnodes)), first)
        if not self._wait_keys([f"e{epoch}/members"], c.node_timeout * 2 + 1):
            raise Timeout(f"node {self.rank}: node 0 formed no epoch {epoch} within {c.node_timeout * 2 + 1:g} s")
        raw = self._get(f"e{epoch}/members")
        if raw == "failed":
            raise Timeout(f"node {self.rank}: node 0 gave up waiting for the other nodes (see node 0's log); "
                          f"start every node within --node-timeout {c.node_timeout:g} s of each other")
        members = [int(r) for r in raw.split(",")]
        if self.rank not in members:
            raise _Reform(f"arrived after epoch {epoch} was formed")
        source = int(self._get(f"e{epoch}/source"))
        prefix = dist.PrefixStore(f"e{epoch}/pg", self.store)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=c.node_timeout)
        if c.master_addr in ("127.0.0.1", "localhost") and "GLOO_SOCKET_IFNAME" not in os.environ:
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        else:
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        try:
            pg = dist.ProcessGroupGloo(prefix, members.index(self.rank), len(members), opts)
            self._receive_agreed(pg, members.index(source), source)
        except RuntimeError as e:  # a member died while the epoch formed: the next one goes without it
            raise _Reform(f"epoch {epoch} failed while forming ({e})") from None
        self.pg, self.epoch, self.members = pg, epoch, members
        self.adopted = 0
        self.base = self.arena.clock()
        self._hold(self._point(1 + c.max_node_lag))
        self._set_state(LinkState.RUNNING)
        log.info("node %d: epoch %d formed with nodes %s at round %d", self.rank, epoch, members, self.agreed.round)

    def _receive_agreed(self, pg: Any, root: int, source: int) -> None:
        """The agreed state by broadcast from group index ``root`` (node ``source``); a node whose own differs
        (a newcomer, or a member a round behind) adopts it."""
        import torch

        c = self.cfg
        n = self._weights().numel()
        mine = self.agreed
        outer = OUTER_OPTIMIZERS.index(c.outer_optimizer)
        sx = self._sx
        shape = (len(sx.decays), sx.n_pieces) if sx else (0, 0)  # the state's all-reduce: vectors, tensors
        meta = torch.tensor([mine.round if mine else -1, n, outer, *shape], dtype=torch.int64)
        pg.broadcast(meta, root).wait()
        if tuple(int(x) for x in meta[3:]) != shape:
            raise Error(f"node {source} exchanges the optimizer state as {int(meta[3])} vectors of {int(meta[4])} "
                        f"tensors, this node as {shape[0]} of {shape[1]} (0: not at all): run the same model, "
                        f"--optimizer, --sync, --outer-optimizer and --node-state on every node")
        if int(meta[1]) != n or int(meta[2]) != outer:
            k = int(meta[2])
            theirs = OUTER_OPTIMIZERS[k] if 0 <= k < len(OUTER_OPTIMIZERS) else f"#{k}"
            raise Error(f"node {source} trains a model of {int(meta[1])} parameters with --outer-optimizer "
                        f"{theirs}, this node one of {n} with {c.outer_optimizer}: "
                        f"run the same model and flags on every node")
        local = self._snapshot() if mine is None or (sx and mine.state is None) else None
        anchor = mine.anchor.clone() if mine else local.w
        momentum = torch.zeros(n) if c.outer_optimizer == "nesterov" else None
        if mine is not None and mine.momentum is not None and momentum is not None:
            momentum.copy_(mine.momentum)
        before = anchor.clone()
        pg.broadcast(anchor, root).wait()
        if momentum is not None:
            pg.broadcast(momentum, root).wait()
        new = _Agreed(anchor, momentum, int(meta[0]) if int(meta[0]) >= 0 else 0)
        d_state = d_steps = None
        if sx:
            state, steps = (mine.state.clone(), mine.steps.clone()) if mine and mine.state is not None \
                else (local.state, local.steps)
            s_before, t_before = state.clone(), steps.clone()
            pg.broadcast(state, root).wait()
            pg.broadcast(steps, root).wait()
            new.state, new.steps = state, steps
            if not (torch.equal(s_before, state) and torch.equal(t_before, steps)):
                d_state, d_steps = state - s_before, steps - t_before
        if mine is None or mine.round != new.round or not torch.equal(before, anchor) or d_state is not None:
            # a member that trained on alone while the epoch formed (the hold cleared after a failed exchange):
            # its updates since its agreed state decay the change, as in an exchange
            self._adopt(anchor - before, d_state, d_steps, t_before if sx else None)
        self.agreed = new

    def _snapshot(self) -> _Local:
        with self._stopped():
            return self._read_local()

    def _read_local(self) -> _Local:
        """The node's weights, and where the exchange combines it, its optimizer state (the loop held)."""
        local = _Local(self._weights().clone())
        if self._sx is not None:
            local.state, local.steps = self._sx.read(self.arena)
        return local

    def _adopt(self, step, d_state, d_steps, since) -> None:
        with self._stopped():
            self._write_adopted(step, d_state, d_steps, since)

    def _write_adopted(self, step, d_state, d_steps, since) -> None:
        self._weights().add_(step)
        self.arena.note_weights_written()  # learners pulling only changed rows copy everything next
        if d_state is not None and self._sx is not None:
            self._sx.adopt(self.arena, d_state, d_steps, since)

    def _reform(self, why: str) -> None:
        """Leave the current epoch and form the next: survivors, plus whoever asked to join."""
        log.warning("node %d: %s; forming the next epoch", self.rank, why)
        self.reforms += 1
        if self.pg is not None:
            self._old_groups.append(self.pg)  # a failed gloo group may block in its destructor: keep it
        self.pg = None
        expected = sorted(set(self.members) | self._joiners()) if self.rank == 0 else None
        if self.rank != 0:
            self._enter(self.epoch + 1)
            return
        for r in expected:
            if r != 0:
                self.store.delete_key(f"join/{r}")
        self._form(self.epoch + 1, expected, first=False)

    def _joiners(self) -> set[int]:
        return {r for r in range(1, self.cfg.nnodes)
                if r not in self.members and self.store.check([f"join/{r}"])}

    def _join(self) -> None:
        """First contact: the first epoch with everyone, or (the job already runs) ask node 0 to let us in."""
        c = self.cfg
        if self.rank == 0 or int(self.store.add("epoch_started", 0)) == 0:
            try:
                self._form(0, list(range(c.nnodes)), first=True)
                return
            except _Reform:
                pass  # node 0 formed the first epoch without us: join as a node that comes back
        self.store.set(f"join/{self.rank}", str(self.me))
        self._enter(int(self._get("epoch")) + 1)

    def _enter(self, epoch: int) -> None:
        """A node other than 0: be a member of ``epoch`` or, if node 0 formed it without us, of a later one."""
        for n in _ENTER_RETRY.tries(time.monotonic() + self.cfg.node_timeout * 4, self.stop):
            if n:  # node 0 formed the last one without us: ask again, for the epoch after its newest
                self.store.set(f"join/{self.rank}", str(self.me))  # node 0 re-forms at its next round
                epoch = max(epoch, int(self._get("epoch"))) + 1
            try:
                self._form(epoch, None, first=False)
                return
            except _Reform:
                continue
        raise Timeout(f"node {self.rank}: the running nodes did not let this node in within "
                      f"{self.cfg.node_timeout * 4:g} s")

    # -- one exchange ------------------------------------------------------------

    def _exchange(self) -> None:
        import torch

        c, a = self.cfg, self.arena
        j = self.adopted + 1
        for _ in _CLOCK_POLL.tries():
            if a.clock() >= self._point(j):
                break
            if self.stop.is_set():
                return
            self._check_arena()
            self._state_due()  # the last exchange's, once it is due
        t0 = time.monotonic()
        held = c.max_node_lag == 0  # the loop stopped at this exchange point by itself
        local = self._read_local() if held else self._snapshot()
        w_x = local.w
        flag = 1.0 if self.rank == 0 and self._joiners() else 0.0
        payload = torch.cat([w_x - self.agreed.anchor, torch.tensor([flag])])
        if c.node_compress == "bf16":
            payload = payload.bfloat16()
        p = len(self.members)
        sx = self._sx
        # the optimizer state travels as float32 (bf16 would round Adam's squares and the step counts)
        extra = sx.payload(self.arena, local, self.agreed) if sx is not None else None
        work = self.pg.allreduce([payload])
        work_state = self.pg.allreduce([extra]) if extra is not None else None
        deadline = time.monotonic() + c.node_timeout + 1
        for _ in _CLOCK_POLL.tries():  # the loop trains on meanwhile, up to the hold
            if work.is_completed() and (work_state is None or work_state.is_completed()):
                break
            self._state_due()  # the last round's, while this one waits on a slow peer
            if time.monotonic() > deadline:
                raise _Reform(f"the exchange of round {self.agreed.round + 1} took more than --node-timeout")
            if self.stop.is_set():
                return
        try:
            work.wait()
            if work_state is not None:
                work_state.wait()
        except RuntimeError as e:
            raise _Reform(f"the exchange of round {self.agreed.round + 1} failed ({e})") from None
        mean = payload[:-1].float() / p
        old = self.agreed.anchor
        if c.outer_optimizer == "avg":
            new = old + mean
        elif c.outer_optimizer == "sum":
            new = old + payload[:-1].float()
        else:  # DiLoCo: outer SGD with Nesterov momentum on the pseudo-gradient -mean
            g = -mean
            m = self.agreed.momentum
            m.mul_(c.outer_momentum).add_(g)
            new = old - c.outer_lr * (g + c.outer_momentum * m)
        d_state = d_steps = None
        if sx is not None:
            state, steps = sx.combine(extra, self.agreed)
            d_state, d_steps = state - local.state, steps - local.steps
            self.agreed.state, self.agreed.steps = state, steps
        if held:  # since the snapshot: no update (j = 0)
            self._write_adopted(new - w_x, d_state, d_steps, local.steps)
        else:  # the loop ran on past the snapshot meanwhile: its updates since decay the state's change
            self._adopt(new - w_x, d_state, d_steps, local.steps)
        self.agreed.anchor = new
        self.agreed.round += 1
        self.adopted = j
        self._hold(self._point(j + 1 + c.max_node_lag))
        self.exchanges += 1
        sent = payload.numel() * payload.element_size() + (extra.numel() * 4 if extra is not None else 0)
        self.bytes_sent += int(sent * 2 * (p - 1) / p)  # ring: 2(p-1)/p
        self.last_exchange_unix = time.time()
        self.last_exchange_ms = (time.monotonic() - t0) * 1000
        self._state_due()
        if time.monotonic() - self._saved_at > _SAVE_EVERY_S:
            self._save_agreed()
        if payload[-1] > 0:
            raise _Reform("a node asked to join")

    # -- the agreed state on disk (for --resume) -------------------------------------

    def _save_agreed(self) -> None:
        """Write the agreed state as checkpoints are written (checkpoint.save_atomic)."""
        from psd.watchdog.checkpoint import save_atomic

        g = self.agreed
        if g is None:
            return
        tensors = {"anchor": g.anchor} | ({"momentum": g.momentum} if g.momentum is not None else {}) \
            | ({"state": g.state, "steps": g.steps} if g.state is not None else {})
        save_atomic(tensors, agreed_path(self.cfg.job),
                    {"round": str(g.round), "outer_optimizer": self.cfg.outer_optimizer})
        self._saved_at = time.monotonic()

    def _load_agreed(self) -> None:
        """With --resume: the agreed state this node's link saved last, if it fits the model."""
        from safetensors import safe_open

        path = agreed_path(self.cfg.job)
        if not self.cfg.resume or not path.exists():
            return
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata()
                anchor = f.get_tensor("anchor")
                momentum = f.get_tensor("momentum") if "momentum" in f.keys() else None
        except (OSError, ValueError, RuntimeError) as e:
            log.warning("node %d: %s is unreadable (%s); starting from the node's weights", self.rank, path, e)
            return
        if anchor.numel() != self._weights().numel():
            log.warning("node %d: %s holds another model; starting from the node's weights", self.rank, path)
            return
        if self.cfg.outer_optimizer == "nesterov" and momentum is None:
            import torch

            momentum = torch.zeros_like(anchor)
        self.agreed = _Agreed(anchor, momentum if self.cfg.outer_optimizer == "nesterov" else None,
                              int(meta["round"]))
        # Not the saved optimizer state: the node's own comes from its checkpoint, often older than this file, and
        # adopting the file's as the base would leave the node's step counts below the agreed ones (k < 0 in
        # _StateExchange.payload: the combined state grows without bound). The first epoch agrees on one node's
        # state instead, which every node adopts whole (_receive_agreed).
        log.info("node %d: resuming the agreed state of round %d from %s", self.rank, self.agreed.round, path)

    # -- life -----------------------------------------------------------------

    def _set_state(self, s: LinkState) -> None:
        self.state = s
        self._write_state()

    def _state_due(self) -> None:
        """Write the state file if an exchange since its last write has not been written yet and the file is
        at least ``_STATE_EVERY_S`` old: at K = 1 there can be hundreds of exchanges a second."""
        if self._written_round != self.agreed.round and time.monotonic() - self._written_at > _STATE_EVERY_S:
            self._write_state()

    def _write_state(self) -> None:
        c = self.cfg
        lag = 0
        if self.arena is not None and self.state == LinkState.RUNNING:
            lag = max(0, (self.arena.clock() - self.base) // c.sync_every - self.adopted)
        st = {"job": c.job, "pid": self.me, "pid_start_time": self.me_start, "state": self.state.value,
              "node_rank": self.rank, "nnodes": c.nnodes, "master": f"{c.master_addr}:{c.master_port}",
              "epoch": self.epoch, "peers": self.members, "round": self.agreed.round if self.agreed else 0,
              "exchanges": self.exchanges, "reforms": self.reforms, "sync_every": c.sync_every,
              "outer_optimizer": c.outer_optimizer, "max_node_lag": c.max_node_lag, "lag": lag,
              "last_exchange_unix": self.last_exchange_unix, "last_exchange_ms": round(self.last_exchange_ms, 2),
              "bytes_sent": self.bytes_sent}
        self._written_at = time.monotonic()
        self._written_round = self.agreed.round if self.agreed else -1
        path = state_path(c.job)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{self.me}")
        tmp.write_text(json.dumps(st))
        os.replace(tmp, path)

    def run(self) -> int:
        """Link this node to the others until stopped; returns the exit status."""
        c = self.cfg
        try:
            self._open_arena(time.monotonic() + max(60.0, c.node_timeout))
            # No update until this node holds the agreed weights: its learners must not train on weights
            # the other nodes will never see (a node that rejoins: weights they have left behind).
            self._hold(self.arena.clock())
            self._load_agreed()
            self._connect()
            self._join()
            why = ""
            while not self.stop.is_set():
                try:
                    if why:
                        self._reform(why)
                        why = ""
                    self._exchange()
                except _Reform as e:
                    why = str(e)
                    self._hold(-1)  # the node trains on alone while the next epoch forms
            self._save_agreed()
            self._set_state(LinkState.STOPPED)
            return 0
        except (Error, RuntimeError, OSError) as e:
            if self.stop.is_set():
                self._save_agreed()
                self._set_state(LinkState.STOPPED)
                return 0
            self.state = LinkState.FAILED
            self._write_state()
            print(f"psd nodelink: node {self.rank} of job {c.job!r}: {e}", file=sys.stderr, flush=True)
            return 2
        finally:
            if self.arena is not None:
                try:
                    self._hold(-1)  # never leave the loop held behind us (the mapping the watch opened)
                except Error:
                    pass
                self._watch.close()


def _die_with_parent() -> None:
    """SIGTERM when the watchdog that started us dies, however it dies: the watchdog that replaces it
    starts its own link, and a node must never have two."""
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    """``python -m psd.nodelink [psd serve flags]``: what a node's watchdog starts when --nnodes > 1."""
    from psd.flags import add_flags, serve_fields
    from psd.server import ServeConfig

    p = argparse.ArgumentParser(prog="python -m psd.nodelink", description="a node's link to the job's other "
                                "nodes (started by the watchdog of `psd serve --nnodes N`)")
    add_flags(p, "serve")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s psd nodelink[%(process)d]: %(message)s", datefmt="%H:%M:%S")
    cfg = ServeConfig(**{f.field: getattr(args, f.dest) for f in serve_fields()})
    cfg.betas = tuple(cfg.betas)
    try:
        validate_nodes(cfg)
    except ValueError as e:
        raise SystemExit(f"psd nodelink: {e}") from None
    link = NodeLink(cfg)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: link.stop.set())
    _die_with_parent()
    return link.run()


if __name__ == "__main__":
    sys.exit(main())
