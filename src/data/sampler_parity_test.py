#!/usr/bin/env python3
"""Prints torch.utils.data.DistributedSampler's indices over a grid of arguments.

Used by sampler_test's SamplerParity test (src/data/sampler_test.cc), which compares every line
with chorus::data::DistributedSampler. One line per case:

    dataset_size num_replicas rank shuffle seed drop_last epoch: i0 i1 ...

then "END <number of cases>". The grid is in the script so that the C++ side checks whatever it
prints. Exits 3 when torch cannot be imported (the test then skips).
"""
import sys

try:
    from torch.utils.data.distributed import DistributedSampler
except Exception as e:  # noqa: BLE001 - any import failure means "no reference available"
    print(f"cannot import torch: {e}", file=sys.stderr)
    sys.exit(3)

SIZES = [0, 1, 7, 10, 101, 1000]
REPLICAS = [1, 2, 3, 4, 7]
SEEDS = [0, 42, 2**32 + 7, 2**63 + 11]
EPOCHS = [0, 1, 3]


def main() -> None:
    out = sys.stdout
    cases = 0
    for size in SIZES:
        dataset = range(size)  # the sampler only needs len()
        for replicas in REPLICAS:
            for rank in range(replicas):
                for shuffle in (False, True):
                    for seed in SEEDS:
                        for drop_last in (False, True):
                            sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank,
                                                         shuffle=shuffle, seed=seed, drop_last=drop_last)
                            for epoch in EPOCHS:
                                sampler.set_epoch(epoch)
                                indices = list(iter(sampler))
                                assert len(indices) == len(sampler)
                                out.write(f"{size} {replicas} {rank} {int(shuffle)} {seed} {int(drop_last)} {epoch}:")
                                out.write("".join(f" {i}" for i in indices))
                                out.write("\n")
                                cases += 1
    out.write(f"END {cases}\n")


if __name__ == "__main__":
    main()
