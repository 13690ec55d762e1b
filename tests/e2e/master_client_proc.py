"""A stand-in stage replica for tests/e2e/test_master.py: registers, heartbeats, acks commands.

argv: ADDRESS STAGE_ID [REPLICA_HINT]; env OMNI_TEST_PIPELINE (JSON config), optional OMNI_TOKEN.
Prints one JSON line per (re-)registration and per command. SIGTERM: deregister and exit.
"""

import json
import os
import signal
import sys
import threading

from omni.master.client import MasterClient
from omni.master.configdiff import hash_config


def main() -> None:
    address, stage_id = sys.argv[1], int(sys.argv[2])
    hint = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    config = json.loads(os.environ["OMNI_TEST_PIPELINE"])
    state = {"sleeping": False, "requests": 0, "draining": False}

    def say(**kw) -> None:
        print(json.dumps(kw), flush=True)

    def load() -> dict:
        state["requests"] += 1
        return {"queue_len": 1, "in_flight": 2, "requests_total": state["requests"],
                "is_sleeping": state["sleeping"], "draining": state["draining"], "gpu_util": 0.5}

    def on_command(cmd):
        say(command=cmd.kind, args=cmd.args)
        if cmd.kind == "SLEEP":
            state["sleeping"] = True
        elif cmd.kind == "WAKE_UP":
            state["sleeping"] = False
        elif cmd.kind in ("DRAIN", "UNDRAIN"):
            state["draining"] = cmd.kind == "DRAIN"
        return True, f"{cmd.kind} done by pid {os.getpid()}"

    client = MasterClient(address, token=os.environ.get("OMNI_TOKEN"))
    reg = client.register("STAGE", stage_id, config_hash=hash_config(config), pipeline_config=config,
                          endpoints={"channel": f"tcp://127.0.0.1:{40000 + os.getpid() % 20000}"},
                          replica_hint=hint, wait_s=10)
    say(registered=reg.replica_id)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client.start_keepalive(load, on_command, interval_s=0.2,
                           on_registration=lambda r: say(registered=r.replica_id, again=True))
    stop.wait()
    client.deregister()
    client.close()


if __name__ == "__main__":
    main()
