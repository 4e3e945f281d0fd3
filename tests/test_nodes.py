"""Several nodes (psd/nodelink.py), as several psd jobs on this machine: one --master-port, 127.0.0.1 only.

Each node is a real `psd run` (launcher, watchdog, server, learners, node link); the nodes meet over
torch.distributed's gloo. The learners (tests/helpers/node_learner.py) wait until their node link has
formed before they train.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import HELPERS, arena_header, child_env, wait_until
from psd import _native, gain
from psd.arena import shm_name, shm_path
from psd.errors import Error

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(job: str, rank: int, port: int, tmp: Path, *flags: str, learner: tuple[str, ...] = ()) -> subprocess.Popen:
    """`psd run` for node ``rank`` of 2, its output in tmp/node<rank>.out and .err."""
    argv = [sys.executable, "-m", "psd.cli", "run", "--job", f"{job}-n{rank}", "--nnodes", "2", "--node-rank",
            str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port), "--checkpoint-every", "0",
            "--checkpoint-dir", str(tmp / f"ck{rank}"), *flags, "--", sys.executable,
            str(HELPERS / "node_learner.py"), *learner]
    return subprocess.Popen(argv, stdout=open(tmp / f"node{rank}.out", "w"), stderr=open(tmp / f"node{rank}.err", "w"),
                            env=child_env(), start_new_session=True)


def link_state(job: str) -> dict:
    try:  # the children's XDG_STATE_HOME (child_env), where their links write
        return json.loads((Path(child_env()["XDG_STATE_HOME"]) / "psd" / "nodes" / f"{job}.json").read_text())
    except (OSError, ValueError):
        return {}


def stop(proc: subprocess.Popen, timeout: float = 60) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    return proc.wait(timeout)


def test_bad_node_flags_say_what_to_do():
    r = subprocess.run([sys.executable, "-m", "psd.cli", "serve", "--job", "x", "--nnodes", "2", "--node-rank", "2"],
                       capture_output=True, text=True, env=child_env(), timeout=60)
    assert r.returncode != 0 and "--node-rank must be 0..1 (--nnodes 2), not 2" in r.stderr


def test_two_nodes_in_lockstep_equal_one_process_with_the_combined_batch(job, tmp_path):
    """2 nodes x 2 learners, bsp inside each node, --max-node-lag 0 (the default --sync-every 1): every step
    is plain SGD on the 4 learners' combined batch, at 2 x lr with the default outer step (sum: each node's step counts,
    as one node of 4 learners taking both nodes' steps); then the whole job, resumed with --resume on both
    nodes and --outer-optimizer avg, goes on from the agreed state as if it had never stopped, at lr (avg:
    the nodes' mean step). Both outer steps in one job: avg from a fresh start was a third start of both
    nodes for the same check. In the first phase each step takes 1.2 s, so each link waits over a second for
    its clock (1,200 polls): no link may die of it (it did, of OverflowError in its poll's back-off)."""
    sys.path.insert(0, str(HELPERS))
    from safetensors import safe_open
    from sync_learner import exact_problem

    steps, lr = 4, 2.0 ** -4
    model, x, y = exact_problem()
    refs = []
    for outer in ("sum", "avg"):
        opt = torch.optim.SGD(model.parameters(), lr=lr * (2 if outer == "sum" else 1))
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        refs.append((outer, model.weight.detach().reshape(-1).clone()))
    for phase, (outer, ref) in enumerate(refs):
        port = free_port()
        procs = [node(job, r, port, tmp_path, "--learners", "2", "--sync", "bsp", "--lr", repr(lr),
                      "--max-node-lag", "0", "--outer-optimizer", outer, "--node-timeout", "20",
                      *(["--resume"] if phase else []),
                      learner=("--steps", str(steps), "--step-s", "0" if phase else "1.2")) for r in range(2)]
        for r, p in enumerate(procs):
            assert p.wait(timeout=100) == 0, (tmp_path / f"node{r}.err").read_text()
        for r in range(2):
            logs = "\n".join((tmp_path / f"node{i}.err").read_text() for i in range(2))
            outs = [json.loads(line) for line in (tmp_path / f"node{r}.out").read_text().splitlines()
                    if line[:1] == "["]
            assert len(outs) == 2, logs
            assert "restarting it" not in logs, logs  # no link (nor server) died and was restarted
            for out in outs:
                assert torch.allclose(torch.tensor(out), ref, atol=1e-6), \
                    f"{outer}, node {r}: {out} != {ref.tolist()}\n{logs}"
            st = link_state(f"{job}-n{r}")
            assert (st["round"], st["peers"], st["state"]) == ((phase + 1) * steps, [0, 1], "stopped"), f"{st}\n{logs}"
            # The agreed state, saved at the stop for --resume: the last round's weights.
            saved = Path(child_env()["XDG_STATE_HOME"]) / "psd" / "nodes" / f"{job}-n{r}.agreed.safetensors"
            with safe_open(str(saved), "pt") as f:
                assert f.metadata()["round"] == str((phase + 1) * steps)
                assert f.metadata()["outer_optimizer"] == outer
                assert torch.allclose(f.get_tensor("anchor"), ref, atol=1e-6)
            assert not os.path.exists(shm_path(f"{job}-n{r}"))


def test_a_node_that_never_arrives_is_a_clear_timeout(job, tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(4)}, str(tmp_path / "init.safetensors"))  # weights without a learner
    p = subprocess.Popen([sys.executable, "-m", "psd.cli", "serve", "--job", job, "--init",
                          str(tmp_path / "init.safetensors"), "--nnodes", "2", "--master-port", str(free_port()),
                          "--node-timeout", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--optimizer", "momentum"],
                         stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err", "w"), env=child_env())
    err = tmp_path / "err"
    try:
        # Two nodes at the default --sync-every 1 train as one job: the update loop's momentum rule takes the
        # job's staleness (psd/gain.py node_terms), here the exchange's lag alone (no update yet, level 0).
        def configured() -> dict | None:
            try:
                h = arena_header(job)
            except Error:  # not there yet, or not yet whole
                return None
            return h if h["state"] >= _native.ARENA_READY else None

        h = wait_until(configured, timeout=60, what="the server to configure the arena")
        assert (h["nodes"], h["node_lag"], h["staleness_avg"], h["gain_level"]) == (2, 1.0, 0.0, 0.0), h
        assert h["momentum_now"] == pytest.approx(gain.rule(0.9, 1.0, 0.0)[0])  # 0.9 - 1/2, not one node's 0.9
        wait_until(lambda: "did not arrive within --node-timeout 2 s" in err.read_text(), timeout=60,
                   what="node 0 to give up on node 1")
        assert "--node-rank R --master-addr 127.0.0.1" in err.read_text()
        wait_until(lambda: "restarting it" in err.read_text(), timeout=30, what="its watchdog to retry")
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, err.read_text()
    assert not os.path.exists(shm_path(job))


def test_a_killed_node_link_comes_back_and_a_killed_node_stops_nobody(job, tmp_path):
    """Node 1's link SIGKILLed alone: its watchdog restarts it and it rejoins. Then all of node 1
    SIGKILLed: node 0 goes on alone after at most the timeout; node 1 started again rejoins; both stop,
    leaving nothing in /dev/shm. With Adam, whose moments and step counts the exchange combines: a link
    that rejoins receives them with the weights."""
    port, timeout = free_port(), 3
    flags = ("--learners", "1", "--lr", "0.01", "--optimizer", "adam", "--sync-every", "5", "--max-node-lag", "1",
             "--node-timeout", str(timeout))
    procs = [node(job, r, port, tmp_path, *flags, learner=("--forever",)) for r in range(2)]
    n0, n1 = f"{job}-n0", f"{job}-n1"
    try:
        wait_until(lambda: link_state(n1).get("round", 0) >= 3, timeout=60, what="3 rounds")
        first = link_state(n1)["pid"]
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: (lambda s: s.get("pid") != first and s.get("state") == "running" and s["peers"] == [0, 1]
                            and s["exchanges"] >= 2)(link_state(n1)), timeout=60, what="node 1's new link to rejoin")
        # Now the whole of node 1: every process of it, its arena left behind as a crash leaves it.
        h = _native.open(shm_name(n1)).header()
        pids = [procs[1].pid, h["watchdog_pid"], h["server_pid"], link_state(n1)["pid"]]  # learners: PDEATHSIG
        for pid in set(pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        procs[1].wait(30)
        before = link_state(n0)["round"]
        wait_until(lambda: link_state(n0).get("peers") == [0] and link_state(n0)["round"] >= before + 3,
                   timeout=4 * timeout + 10, what="node 0 to go on alone")
        # Node 1 restarted with the same --node-rank (its crashed arena taken over): it rejoins.
        dead_link = link_state(n1)["pid"]
        procs[1] = node(job, 1, port, tmp_path, *flags, learner=("--forever",))
        wait_until(lambda: (lambda s: s.get("pid") != dead_link and s.get("peers") == [0, 1]
                            and s.get("exchanges", 0) >= 2)(link_state(n1)), timeout=60,
                   what="the restarted node 1 to rejoin")
        assert link_state(n0)["peers"] == [0, 1]
    finally:
        assert stop(procs[0]) == 130, (tmp_path / "node0.err").read_text()
        n1_code = stop(procs[1])
        n1_left = os.path.exists(shm_path(n1))
        if n1_left:
            _native.unlink(shm_name(n1))
    assert not os.path.exists(shm_path(n0)), "node 0 stops cleanly"
    assert n1_code == 130 and not n1_left, "the restarted node 1 stops cleanly"
    assert "forming the next epoch" in (tmp_path / "node0.err").read_text()


def _combined_reference(optimizer: str, lr: float, rounds: int, start: tuple | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """What two nodes in lockstep that combine their optimizer state hold after ``rounds`` exchanges, each node
    taking one step a round of its learner's fixed gradient (node_learner.fixed_grad) from the agreed weights
    and state: (weights, state vectors, each tensor's step count), in float64. The combination
    (psd/nodelink.py _StateExchange): s' = beta^2 s0 + (1 - beta^2) / (2 (1 - beta)) sum_n (s_n - beta s0)
    (the additions whole where beta = 1), steps summed; weights: the sum of the nodes' deltas. ``start``: the
    (weights, state, steps) to go on from (the learners count their gradients from 0 again)."""
    sys.path.insert(0, str(HELPERS))
    from sync_learner import fixed_grad

    b1, b2, mu, eps, wd = 0.9, 0.999, 0.9, 1e-8, 0.01
    adam = optimizer in ("adam", "adamw")
    w = torch.zeros(4, dtype=torch.float64)
    s = torch.zeros(2 if adam else 1, 4, dtype=torch.float64)
    t = 0
    if start is not None:
        w, s, t = (x.clone() if isinstance(x, torch.Tensor) else x for x in start)
    for r in range(rounds):
        dw, adds = torch.zeros(4, dtype=torch.float64), torch.zeros_like(s)
        for n in range(2):
            g = fixed_grad(n, r).reshape(-1).double()
            if adam:
                m = b1 * s[0] + (1 - b1) * g
                v = b2 * s[1] + (1 - b2) * g * g
                step = t + 1
                if optimizer == "adamw":
                    dw -= lr * wd * w
                dw -= lr / (1 - b1 ** step) * m / ((v / (1 - b2 ** step)).sqrt() + eps)
                adds += torch.stack([m - b1 * s[0], v - b2 * s[1]])
            elif optimizer in ("momentum", "nesterov"):
                b = g if t == 0 else mu * s[0] + g
                dw -= lr * (g + mu * b if optimizer == "nesterov" else b)
                adds += (b - mu * s[0])[None]
            else:  # adagrad
                acc = s[0] + g * g
                dw -= lr * g / (acc.sqrt() + 1e-10)
                adds += (acc - s[0])[None]
        beta = torch.tensor([[b1], [b2]] if adam else [[1.0 if optimizer == "adagrad" else mu]], dtype=torch.float64)
        s = beta ** 2 * s + (1 + beta) / 2 * adds  # (1 - beta^2) / (2 (1 - beta)); 1 at beta = 1
        w, t = w + dw, t + 2
    return w, s, t


@pytest.mark.parametrize("optimizer,node_state", [("adam", "auto"), ("adamw", "auto"), ("momentum", "auto"),
                                                  ("nesterov", "auto"), ("adagrad", "sum"), ("adagrad", "auto")])
def test_two_nodes_combine_their_optimizer_state_as_one_node(job, tmp_path, optimizer, node_state):
    """2 nodes x 1 learner in lockstep (--max-node-lag 0), --node-state auto (sum for Adagrad): each exchange adds
    the nodes' changes of the optimizer state as it adds their weights', so the agreed moments (Adam's m and
    v, the momentum buffer, Adagrad's sum) decay once per update of either node, hold both nodes' gradients,
    and each tensor's step count (Adam's bias correction) counts both nodes' steps: 2 a round, where a node
    keeping its own state counts 1. Fixed gradients (no timing in the arithmetic); checked against the rule
    computed here, in the agreed state the links save at the stop (weights, state, step counts). auto keeps
    Adagrad's sums per node: nothing of the state in the agreed state then. With Adam, the job then resumed
    (--resume on both nodes) goes on as if it had never stopped: each node's state and step counts from its
    checkpoint at the stop, where lockstep left them equal to the agreed state (--resume once took the saved
    agreed state as the base, and the state grew without bound)."""
    from safetensors import safe_open

    lr, steps = 0.1, 4
    resumes = optimizer == "adam"
    ref = None
    for phase in range(2 if resumes else 1):
        port = free_port()
        procs = [node(job, r, port, tmp_path, "--learners", "1", "--optimizer", optimizer, "--lr", repr(lr),
                      "--async-momentum", "off", "--max-node-lag", "0", "--node-timeout", "20", "--node-state",
                      node_state, *(["--resume"] if phase else []),
                      learner=("--steps", str(steps), "--fixed-grad")) for r in range(2)]
        for r, p in enumerate(procs):
            assert p.wait(timeout=100) == 0, (tmp_path / f"node{r}.err").read_text()
        logs = "\n".join((tmp_path / f"node{i}.err").read_text() for i in range(2))
        ref = _combined_reference(optimizer, lr, steps, ref)
        for r in range(2):
            saved = Path(child_env()["XDG_STATE_HOME"]) / "psd" / "nodes" / f"{job}-n{r}.agreed.safetensors"
            with safe_open(str(saved), "pt") as f:
                rounds = int(f.metadata()["round"])
                if optimizer == "adagrad" and node_state == "auto":
                    assert set(f.keys()) == {"anchor"}, f"node {r}: {f.keys()}"
                    continue
                anchor, state, pieces = f.get_tensor("anchor"), f.get_tensor("state"), f.get_tensor("steps")
            assert rounds == steps * (phase + 1), logs
            w, s, t = ref
            assert pieces.tolist() == [t], f"phase {phase}, node {r}: step counts {pieces.tolist()}, not {t}\n{logs}"
            assert torch.allclose(state.double(), s, rtol=1e-5, atol=1e-7), \
                f"phase {phase}, node {r}: {state} != {s}\n{logs}"
            assert torch.allclose(anchor.double(), w, rtol=1e-5, atol=1e-6), \
                f"phase {phase}, node {r}: {anchor} != {w}\n{logs}"


def test_the_state_exchange_scales_alike_additions_and_decays_an_adoption_by_the_updates_since(job, serve):
    """On a real arena (a server with momentum, three updates applied, then idle): (1) two nodes, 3 and 5
    updates of one constant gradient c past the agreed buffer s0, combine to what one node applying all 8
    holds, beta^8 s0 + c (1 - beta^8) / (1 - beta), step counts summed, where the plain sum of their additions
    holds more; (2) an adoption against a snapshot two updates old is decayed by beta^2, as those two updates
    decayed the snapshot; against the state as it stands, whole."""
    from psd import learner
    from psd.arena import open_job
    from psd.nodelink import _Agreed, _Local, _StateExchange

    serve(job, "--no-watchdog", "--learners", "1", "--optimizer", "momentum", "--momentum", "0.9", "--lr", "0.01",
          "--async-momentum", "off")
    model = torch.nn.Linear(3, 2)
    with learner.attach(model, job=job) as ps:
        opt = learner.Optimizer(model, learner=ps)
        for _ in range(3):
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
        ps.flush()
    a = open_job(job)
    try:
        sx = _StateExchange(a, "momentum")
        beta = float(a.header()["momentum_now"])
        assert beta == pytest.approx(0.9)
        n = sum(p.numel() for p in model.parameters())
        s0 = torch.linspace(-1, 1, n)[None].float()
        c = torch.linspace(0.5, 2, n)[None].float()
        steps0 = torch.full((sx.n_pieces,), 7, dtype=torch.int64)
        agreed = _Agreed(torch.zeros(n), None, 0, s0, steps0)

        def after(k: int) -> torch.Tensor:  # the buffer after k updates of c from s0
            return beta ** k * s0 + c * (1 - beta ** k) / (1 - beta)

        summed = sx.payload(a, _Local(None, after(3), steps0 + 3), agreed) + sx.payload(
            a, _Local(None, after(5), steps0 + 5), agreed)
        state, steps = sx.combine(summed, agreed)
        assert torch.allclose(state, after(8), rtol=1e-5, atol=1e-6), (state, after(8))
        assert steps.tolist() == [7 + 8] * sx.n_pieces
        plain = beta ** 8 * s0 + (after(3) - beta ** 3 * s0) + (after(5) - beta ** 5 * s0)
        assert not torch.allclose(plain, after(8), rtol=1e-2), "the plain sum would overcount"

        vecs, now = sx.views(a)
        before = vecs[0].clone()
        d = torch.linspace(1, 2, n)[None].float()
        zero = torch.zeros_like(now)
        sx.adopt(a, d, zero, since=now.clone() - 2)
        assert torch.allclose(vecs[0], before + beta ** 2 * d[0], rtol=1e-5, atol=1e-6)
        sx.adopt(a, -d, zero, since=now.clone())
        assert torch.allclose(vecs[0], before + (beta ** 2 - 1) * d[0], rtol=1e-5, atol=1e-6)
        del vecs, now
    finally:
        a.close()


def test_the_state_exchange_combines_each_vector_and_tensor_by_its_own_updates():
    """Adam's two vectors (beta1, beta2) over two tensors (3 and 5 elements), three nodes with different update
    counts per tensor, one of them 0 on a tensor: each (vector, tensor) combines to one node's state after the
    sum of the nodes' updates of that tensor, alike gradients; step counts summed per tensor. A transposed or
    pooled layout of the payload's per-(vector, tensor) parts fails it."""
    from psd.nodelink import _Agreed, _Local, _StateExchange

    betas = torch.tensor([0.9, 0.999], dtype=torch.float64)
    sx = object.__new__(_StateExchange)
    sx.optimizer, sx.decays = "adam", ("beta1", "beta2")
    sx.lens = torch.tensor([3, 5])
    sx.n_pieces = 2
    sx.log_decays = lambda arena: torch.log(betas)  # the header's betas, without an arena
    s0 = torch.stack([torch.linspace(-1, 1, 8), torch.linspace(0.1, 0.9, 8)]).float()
    c = torch.stack([torch.linspace(2, -2, 8), torch.linspace(0.5, 1.5, 8)]).float()  # each vector's term
    steps0 = torch.tensor([10, 4])
    agreed = _Agreed(torch.zeros(8), None, 0, s0, steps0)

    def after(k: torch.Tensor) -> torch.Tensor:  # (vectors, 8): k[t] updates of c on tensor t from s0
        kk = sx.expand(k[None, :].double().expand(2, -1))
        b = betas[:, None] ** kk
        return (b * s0 + c * (1 - b) / (1 - betas[:, None])).float()

    ks = [torch.tensor([3, 0]), torch.tensor([5, 2]), torch.tensor([0, 1])]
    summed = sum(sx.payload(None, _Local(None, after(k), steps0 + k), agreed) for k in ks)
    state, steps = sx.combine(summed, agreed)
    total = ks[0] + ks[1] + ks[2]
    assert steps.tolist() == (steps0 + total).tolist()
    assert torch.allclose(state, after(total), rtol=1e-5, atol=1e-6), (state, after(total))
