"""``{"all": true}`` releases what the daemon holds as one step: a worker that another
path drops meanwhile (the loop finding it exited, a named NPU npu-smi contradicts) is
never a 404 for the whole request. A real in-process daemon, real workers."""

from __future__ import annotations

import contextlib
import os
import threading

from ascendbind.daemon.api.auth import Peer
from ascendbind.daemon.heart.daemon import Daemon
from ascendbind.values.config import Config
from tests.daemon_harness import FIXTURE_BIN
from tests.workers import start_worker

ROOT_PEER = Peer(os.getpid(), 0, 0)
WORKERS = 6
ROUNDS = 20


def test_release_all_racing_drops_answers_and_leaves_every_worker_unbound(tmp_path):
    d = Daemon(Config(small_pool="share", allow_shared_npu=True, state_dir=str(tmp_path / "state"), memory_check_seconds=0,
                      npu_smi=str(FIXTURE_BIN / "npu-smi")))
    d.npu_check.close()
    try:
        with contextlib.ExitStack() as stack:
            workers = [stack.enter_context(start_worker(plain=1, acl=0, release=0)) for _ in range(WORKERS)]
            before = {w.pid: w.cpus_allowed() for w in workers}
            for _ in range(ROUNDS):
                for w in workers:
                    d.bind_request(ROOT_PEER, {"pid": w.pid, "npu": 0})
                assert set(d.held) == set(before)
                go = threading.Barrier(2)

                def drop_all() -> None:
                    go.wait()
                    for pid in reversed(sorted(before)):  # from the other end: they meet midway
                        d.drop(pid, "exited")

                dropper = threading.Thread(target=drop_all)
                dropper.start()
                go.wait()
                try:
                    answer = d.release_request(ROOT_PEER, {"all": True})
                finally:
                    dropper.join()
                # whatever it released was held, once; the rest the other path had dropped
                assert set(answer["released"]) <= set(before) and len(set(answer["released"])) == len(
                    answer["released"]), answer
                assert d.held == {}
            for w in workers:
                assert w.cpus_allowed() == before[w.pid]
    finally:
        d.close()
