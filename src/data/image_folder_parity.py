"""Prints torchvision's ImageFolder listing of a directory as JSON, for image_folder_test.

Usage: image_folder_parity.py ROOT. Output: {"classes": [...], "class_to_idx": {...},
"samples": [[path relative to ROOT, class index], ...]}, or {"error": type, "message": text} when
torchvision raises. Exits 3 when torchvision cannot be imported (the test then skips).
"""
import json
import os
import sys

try:
    from torchvision.datasets import ImageFolder
except ImportError:
    sys.exit(3)

root = sys.argv[1]
try:
    dataset = ImageFolder(root)  # lists only; nothing is decoded before an item is read
    out = {"classes": dataset.classes, "class_to_idx": dataset.class_to_idx,
           "samples": [[os.path.relpath(p, root), c] for p, c in dataset.samples]}
except Exception as e:  # the test compares the error kind
    out = {"error": type(e).__name__, "message": str(e)}
print(json.dumps(out))
