"""(async batching beside sync) Where a served step's time goes at 32 at once (8B shape, H200): an in-process stack sampler by
thread, the engine alone and served over HTTP, plus py-spy where it attaches, plus the GPU time
of one engine-alone round (torch profiler). Temporary: not committed."""
import asyncio, collections, json, multiprocessing, os, subprocess, sys, threading, time, traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, os.getcwd())
from bench import generation_speed as gs
from stages.inference.batching import Sampling

OUT = Path(os.environ.get("OUT", "/tmp/out"))
OUT.mkdir(parents=True, exist_ok=True)
res = {}


def save():
    (OUT / f"prof_{sys.argv[1]}.json").write_text(json.dumps(res, indent=1))


class Sampler:
    def __init__(self, every=0.002):
        self.every, self.on, self.stacks = every, False, collections.Counter()
        threading.Thread(target=self.loop, daemon=True).start()

    def loop(self):
        me = threading.get_ident()
        while True:
            time.sleep(self.every)
            if not self.on:
                continue
            names = {t.ident: t.name for t in threading.enumerate()}
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                st = []
                while frame is not None:
                    c = frame.f_code
                    st.append(f"{Path(c.co_filename).name}:{c.co_name}:{frame.f_lineno}")
                    frame = frame.f_back
                self.stacks[names.get(tid, str(tid)) + ";" + ";".join(reversed(st))] += 1

    def dump(self, name):
        (OUT / f"{name}.collapsed").write_text("".join(f"{k} {v}\n" for k, v in self.stacks.most_common()))
        self.stacks = collections.Counter()


def pyspy(name, seconds):
    try:
        return subprocess.Popen(["py-spy", "record", "-p", str(os.getpid()), "-d", str(seconds), "-r", "200", "--threads",
                                 "--idle", "-f", "raw", "-o", str(OUT / f"{name}.pyspy")],
                                stdout=open(OUT / f"{name}.pyspy.log", "w"), stderr=subprocess.STDOUT)
    except Exception as e:
        res[f"pyspy_{name}"] = repr(e)


async def alone(engine, prompts, n_new):
    async def one(ids):
        last = None
        async for piece in engine.stream(ids, Sampling(n_new)):
            last = piece
        return len(last.ids)
    t = time.perf_counter()
    toks = await asyncio.gather(*(one(p) for p in prompts))
    return sum(toks) / (time.perf_counter() - t)


def main():
    name, options = sys.argv[1], json.loads(sys.argv[2])
    shared = Path("gpu/shared")
    model, tok = gs.make_model(gs.QWEN3_8B, "cuda", "bfloat16", shared / "tokenizers" / "qwen3")
    questions = gs.real_questions(shared, 32)
    prompts = [gs.served_prompt(tok, q) for q in questions]
    from stages.inference.generation import ServedModel
    t = time.perf_counter()
    kv = int(os.environ.get('KV', '0')) or None
    sm = ServedModel(model, tok, kv_tokens=kv, options=options, compiled=True)
    res[name + '_kv_tokens'] = sm.kv_tokens
    res[name + "_init_s"] = time.perf_counter() - t
    res[name + "_compile_failure"] = sm.compile_failure
    print("ready", res[name + "_init_s"], sm.compile_failure, flush=True)
    samp = Sampler()
    eng = sm.engine
    for n in (1, 8, 32):
        rates = []
        for r in range(3):
            samp.on = r == 2
            rates.append(asyncio.run(alone(eng, prompts[:n] if n > 1 else [prompts[r]], 128)))
            samp.on = False
        res[f"{name}_alone_{n}"] = rates
        samp.dump(f"{name}_alone_{n}")
        print(name, n, rates, flush=True)
        save()
    from torch.profiler import ProfilerActivity, profile
    for n in (1, 32):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            rate = asyncio.run(alone(eng, prompts[:n] if n > 1 else [prompts[1]], 128))
            wall = time.perf_counter() - t
        ev = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in ev) / 1e6
        res[f"{name}_profiled_{n}"] = {"rate": rate, "wall_s": wall, "gpu_kernel_s": gpu, "gpu_busy": gpu / wall, "gpu_ms_per_step": gpu / 128 * 1e3}
        (OUT / f"{name}_{n}_kernels.txt").write_text(ev.table(sort_by="self_device_time_total", row_limit=30))
        (OUT / f"{name}_{n}_cpu.txt").write_text(ev.table(sort_by="self_cpu_time_total", row_limit=40))
        save()
        print("profiled", n, res[f"{name}_profiled_{n}"], flush=True)
    sm.close()


if __name__ == "__main__":
    try:
        main()
    except Exception:
        res["error"] = traceback.format_exc()
        save()
        raise
