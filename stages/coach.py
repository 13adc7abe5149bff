"""coach: the builds in a browser (an action, not an artifact). `doit coach` serves, on
127.0.0.1 only and read-only, the recipe catalogue, each recipe's status and why, its stage graph
with keys and digests, its current report, every build of it in the store and a diff of any two,
its dropped rows (searchable), and a link to its model where `doit serve` is serving it
(stages/view/coach.py). No GPU needed; Ctrl-C stops it."""
from __future__ import annotations

import signal

from doit.exceptions import TaskFailed

PORT = 8321


def run(table: dict, port: int):
    import uvicorn

    from stages.view.coach import build_app

    server = uvicorn.Server(uvicorn.Config(build_app(table), host="127.0.0.1", port=port, log_level="warning"))
    print(f"coach: http://127.0.0.1:{port}/ (read-only; Ctrl-C stops it)", flush=True)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot bind
        return TaskFailed(f"coach: cannot listen on 127.0.0.1:{port} (in use?); pass --port")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("coach: stopped", flush=True)
    return None


def task(table: dict) -> dict:
    return {"actions": [(run, [table])], "uptodate": [False], "verbosity": 2,
            "doc": "the builds in a browser: catalogue, status, stages, reports, history and diffs (read-only)",
            "params": [{"name": "port", "long": "port", "type": int, "default": PORT,
                        "help": f"port on 127.0.0.1 to listen on (default {PORT})"}]}
