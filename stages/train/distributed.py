"""Training in several processes, one per device: the plan's `processes` (hardware.gpus times
the nodes) run trainer.fit under torchrun (torch.distributed.run), each with its share of the
global batch; on CUDA the Trainer shards the model with FSDP2, on CPU it runs DDP over gloo
(trainer.distributed_args says why). The first process alone writes the artifact into the
stage's build directory, so the store's atomic commit is the same as for one process.

One node: torchrun's standalone rendezvous on a free port of the loopback address. Several nodes: NNODES,
NODE_RANK, MASTER_ADDR and MASTER_PORT in the environment of `doit checkpoint:<recipe>` on
every node (README "Multi-GPU and multi-node")."""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from stages.engine.errors import UserError
from stages.train.settings import nodes


def rendezvous() -> list[str]:
    """torchrun's arguments that say where the processes meet."""
    if nodes() == 1:  # on the loopback address: the host's own name may not resolve (a sandbox, no DNS)
        return ["--standalone", "--local-addr", "127.0.0.1"]
    missing = [v for v in ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise UserError(f"environment NNODES={nodes()} needs {', '.join(missing)} too (README: Multi-GPU and multi-node)")
    return ["--nnodes", str(nodes()), "--node-rank", os.environ["NODE_RANK"],
            "--master-addr", os.environ["MASTER_ADDR"], "--master-port", os.environ["MASTER_PORT"]]


def one_of_several_gpus(plan: dict, visible_gpus: int) -> bool:
    """One process planned on CUDA where more GPUs are visible (hardware.gpus: 1 on a bigger node).
    Run in this process, the Trainer would spread each batch over all of them with nn.DataParallel
    (TRL's trainers refuse it, and the plan measured one GPU), so launch() runs it as a child
    process that sees one GPU."""
    return plan["processes"] == 1 and plan["device"] == "cuda" and visible_gpus > 1


def launch(spec: dict, processes: int, work: Path, log, run: dict) -> None:
    """Run fit() in this node's share of the processes (one process: a child that sees the
    first visible GPU only, where the probe measured); their output goes to the console and the
    stage log. Rank 0's run-time figures come back in `run`."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "spec.json").write_text(json.dumps(spec))
    (work / "run.json").unlink(missing_ok=True)
    env = dict(os.environ)
    if processes == 1:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        command = [sys.executable, "-m", "stages.train.distributed", str(work / "spec.json")]
        log.info("training in one process on GPU %s: %s", env["CUDA_VISIBLE_DEVICES"], " ".join(command))
    else:
        # torchrun sets one CPU thread a process only when a node runs several; set it for one a
        # node too, since the thread count changes CPU reductions' bits: the same plan over one
        # node or several then writes the same bytes
        env.setdefault("OMP_NUM_THREADS", "1")
        command = [sys.executable, "-m", "torch.distributed.run", *rendezvous(), "--nproc-per-node",
                   str(processes // nodes()), "-m", "stages.train.distributed", str(work / "spec.json")]
        log.info("training in %d processes: %s", processes, " ".join(command))
    out_of_memory, cause = False, None
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[2]) as proc:  # where `stages` imports from
        for line in proc.stdout:
            sys.stderr.write(line)
            log.debug("%s", line.rstrip())
            out_of_memory = out_of_memory or "OutOfMemoryError" in line
            cause = cause or raised(line)
    if proc.returncode:
        raise RuntimeError(failed(processes, proc.returncode, spec["plan"], out_of_memory, cause))
    if not (work / "run.json").exists():
        raise UserError(f"checkpoint: node {os.environ.get('NODE_RANK')} of {nodes()} trained its processes; "
                        f"the artifact is written on node 0: build there, then doit push there and doit pull here")
    run.update(json.loads((work / "run.json").read_text()))


RAISED = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt)\b.*)$")


def raised(line: str) -> str | None:
    """The exception a traceback in the processes' output ends with ("KeyError: 'env'"), or None;
    torchrun's own ChildFailedError, which only says that a process failed, is not one."""
    found = RAISED.match(line.rstrip())
    return None if found is None or "ChildFailedError" in found[1] else found[1][:300]


def failed(processes: int, code: int, plan: dict, out_of_memory: bool, cause: str | None = None) -> str:
    """The stage's line when training failed: the first exception a process raised, and where
    GPU replicas ran out of memory, how to shard."""
    line = (f"checkpoint: training in {processes} process(es) failed (exit {code})"
            + (f", first error: {cause}" if cause else "") + "; the processes' output is above and in the stage log")
    if out_of_memory and processes > 1 and plan["device"] == "cuda" and plan.get("sharding") is None:
        line += ("; each GPU held a whole replica of the model and ran out of memory: set hardware.sharding: fsdp2 "
                 "to shard it (docs/distributed.md)")
    return line


def stacks_on_usr1() -> None:
    """`kill -USR1 <pid>` of a training process: every thread's stack into the stage log, and it
    goes on; what a process that seems stuck is doing. faulthandler writes them from its C handler,
    without the GIL, so a process stuck holding it still answers. The signal is blocked in every
    thread but one that only waits for it (threads started later inherit the block), so it never
    interrupts a system call in gloo's, NCCL's or the autograd engine's threads; and one that comes
    while the interpreter exits, when faulthandler gives the signal back, is ignored rather than
    ending the process with the signal's default action. Call it from the main thread first."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # what faulthandler restores at exit
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})

    def take() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        threading.Event().wait()

    threading.Thread(target=take, name="takes SIGUSR1", daemon=True).start()


def main(spec_path: str) -> None:
    """One process (of torchrun's, or launch()'s only one): fit() with the spec the stage wrote;
    rank 0 records the run figures."""
    stacks_on_usr1()  # before importing torch, which may start threads
    import torch

    from stages.engine.recipe import TrainSection
    from stages.train import trainer
    from stages.train.methods import METHODS

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", 0))  # absent: launch()'s single process, without torchrun
    if torch.cuda.is_available() and spec["plan"]["device"] == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before anything (QLoRA's device map) asks for it
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=f"rank {rank}: %(message)s")
    run: dict = {}
    trainer.fit(METHODS[spec["method"]], Path(spec["base"]), Path(spec["shards"]), spec["plan"],
                TrainSection.model_validate(spec["train"]), Path(spec["work"]), Path(spec["out"]),
                Path(spec["resume"]) if spec["resume"] else None, logging.getLogger("mindxtrain.train"), run)
    if rank == 0:
        (Path(spec["work"]) / "run.json").write_text(json.dumps(run))


if __name__ == "__main__":
    main(sys.argv[1])
