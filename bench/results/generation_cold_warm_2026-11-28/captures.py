"""Does the served bench's figure at a level include CUDA graph captures? One fresh served model
(as bench.generation_speed builds it), each level measured three times in a row, with transformers'
graph captures counted and timed per round (its ContinuousBatchingLogger's 'Creating graph' /
'Setting graph'). Temporary: not committed as product code."""
import json, logging, multiprocessing, os, sys, time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, os.getcwd())
from bench import generation_speed as gs

name, options = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
ROUNDS = int(os.environ.get('ROUNDS', 3))
OUT = Path(os.environ.get("OUT", "/tmp/out"))
res = {"name": name, "options": options, "rounds": []}
save = lambda: (OUT / f"{name}.json").write_text(json.dumps(res, indent=1))


class Captures(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.events, self.open = [], None

    def emit(self, r):
        m = r.getMessage()
        if "Creating graph" in m:
            self.open = time.perf_counter()
        elif "Setting graph" in m and self.open is not None:
            self.events.append((self.open, time.perf_counter() - self.open, m.split("key = ")[-1]))
            self.open = None


caps = Captures()
cb = logging.getLogger("ContinuousBatchingLogger")
cb.setLevel(logging.INFO)
cb.addHandler(caps)

if __name__ == "__main__":
    import torch
    from stages.inference.generation import ServedModel

    shared = Path("gpu/shared")
    res["gpu"] = torch.cuda.get_device_name()
    model, tok = gs.make_model(gs.QWEN3_8B, "cuda", "bfloat16", shared / "tokenizers" / "qwen3")
    questions = gs.real_questions(shared, 128)
    with ProcessPoolExecutor(8, mp_context=multiprocessing.get_context("spawn")) as clients:
        list(clients.map(gs.ready_clients, range(8)))
        t = time.perf_counter()
        served_model = ServedModel(model, tok, options=options, compiled=True)
        res["engine_init_seconds"] = time.perf_counter() - t
        res["warmup_captures"] = len(caps.events)
        res["warmup_capture_seconds"] = sum(e[1] for e in caps.events)
        served = gs.Served(served_model, "bench")
        gs.load(clients, 1, served.base_url, "bench", questions[:1], 1, 8)
        for level in (1, 8, 32, 128):
            for rnd in range(ROUNDS):
                before, t0 = len(caps.events), time.perf_counter()
                qs = questions[:3] if level == 1 else (questions * 2)[:level]
                r = gs.load(clients, 8, served.base_url, "bench", qs, level, 128)
                new = caps.events[before:]
                res["rounds"].append({"level": level, "round": rnd + 1, "tokens_per_s": r["tokens_per_s"],
                                      "seconds": r["seconds"], "ttft_p50_s": r["ttft_p50_s"],
                                      "captures": len(new), "capture_seconds": sum(e[1] for e in new),
                                      "keys": [e[2] for e in new][:40]})
                print(name, level, rnd + 1, round(r["tokens_per_s"]), len(new), round(sum(e[1] for e in new), 2), flush=True)
                save()
        res['max_memory_allocated_gib'] = torch.cuda.max_memory_allocated() / 2**30
        res['memory_reserved_gib'] = torch.cuda.memory_reserved() / 2**30
        served.close()
        served_model.close()
    save()
