#!/usr/bin/python3
"""Checks that Python's torch.load reads a chorus checkpoint's model.pt (run by checkpoint_test).

usage: checkpoint_python_test.py MODEL_PT EXPECTED_JSON

EXPECTED_JSON maps each parameter / buffer name to {"shape", "dtype", "values"} as the C++ side
saved them. The dict must hold exactly those names with exactly those values, and load as is
(strict) into the PyTorch module that matches the C++ test model.
"""
import json
import sys

import torch


class Net(torch.nn.Module):
    # The C++ test model: fc1 Linear(4, 8), bn BatchNorm1d(8), fc2 Linear(8, 3).
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.fc2 = torch.nn.Linear(8, 3)


def main():
    model_path, expected_path = sys.argv[1], sys.argv[2]
    d = torch.load(model_path)
    with open(expected_path) as f:
        expected = json.load(f)

    assert isinstance(d, dict), f"torch.load gave {type(d).__name__}, not a dict"
    assert sorted(d) == sorted(expected), f"names {sorted(d)} != {sorted(expected)}"
    assert not any(k.startswith("module.") for k in d), "names carry a module. prefix"
    dtypes = {"Float": torch.float32, "Double": torch.float64, "Long": torch.int64}
    for name, want in expected.items():
        t = d[name]
        assert isinstance(t, torch.Tensor), f"{name}: {type(t).__name__}, not a tensor"
        assert list(t.shape) == want["shape"], f"{name}: shape {list(t.shape)} != {want['shape']}"
        assert t.dtype == dtypes[want["dtype"]], f"{name}: dtype {t.dtype} != {want['dtype']}"
        ref = torch.tensor(want["values"], dtype=torch.float64).reshape(want["shape"])
        assert torch.equal(t.to(torch.float64), ref), f"{name}: values differ"

    net = Net()
    net.load_state_dict(d, strict=True)
    assert torch.equal(net.bn.running_mean, d["bn.running_mean"])
    print(f"OK: {len(d)} tensors, loaded into a torch.nn.Module with strict=True")


if __name__ == "__main__":
    main()
