# The set-up commands of the README. Each bootstraps what is missing first (scripts/bootstrap.sh: .venv,
# torch 2.13.0, liburing-dev/libaio-dev, tensornvme, tokenizers, tensorboard, fshard), idempotently.
.PHONY: train test test-quick bootstrap bench-step bench-adam bench-store bench-collectives bench-offload

# The example GPT on the standard library's Python source, 2 ranks of 1 thread; everything it writes goes to
# runs/gpt (git-ignored). Run again: it resumes from the latest checkpoint there; rm -rf runs/gpt to start afresh.
train: bootstrap
	OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --small --steps 400 \
		--threads 1 --run-dir runs/gpt

# Every test (what CI runs: .ci/run calls make test).
test: bootstrap
	.venv/bin/python -m pytest -q -n 2

# A representative subset, a few minutes on 2 cores: the state and its printing, the optimizer's schedules and
# errors, property tests of the planners, DDP equivalence at 1-2 ranks, eval, abstract checkpoints, the example's
# data pipeline and a short run, the README's samples.
QUICK = tests/test_state.py tests/test_structures.py tests/test_schedules.py tests/test_errors.py \
	tests/test_properties.py tests/test_ddp_equivalence.py tests/test_eval.py tests/test_checkpoint_abstract.py \
	tests/test_train_example.py tests/test_readme.py

test-quick: bootstrap
	.venv/bin/python -m pytest -q -n 2 $(QUICK)

bootstrap:
	@./scripts/bootstrap.sh

bench-step: bootstrap
	.venv/bin/python benchmarks/step.py

bench-adam: bootstrap
	.venv/bin/python benchmarks/adam.py

bench-store: bootstrap
	@command -v fio >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q fio; }
	.venv/bin/python benchmarks/store.py

bench-collectives: bootstrap
	.venv/bin/python benchmarks/collectives.py --overlap

bench-offload: bootstrap
	.venv/bin/python benchmarks/offload.py --dir $$(mktemp -d /var/tmp/fshard-offload.XXXX)
