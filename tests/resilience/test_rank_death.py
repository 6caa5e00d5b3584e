"""A rank dies: two single-rank "nodes" (the loopback hostfile, one deepspeed launcher per node,
as on a real cluster, so that no launcher kills the other node's rank for us). Rank 1 is killed
with SIGKILL at step 4; rank 0 notices within the heartbeat timeout, prints which rank and host
went silent and the last step each rank completed, and both nodes exit non-zero. No hang."""

import re
import socket
import subprocess
import time

import pytest

from tests.conftest import BIN, ROOT, SMALL, env, free_port, kill_tree

pytestmark = pytest.mark.slow
TIMEOUT_S = 20


def test_a_killed_rank_is_named_and_every_process_exits(stdlib_data, tmp_path):
    port = free_port()
    args = [
        "--out",
        str(tmp_path),
        "--data",
        str(stdlib_data),
        "--max-steps",
        "8",
        "--save-every",
        "0",
        "--val-every",
        "0",
        *SMALL,
        "--set",
        "train.val_samples=0",
        "--set",
        f"train.heartbeat_timeout_s={TIMEOUT_S}",
        "--set",
        "train.collective_timeout_s=120",
    ]
    e = {**env(), "ANNEAL_FAULTS": "kill@step=4:rank=1"}
    nodes = [
        subprocess.Popen(
            [
                str(BIN / "deepspeed"),
                "--hostfile",
                "hostfiles/loopback",
                "--no_ssh",
                "--node_rank",
                str(k),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                "recipes/pretrain_tiny.py",
                *args,
            ],
            cwd=ROOT,
            env=e,
            start_new_session=True,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for k in (0, 1)
    ]
    ended: dict[int, float] = {}
    try:
        deadline = time.monotonic() + 400
        while len(ended) < 2 and time.monotonic() < deadline:
            for k, node in enumerate(nodes):
                if k not in ended and node.poll() is not None:
                    ended[k] = time.monotonic()
            time.sleep(0.2)
        assert len(ended) == 2, "a node did not exit: the job hangs"
        outs = [node.communicate() for node in nodes]
    finally:
        for node in nodes:
            kill_tree(node)
    assert nodes[0].returncode != 0 and nodes[1].returncode != 0
    assert ended[0] - ended[1] < TIMEOUT_S + 15  # rank 0 noticed within the timeout
    err0 = outs[0][1]
    host = socket.gethostname()
    assert f"rank 1 on {host} went silent" in err0, err0[-3000:]
    # rank 1's step is the one its last heartbeat wrote (every TIMEOUT_S / 10 = 2 s, not every
    # step), so it may lag the step it was killed after by the steps of one interval
    assert re.search(r"Last step completed by each rank: rank 0: 3, rank 1: [0-3] \(", err0)
