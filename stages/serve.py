"""serve: the recipe's model behind an OpenAI-compatible API, gated by its receipt (an action,
not an artifact).

`doit serve:<recipe>` serves the trained model (`--quantized`: the quantized export) of the
recipe's current manifest. Before loading anything it checks every file of the artifacts it
loads from against the manifest (the stat cache, or every byte with --full) and refuses in one
line naming the first that differs. The model's id is the recipe and a prefix of the manifest's
digest. vLLM serves it where vLLM and a GPU are present (serve.engine auto or vllm); elsewhere
a FastAPI app over transformers' generation (stages/inference/), which bounds what clients send
(its limits are on the startup line; --time-limit sets how long one generation may hold the
model). Served by transformers on a GPU, the trained model is compiled and warmed up before it
answers (--eager skips it). What the libraries print while the model loads goes to
artifacts/<recipe>/serve.log (appended to at each start).
SIGTERM or Ctrl-C stops it cleanly. It does not build: run `doit manifest:<recipe>` first.
"""
from __future__ import annotations

import os
import signal
import subprocess
from contextlib import contextmanager

from doit.exceptions import TaskFailed

from stages.engine import jsontext, project
from stages.engine.errors import UserError
from stages.engine.store import write_json
from stages.engine.terminal import captured
from stages.inference import vllm
from stages.inference.served import Served, served


def checked(recipe_name: str, quantized: bool, full: bool, scheme: str | None = None) -> tuple[Served, str]:
    """What the recipe's manifest serves, once its files match the receipt, and the manifest's
    digest; raises UserError naming the first file that does not match."""
    st = project.store()
    ptr = st.pointer(recipe_name, "manifest")
    if ptr is None:
        raise UserError(f"serve:{recipe_name}: no manifest to serve from; run doit manifest:{recipe_name}")
    refuse = (f"serve:{recipe_name}: refusing to serve: {{}}, not as manifest {ptr['digest'][:12]} records it; "
              f"doit verify:{recipe_name} lists every difference, doit manifest:{recipe_name} rebuilds")
    for problem in st.damage("manifest", ptr["key"], full=full):
        raise UserError(refuse.format(f"manifest: {problem}"))
    manifest = jsontext.read(st.path("manifest", ptr["key"]) / "manifest.json")
    arts = manifest["artifacts"]
    s = served(recipe_name, manifest, ptr["digest"], quantized, lambda stage: st.path(stage, arts[stage]["key"]), scheme)
    for stage in s.stages:
        for problem in st.damage(stage, arts[stage]["key"], full=full, files=arts[stage]["files"]):
            raise UserError(refuse.format(f"{stage}: {problem}"))
    return s, ptr["digest"]


def engine(recipe_name: str, wanted: str) -> str:
    """vllm where its command and a GPU are here (auto), else transformers; vllm asked for and
    absent is an error."""
    import torch

    present = vllm.executable() is not None and torch.cuda.is_available()
    if wanted == "vllm" and not present:
        raise UserError(f"serve:{recipe_name}: serve.engine is vllm but no vllm command and GPU are here; install "
                        f"vLLM in its own environment and set MINDXTRAIN_VLLM to its vllm (README: Serving), "
                        f"or set serve.engine: transformers")
    return "vllm" if wanted == "vllm" or (wanted == "auto" and present) else "transformers"


def on_transformers(recipe_name: str, s: Served, digest: str, host: str, port: int, time_limit: float | None,
                    eager: bool):
    import uvicorn

    from stages.inference.app import TIME_LIMIT_S, build_app
    from stages.inference.generation import compiles, load

    log = project.store().root / recipe_name / "serve.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    compiled = compiles(s) and not eager
    if compiled:
        print(f"serve:{recipe_name}: compiling {s.model_id} for this GPU before it answers (about 45 s for 8B "
              f"on an H100; --eager skips it, for a slower server)", flush=True)
    with captured(log) as loading:  # transformers' loading bar and warnings go to the log, as a stage's do
        model = load(s, compiled)
    if loading.warnings:
        print(f"serve:{recipe_name}: loading the model gave {loading.warnings} library warning(s): {log}", flush=True)
    if model.compile_failure:
        print(f"serve:{recipe_name}: it did not compile ({model.compile_failure}); serving it uncompiled", flush=True)
    app = build_app(model, s.model_id, {"manifest": digest}, time_limit or TIME_LIMIT_S)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    print(f"serve:{recipe_name}: {s.model_id} at http://{host}:{port}/v1 (transformers; limits: {app.state.limits})",
          flush=True)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again: these
    # handlers take it then, so the action ends normally (exit 0) instead of being killed.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with announced(recipe_name, s, host, port):
            server.run()
    except SystemExit:  # uvicorn exits when it cannot bind
        return TaskFailed(f"serve:{recipe_name}: cannot listen on {host}:{port} (in use, or not this machine's "
                          f"address); pass --port or --host, or set serve.port in recipes/{recipe_name}.yaml")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        model.close()
    print(f"serve:{recipe_name}: stopped", flush=True)
    return None


def on_vllm(recipe_name: str, s: Served, host: str, port: int):
    argv = vllm.command(vllm.executable(), s, host, port)
    print(f"serve:{recipe_name}: {s.model_id} at http://{host}:{port}/v1 (vLLM: {' '.join(argv)})", flush=True)
    proc = subprocess.Popen(argv)
    previous = {sig: signal.signal(sig, lambda sig, _: proc.send_signal(sig)) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with announced(recipe_name, s, host, port):
            rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return None if rc in (0, -signal.SIGTERM, -signal.SIGINT) else TaskFailed(f"serve:{recipe_name}: vllm exited {rc}")


def run(recipe_name: str, host: str | None, port: int | None, quantized: bool, full: bool, scheme: str | None,
        time_limit: float | None, eager: bool):
    try:
        r = project.recipe(recipe_name)
        s, digest = checked(recipe_name, quantized, full, scheme)
        backend = engine(recipe_name, r.serve.engine)
    except UserError as e:
        return TaskFailed(str(e))
    if time_limit is not None and time_limit <= 0:
        return TaskFailed(f"serve:{recipe_name}: --time-limit is seconds, more than 0 (not {time_limit:g})")
    host, port = host or r.serve.host, port or r.serve.port
    if backend == "vllm":
        return on_vllm(recipe_name, s, host, port)
    return on_transformers(recipe_name, s, digest, host, port, time_limit, eager)


@contextmanager
def announced(recipe_name: str, s: Served, host: str, port: int):
    """artifacts/<recipe>/serving.json while the server runs (once the model is loaded and a
    signal stops it cleanly): which model, where, and this process; the Coach links to it while
    the process lives."""
    path = project.store().root / recipe_name / "serving.json"
    write_json(path, {"model_id": s.model_id, "url": f"http://{host}:{port}/v1", "pid": os.getpid()})
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


PARAMS = [
    {"name": "host", "long": "host", "type": str, "default": None,
     "help": "address to listen on (default: the recipe's serve.host)"},
    {"name": "port", "long": "port", "type": int, "default": None,
     "help": "port to listen on (default: the recipe's serve.port)"},
    {"name": "quantized", "long": "quantized", "type": bool, "default": False,
     "help": "serve the quantized export instead of the trained model"},
    {"name": "scheme", "long": "scheme", "type": str, "default": None,
     "help": "with --quantized: which scheme's export (default: the first quantize.scheme lists)"},
    {"name": "full", "long": "full", "type": bool, "default": False,
     "help": "re-read every byte of what is served instead of trusting the stat cache"},
    {"name": "time_limit", "long": "time-limit", "type": float, "default": None,
     "help": "seconds from a request's arrival to its last token before it is cut short, finish_reason length "
             "(transformers engine; default 60)"},
    {"name": "eager", "long": "eager", "type": bool, "default": False,
     "help": "on a GPU, serve without compiling the model first: it answers at once, and generates more slowly "
             "(transformers engine)"},
]


def tasks():
    return project.recipe_tasks("serve", "serve the trained (or quantized) model, gated by its manifest",
                                lambda name: {"actions": [(run, [name])], "params": PARAMS})
