"""Where a served step's time goes at 32 at once (8B shape, random bf16 weights, real questions):
the engine alone (asyncio streams, no HTTP) and served over HTTP at 1, 32 and 128, three rounds
each, an in-process stack sampler by thread on the third round at 32, and the GPU time of one
engine-alone round at 32 (torch profiler). Run from the checkout's root on the lent GPU with the
carried wheels (bench/gpu_site.sh) and gpu/shared/ as in bench/gpu_generation.sh:
`python3 <this file>`, results under $OUT. Kept as the record of what ran; not a bench."""
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
    (OUT / "prof.json").write_text(json.dumps(res, indent=1))


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
    import torch
    shared = Path("gpu/shared")
    model, tok = gs.make_model(gs.QWEN3_8B, "cuda", "bfloat16", shared / "tokenizers" / "qwen3")
    questions = gs.real_questions(shared, 128)
    prompts = [gs.served_prompt(tok, q) for q in questions]
    from stages.inference.generation import ServedModel
    t = time.perf_counter()
    sm = ServedModel(model, tok, compiled=True)
    res["init_s"] = time.perf_counter() - t
    print("ready", res["init_s"], flush=True)
    samp = Sampler()
    eng = sm.engine
    for n in (1, 32, 128):
        ps = (prompts * 2)[:n] if n > 1 else prompts[:3]
        rates = []
        for r in range(3):
            samp.on = r == 2 and n == 32
            if n == 1:
                rates.append(sum(asyncio.run(alone(eng, [p], 128)) for p in ps) / len(ps))
            else:
                rates.append(asyncio.run(alone(eng, ps, 128)))
            samp.on = False
        res[f"alone_{n}"] = rates
        print(n, rates, flush=True)
        save()
    samp.dump("alone_32")
    # GPU time of one engine-alone round at 32
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        rate = asyncio.run(alone(eng, prompts[:32], 128))
        wall = time.perf_counter() - t
    ev = prof.key_averages()
    cuda_total = sum(e.self_device_time_total for e in ev) / 1e6
    res["profiled_32"] = {"rate": rate, "wall_s": wall, "gpu_kernel_s": cuda_total}
    (OUT / "alone_32_kernels.txt").write_text(ev.table(sort_by="self_device_time_total", row_limit=40))
    save()
    print("profiled", res["profiled_32"], flush=True)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
        served = gs.Served(sm, "bench")
        clients.submit(gs.client_load, served.base_url, "bench", questions[:1], 1, 8).result()
        for n in (1, 32, 128):
            qs = questions[:3] if n == 1 else (questions * 2)[:n]
            rates = []
            for r in range(3):
                samp.on = r == 2 and n == 32
                spy = pyspy("served_32", 6) if (r == 1 and n == 32) else None
                rates.append(clients.submit(gs.client_load, served.base_url, "bench", qs, n, 128).result()["tokens_per_s"])
                samp.on = False
                if spy:
                    spy.wait()
            res[f"served_{n}"] = rates
            print("served", n, rates, flush=True)
            save()
        samp.dump("served_32")
        served.close()
    sm.close()


if __name__ == "__main__":
    try:
        main()
    except Exception:
        res["error"] = traceback.format_exc()
        save()
        raise
