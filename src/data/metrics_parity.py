#!/usr/bin/python3
"""sklearn.metrics.roc_auc_score on the cases metrics_test writes (see write_cases there).

usage: metrics_parity.py CASES_FILE

Each case: a line "n classes", n lines of scores, n lines of 0/1 labels. Prints, per case, the AUC of
each class (classes whose labels are all equal are skipped: sklearn raises for them) and, for a
multi-label case, sklearn's average="macro" over the defined classes, as repr()s on one line.
"""
import sys

import numpy as np
from sklearn.metrics import roc_auc_score


def main():
    with open(sys.argv[1]) as f:
        lines = f.read().splitlines()
    i = 0
    while i < len(lines):
        n, classes = map(int, lines[i].split())
        scores = np.array([[float(v) for v in l.split()] for l in lines[i + 1:i + 1 + n]])
        labels = np.array([[float(v) for v in l.split()] for l in lines[i + 1 + n:i + 1 + 2 * n]])
        i += 1 + 2 * n
        defined = [k for k in range(classes) if 0 < labels[:, k].sum() < n]
        values = [roc_auc_score(labels[:, k], scores[:, k]) for k in defined]
        if classes > 1:
            values.append(roc_auc_score(labels[:, defined], scores[:, defined], average="macro"))
        print(" ".join(repr(float(v)) for v in values))


if __name__ == "__main__":
    main()
