"""Wall time against CPU time (all threads of a rank: compute and gloo's) per step at world size 2, step.py's
configs one after another in the same two processes: whether a gap to DDP is work or waiting.

    flock /tmp/fshard-bench.lock .venv/bin/python benchmarks/s34/cpu_per_step.py ddp,fshard+ahead+buckets+donate 6
"""
import os, sys, time, resource, torch, torch.distributed as dist, torch.multiprocessing as mp
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

def run(rank, cfgs, port, steps):
    import step as stepbench
    from gpt import synthetic_batches
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    args = stepbench.parse_args(["--world-size", "2", "--configs", cfgs])
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    cfg = stepbench._model_config(args); ctx = stepbench.Ctx(args, cfg, rank, 2)
    batches = list(synthetic_batches(cfg, args.batch_size, steps + 2, args.seed, rank, 2))
    for name in cfgs.split(","):
        r = stepbench._builder(name)(ctx)
        for b in batches[:2]: r.step(b)
        dist.barrier()
        u0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
        for b in batches[2:]: r.step(b)
        t1 = time.perf_counter(); u1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (u1.ru_utime - u0.ru_utime + u1.ru_stime - u0.ru_stime) / steps
        sys_ = (u1.ru_stime - u0.ru_stime) / steps
        flt = (u1.ru_minflt - u0.ru_minflt) / steps
        vcs, ivcs = (u1.ru_nvcsw - u0.ru_nvcsw) / steps, (u1.ru_nivcsw - u0.ru_nivcsw) / steps
        print(f"rank {rank} {name:40s} wall {(t1-t0)/steps*1e3:7.1f} ms  cpu {cpu*1e3:7.1f} ms (sys {sys_*1e3:6.1f})  faults {flt:7.0f}  vcsw {vcs:6.0f} ivcsw {ivcs:5.0f}", flush=True)
        r.close()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], 29000 + os.getpid() % 1000, int(sys.argv[2]) if len(sys.argv) > 2 else 6), nprocs=2)
