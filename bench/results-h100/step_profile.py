"""Where a decode step's time goes on the GPU: engine step wall, model execute wall, summed kernel time."""
import time
import torch
from torch.profiler import ProfilerActivity, profile
from scheduler.params import SamplingParams
from worker import Engine

for batch in (8, 32):
    e = Engine(model="/tmp/m1b", device="cuda", dtype="bfloat16", max_num_seqs=batch)
    for i in range(batch):
        e.add_request(f"r{i}", [65 + i % 20] * 32, SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(30):
        e.step()
    orig = e.runner.execute
    acc = [0.0, 0]
    def timed(b, orig=orig, acc=acc):
        torch.cuda.synchronize(); w = time.perf_counter()
        out = orig(b); torch.cuda.synchronize()
        acc[0] += time.perf_counter() - w; acc[1] += 1
        return out
    e.runner.execute = timed
    w = time.perf_counter()
    for _ in range(100):
        e.step()
    total = time.perf_counter() - w
    e.runner.execute = orig
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        for _ in range(20):
            e.step()
        torch.cuda.synchronize()
    kern = sum(ev.self_device_time_total for ev in p.key_averages()) / 20 / 1e3
    launches = sum(ev.count for ev in p.key_averages() if ev.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")) / 20
    print(f"batch {batch}: step {1e3*total/100:.2f} ms, execute (synced) {1e3*acc[0]/acc[1]:.2f} ms, "
          f"GPU kernel time {kern:.2f} ms/step, kernel launches {launches:.0f}/step")
    print(p.key_averages().table(sort_by="self_device_time_total", row_limit=8))
    del e
    torch.cuda.empty_cache()
