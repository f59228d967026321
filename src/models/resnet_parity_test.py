#!/usr/bin/python3
"""The torchvision side of resnet_parity_test (src/models/resnet_parity_test.cc).

usage: resnet_parity_test.py gen   --arch resnet18 --classes N --in-channels C --dir DIR
       resnet_parity_test.py check --arch resnet18 --classes N --in-channels C --dir DIR

gen: builds torchvision 0.14's model with random weights, and random BatchNorm statistics and
affine values (so eval mode's normalisation is not the identity), and writes into DIR:
  model.pt   torch.save(model.state_dict())      (what chorus loads)
  keys.txt   "name d0,d1,..." per state_dict entry, in order
  input.pt   a random input [2, C, 64, 64]
  logits.pt  the model's eval-mode output on it
check: loads DIR/cpp_model.pt (written by chorus's save_state_dict) with torch.load into a fresh
torchvision model (load_state_dict, strict), checks the file's keys come in torchvision's order, and
compares the eval-mode logits on DIR/input.pt with chorus's DIR/cpp_logits.pt (1e-4).
Exit status 0 with "OK: ..." when they match; 1 with the differences otherwise.
"""
import argparse
import sys

import torch
import torchvision

TOLERANCE = 1e-4


def build(arch, classes, in_channels):
    model = getattr(torchvision.models, arch)(weights=None, num_classes=classes)
    if in_channels != 3:
        model.conv1 = torch.nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


def gen(args):
    torch.manual_seed(1234)
    model = build(args.arch, args.classes, args.in_channels)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
                m.num_batches_tracked.fill_(7)
    model.eval()
    state = model.state_dict()
    torch.save(state, f"{args.dir}/model.pt")
    with open(f"{args.dir}/keys.txt", "w") as f:
        for name, t in state.items():
            f.write(f"{name} {','.join(str(d) for d in t.shape)}\n")
    x = torch.randn(2, args.in_channels, 64, 64)
    torch.save(x, f"{args.dir}/input.pt")
    with torch.no_grad():
        torch.save(model(x), f"{args.dir}/logits.pt")
    print(f"OK: wrote {len(state)} tensors")
    return 0


def check(args):
    model = build(args.arch, args.classes, args.in_channels)
    loaded = torch.load(f"{args.dir}/cpp_model.pt")
    expected = list(model.state_dict().keys())
    got = list(loaded.keys())
    if got != expected:
        first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        print(f"keys differ: {len(got)} saved, {len(expected)} in torchvision; first difference at #{first}: "
              f"{got[first:first + 1]} vs {expected[first:first + 1]}")
        return 1
    model.load_state_dict(loaded, strict=True)
    model.eval()
    x = torch.load(f"{args.dir}/input.pt")
    cpp = torch.load(f"{args.dir}/cpp_logits.pt")
    with torch.no_grad():
        ours = model(x)
    diff = (ours - cpp).abs().max().item()
    if not diff <= TOLERANCE:
        print(f"logits differ by {diff} (tolerance {TOLERANCE})")
        return 1
    print(f"OK: {len(expected)} keys in order, logits within {diff:.3g}")
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["gen", "check"])
    p.add_argument("--arch", required=True)
    p.add_argument("--classes", type=int, required=True)
    p.add_argument("--in-channels", type=int, default=3)
    p.add_argument("--dir", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    return gen(args) if args.mode == "gen" else check(args)


if __name__ == "__main__":
    sys.exit(main())
