#!/usr/bin/env python3
"""render_fashion_mnist_test: `chorus data render-fashion-mnist` end to end.

Renders a few items per split and checks, with PIL and torchvision 0.14: the ImageFolder tree
(class directories, zero-padded file names), that every 28 px PNG holds exactly the IDX file's
pixels under its label's class, that torchvision's ImageFolder reads the tree with those labels,
that 64 px PNGs equal PIL's BILINEAR resize of the 28 px image, the CSV files (single- and
multi-label), and the command's errors. Exits 77 (skip) without the dataset or PIL/torchvision.
"""
import argparse
import csv
import gzip
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DATA = Path("/usr/share/datasets/fashion-mnist")
CLASSES = ["T-shirt_top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle_boot"]
LIMIT = 3  # items per class


def idx(name):
    raw = gzip.open(DATA / (name + ".gz")).read()
    dims = raw[3]
    return raw[4 + 4 * dims:]


def run(chorus, *args):
    return subprocess.run([chorus, "data", "render-fashion-mnist", *args], capture_output=True, text=True, timeout=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chorus", required=True)
    chorus = ap.parse_args().chorus
    try:
        import numpy as np
        from PIL import Image
        from torchvision.datasets import ImageFolder
    except Exception as e:  # noqa: BLE001
        print(f"skip: cannot import PIL/torchvision: {e}")
        return 77
    if not (DATA / "train-images-idx3-ubyte.gz").exists():
        print(f"skip: no {DATA} (Debian's dataset-fashion-mnist)")
        return 77

    tmp = Path(tempfile.mkdtemp(prefix="chorus_render_test_"))
    try:
        out = tmp / "fm28"
        r = run(chorus, str(out), "--limit", str(LIMIT), "--csv")
        assert r.returncode == 0, r.stderr
        assert f"wrote {10 * LIMIT} train and {10 * LIMIT} test images" in r.stdout, r.stdout
        for split, prefix in (("train", "train"), ("test", "t10k")):
            images = idx(f"{prefix}-images-idx3-ubyte")
            labels = idx(f"{prefix}-labels-idx1-ubyte")
            assert sorted(p.name for p in (out / split).iterdir()) == sorted(CLASSES)
            # The first LIMIT items of each class, in dataset order.
            seen = [0] * 10
            chosen = []
            for i, label in enumerate(labels):
                if seen[label] < LIMIT:
                    seen[label] += 1
                    chosen.append(i)
            assert len(chosen) == 10 * LIMIT
            files = sorted((out / split).glob("*/*"))
            assert len(files) == 10 * LIMIT, files
            for i in chosen:
                path = out / split / CLASSES[labels[i]] / f"{i:05d}.png"
                im = Image.open(path)
                assert im.mode == "L" and im.size == (28, 28), (path, im.mode, im.size)
                assert im.tobytes() == images[i * 784:(i + 1) * 784], f"{path}: pixels differ from the IDX file"
            folder = ImageFolder(str(out / split))
            assert folder.classes == sorted(CLASSES)
            for p, target in folder.samples:
                i = int(Path(p).stem)
                assert folder.classes[target] == CLASSES[labels[i]], (p, target)
            rows = list(csv.DictReader(open(out / f"{split}.csv")))
            assert [(r["path"], int(r["label"])) for r in rows] == \
                [(f"{split}/{CLASSES[labels[i]]}/{i:05d}.png", labels[i]) for i in chosen]
            multi = list(csv.DictReader(open(out / f"{split}_multilabel.csv")))
            assert list(multi[0].keys()) == ["path", "upper_body", "lower_body", "footwear", "accessory", "group"]
            assert len(multi) == len(chosen)
            for i, row in zip(chosen, multi):
                c = CLASSES[labels[i]]
                assert row["upper_body"] == ("1" if c in ("T-shirt_top", "Pullover", "Dress", "Coat", "Shirt") else "0")
                assert row["lower_body"] == ("1" if c in ("Trouser", "Dress") else "0")
                assert row["footwear"] == ("1" if c in ("Sandal", "Sneaker", "Ankle_boot") else "0")
                assert row["accessory"] == ("1" if c == "Bag" else "0")
                assert int(row["group"]) == i // 10

        big = tmp / "fm64"
        r = run(chorus, str(big), "--limit", "2", "--size", "64", "--format", "both", "--quality", "95")
        assert r.returncode == 0, r.stderr
        for png in sorted(big.glob("*/*/*.png")):
            small = Image.open(out / png.relative_to(big))
            expected = np.array(small.resize((64, 64), Image.BILINEAR))
            assert np.array_equal(np.array(Image.open(png)), expected), f"{png}: not PIL's bilinear resize"
            jpg = Image.open(png.with_suffix(".jpg"))
            assert jpg.size == (64, 64) and jpg.mode == "L"
            diff = np.abs(np.array(jpg).astype(int) - expected.astype(int)).mean()
            assert diff < 4, f"{png.with_suffix('.jpg')}: mean difference {diff} from the PNG"
        assert len(list(big.glob("*/*/*.jpg"))) == 2 * 10 * 2

        r = run(chorus, str(tmp / "x"), "--size", "50")
        assert r.returncode == 2 and "--size" in r.stderr, (r.returncode, r.stderr)
        r = run(chorus, str(tmp / "y"), "--data", str(tmp / "missing"))
        assert r.returncode == 1 and str(tmp / "missing") in r.stderr and "dataset-fashion-mnist" in r.stderr, r.stderr
    finally:
        shutil.rmtree(tmp)
    print("render_fashion_mnist_test: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
