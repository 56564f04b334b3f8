# The two set-up commands of the README. Each bootstraps what is missing first (scripts/bootstrap.sh: .venv,
# torch 2.13.0, liburing-dev/libaio-dev, tensornvme, fshard), idempotently.
.PHONY: train test bootstrap bench-step bench-adam bench-store bench-collectives bench-offload

train: bootstrap
	.venv/bin/torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --tiny --steps 300 --nvme-dir "$$(mktemp -d)"

test: bootstrap
	.venv/bin/python -m pytest -q -n 2

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
