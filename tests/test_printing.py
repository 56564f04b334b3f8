"""print(state) and print(plan) are aligned tables a person reads (issue #38): no object addresses (a weight-decay
mask shows as its function's name, ``<lambda>`` for a lambda), every column lined up whatever the unit names'
lengths, every label of the plan whole, no trailing blanks."""
from __future__ import annotations

import re

import torch
import torch.nn as nn

import fshard as fs
from gpt import GPT, GPTConfig, loss_fn, synthetic_batches


class _LongNames(nn.Module):
    def __init__(self):
        super().__init__()
        self.a_rather_long_encoder_stack_name = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        for m in self.a_rather_long_encoder_stack_name:
            x = m(x)
        return self.b(x)


def _table(text: str) -> list[str]:
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("unit "))
    end = next(i for i in range(head, len(lines)) if lines[i].lstrip().startswith("total"))
    return lines[head:end + 1]


def test_print_state_names_the_mask_and_aligns_its_columns():
    torch.manual_seed(0)
    for mask, shown in ((lambda name, p: p.ndim >= 2, "weight_decay_mask=<lambda>"),
                        (None, "weight_decay_mask=None")):
        state = fs.init(_LongNames(), fs.Mesh.local(), fs.adamw(weight_decay_mask=mask),
                        units=["a_rather_long_encoder_stack_name.0", "a_rather_long_encoder_stack_name.1"])
        text = str(state)
        assert " at 0x" not in text and shown in text, text
        table = _table(text)
        assert len({len(line) for line in table}) == 1, table  # every row as wide as the header
        ends = {m.end() for line in table[1:] for m in [re.search(r"\d[\d,]*$", line)]}
        assert len(ends) == 1 and "a_rather_long_encoder_stack_name.1" in text
        total = table[-1].split()
        assert total[0] == "total" and int(total[-1].replace(",", "")) == sum(
            int(line.split()[-1].replace(",", "")) for line in table[1:-1])

    def matrices(name, p):
        return p.ndim >= 2
    state = fs.init(GPT(GPTConfig.tiny()), fs.Mesh.local(), fs.adamw(
        lr=fs.schedules.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 10), weight_decay_mask=matrices))
    text = str(state)
    assert "weight_decay_mask=matrices" in text and "lr=join_schedules(" in text and " at 0x" not in text


def test_print_plan_is_one_aligned_column_with_whole_labels():
    cfg = GPTConfig.tiny()
    state = fs.init(GPT(cfg), fs.Mesh.local(), fs.adamw())
    with fs.compose(loss_fn, fs.gather_ahead(1), fs.mixed_precision(), donate=True) as step:
        text = str(step.plan(state, next(synthetic_batches(cfg, 2, 1))))
    lines = text.splitlines()
    assert all(line == line.rstrip() for line in lines)
    rows = [line for line in lines if line.startswith("  ")]
    assert len(rows) >= 20
    # every number ends at the same column, its unit after it
    ends = {re.match(r"  \S.*?\S {2,}(\d[\d.]*) (B|KiB|MiB|GiB)", line).end(1) for line in rows}
    assert len(ends) == 1, text
    assert "  of those, held at once (an update during backward frees them)  " in text  # whole, then a gap
