"""Page faults a step, per rank, of one benchmarks/step.py config (issue #42, session 44); with ``PERF=1`` rank 0
also records its faults (or ``PERF_ARGS``' events) over one step with ``perf record``, into ``PERF_OUT``.

    NP=2 .venv/bin/python benchmarks/s44/faults.py --model 117m --configs fshard+ahead+buckets+donate
    NP=2 PERF=1 .venv/bin/python benchmarks/s44/faults.py --model 117m --configs fshard+ahead+buckets+donate
    perf report -i /tmp/fshard-faults.perf --no-children --stdio --sort sym -g caller,0.5,callee --percent-limit 2
    NP=2 PERF=1 PERF_ARGS="-e cpu-clock -F 999 -g" ...   # where the CPU goes instead (clear_page_erms: new pages)

Three warm-up steps, then two timed ones (the first recorded); the rest of the arguments are step.py's."""
import os
import resource
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/ (step)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import step as stepbench  # noqa: E402
from gpt import synthetic_batches  # noqa: E402

NP = int(os.environ.get("NP", "2"))


def main(rank: int, port: int, argv: list[str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(NP), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    args = stepbench.parse_args(argv)
    cfg = stepbench._model_config(args)
    batches = list(synthetic_batches(cfg, args.batch_size, 5, args.seed, rank, NP))
    r = stepbench._builder(args.configs)(stepbench.Ctx(args, cfg, rank, NP))
    for i in range(3):
        r.step(batches[i])
    dist.barrier()
    perf = None
    if rank == 0 and os.environ.get("PERF"):
        perf = subprocess.Popen(["perf", "record", *os.environ.get("PERF_ARGS", "-e page-faults -c 4 -g").split(),
                                 "-o", os.environ.get("PERF_OUT", "/tmp/fshard-faults.perf"), "-p", str(os.getpid())],
                                stderr=subprocess.DEVNULL)
        time.sleep(2)  # (attached before the step starts)
    dist.barrier()
    for i in range(3, 5):
        f0, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        r.step(batches[i])
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        print(f"rank {rank} step {i}: {time.perf_counter() - t:.3f} s, {faults} faults", flush=True)
        if perf is not None and i == 3:
            perf.send_signal(signal.SIGINT)
            perf.wait()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(stepbench._free_port(), sys.argv[1:]), nprocs=NP)
