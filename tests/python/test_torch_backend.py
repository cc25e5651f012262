"""The torch.distributed backend "hcomm" and tensor windows, end to end (pytest).

Ranks are real processes started torchrun-style (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE; torch's
TCPStore on MASTER_PORT, hcomm bootstrapping through it) or by hcomm-run (the NPU engine: it starts
hcomm-sim). Needs HCOMM_BUILD_DIR (meson sets it). Every launch is bounded.
"""
import os
import socket
import subprocess
import sys

import pytest

BUILD = os.environ.get("HCOMM_BUILD_DIR", "")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PY = "/usr/bin/python3"

pytestmark = pytest.mark.skipif(not BUILD, reason="HCOMM_BUILD_DIR is not set (run through meson test)")


def env_for(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(BUILD, "python")
    for k in ("HCOMM_ENGINE", "HCOMM_TRANSPORTS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n, argv, timeout=180, extra=None):
    """Starts n ranks torchrun-style; returns [(returncode, output)] by rank."""
    port = free_port()
    procs = []
    for r in range(n):
        env = env_for(extra)
        env.update(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([PY] + argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    out = []
    for p in procs:
        try:
            o, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            o, _ = p.communicate()
            o += "\n[timed out after %d s]" % timeout
        out.append((p.returncode, o))
    return out


def hcomm_run(n, argv, extra=None, sim=False, timeout=180):
    cmd = [os.path.join(BUILD, "tools", "hcomm-run"), "-n", str(n), "--timeout", str(timeout)]
    if sim:
        cmd.append("--sim")
    cmd += ["--", PY] + argv
    p = subprocess.run(cmd, env=env_for(extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout + 30)
    return p.returncode, p.stdout


WORKERS = os.path.join(HERE, "torch_workers.py")


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("scenario", ["p2p", "collectives", "windows", "timeout_withdraws"])
def test_host_engine(scenario, ranks):
    res = launch(ranks, [WORKERS, scenario], extra={"HCOMM_ENGINE": "host"})
    everything = "\n".join("--- rank %d (exit %s):\n%s" % (r, rc, out) for r, (rc, out) in enumerate(res))
    for r, (rc, out) in enumerate(res):
        assert rc == 0 and ("rank %d ok" % r) in out, everything
        assert "engine host" in out


@pytest.mark.parametrize("scenario", ["p2p", "collectives", "windows"])
def test_npu_engine(scenario):
    rc, out = hcomm_run(2, [WORKERS, scenario], extra={"HCOMM_ENGINE": "npu"}, sim=True)
    assert rc == 0 and "rank 0 ok" in out and "rank 1 ok" in out, out
    assert "engine npu" in out, out


def test_killed_rank_raises_peer_failure_in_the_others():
    res = launch(3, [WORKERS, "killed_peer"], extra={"HCOMM_ENGINE": "host"}, timeout=120)
    rc_dead, _ = res[2]
    assert rc_dead == -9, "rank 2 should have been SIGKILLed, exit %s" % rc_dead
    for r in (0, 1):
        rc, out = res[r]
        assert rc == 0 and ("rank %d ok" % r) in out and "peer failure" in out, "rank %d:\n%s" % (r, out)


@pytest.mark.parametrize("engine", ["host", "npu"])
def test_python_demos(engine):
    for demo in ("point_to_point.py", "put_get.py"):
        rc, out = hcomm_run(2, [os.path.join(ROOT, "examples", "python", demo)], extra={"HCOMM_ENGINE": engine},
                            sim=engine == "npu")
        assert rc == 0, out
        sums = [line.rsplit(" ", 1)[1] for line in out.splitlines() if " sum " in line]
        assert len(sums) == 2 and sums[0] == sums[1], "the two ranks disagree:\n" + out


def test_demo_under_torchrun_style_launch():
    res = launch(2, [os.path.join(ROOT, "examples", "python", "point_to_point.py")])
    outs = "".join(o for _, o in res)
    assert all(rc == 0 for rc, _ in res), outs
    assert "rank 1 received (1024, 1024)" in outs


@pytest.mark.skipif(not os.path.exists("/usr/bin/torchrun"), reason="Debian's torchrun is not installed")
def test_demo_under_torchrun():
    # Debian's torchrun on Python 3.11 needs --redirects/--tee (docs/python.md)
    p = subprocess.run(["/usr/bin/torchrun", "--redirects", "1", "--tee", "1", "--nproc_per_node=2",
                        "--master_port=%d" % free_port(), os.path.join(ROOT, "examples", "python", "put_get.py")],
                       env=env_for(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
    assert p.returncode == 0, p.stdout
    assert "rank 0 put and got back (1024, 1024)" in p.stdout and "rank 1 window holds" in p.stdout, p.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
