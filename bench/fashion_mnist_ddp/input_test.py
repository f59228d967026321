#!/usr/bin/python3
"""What the Fashion-MNIST harness (bench/fashion_mnist_ddp, the hand-written DDP loop) does with
bad inputs (registered as fashion_mnist_input_test).

usage: input_test.py PATH/TO/fashion_mnist_ddp

- A gzip bomb (1 MB that inflates to 1 GiB) and a header that claims too many items are refused
  after reading the header, without inflating the rest; empty training and test sets are errors.
- Bad numbers (--lr nan, ...) get a one-line error and exit code 2; --help shows the flags as
  they are.
- Checkpoints: the default directory is runs/fashion_mnist_ddp under the current directory; a run
  without --resume refuses to replace a checkpoint (--overwrite does); an unwritable directory
  fails before training; resuming at another world size says what changes.
- The progress line is rewritten in place only on a real terminal: not under srun or mpirun,
  which give ranks a pseudo-terminal but relay it line by line.
Needs Debian's dataset-fashion-mnist (or FASHION_MNIST_DATA=DIR). Only the standard library.
"""
import gzip
import os
import pty
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import zlib

BINARY = None
DATA = os.environ.get("FASHION_MNIST_DATA", "/usr/share/datasets/fashion-mnist")
SHORT = ["--max-steps", "2", "--eval-limit", "10", "--log-every", "1"]


def run(args, cwd, timeout=120, env=None):
    cmd = [BINARY] + args
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout, cwd=cwd,
                       env=env)
    print(p.stdout[-1500:] + p.stderr[-1500:], flush=True)
    return p


def check(cond, what):
    if not cond:
        sys.exit("FAIL: " + what)


def write_idx(path, dims, payload_chunks):
    """A gzipped IDX file of unsigned bytes with header `dims`, then the chunks as its data."""
    with open(path, "wb") as f:
        z = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip container
        f.write(z.compress(struct.pack(">I", 0x0800 | len(dims)) + b"".join(struct.pack(">I", d) for d in dims)))
        for chunk in payload_chunks:
            f.write(z.compress(chunk))
        f.write(z.flush())


def data_dir(tmp, name, train_images, test_images, train_payload=None):
    d = os.path.join(tmp, name)
    os.mkdir(d)
    for prefix, n in (("train", train_images), ("t10k", test_images)):
        payload = train_payload if prefix == "train" and train_payload is not None else [bytes(n * 784)]
        write_idx(os.path.join(d, prefix + "-images-idx3-ubyte.gz"), [n, 28, 28], payload)
        write_idx(os.path.join(d, prefix + "-labels-idx1-ubyte.gz"), [n], [bytes(n)])
    return d


def test_data_files(tmp):
    # First, so that the children's peak memory below is this run's.
    bomb = data_dir(tmp, "bomb", 60000, 10, train_payload=(bytes(1 << 20) for _ in range(1024)))
    check(os.path.getsize(os.path.join(bomb, "train-images-idx3-ubyte.gz")) < 2 << 20, "the bomb is not small")
    p = run(["--data", bomb, "--no-checkpoint"] + SHORT, tmp)
    check(p.returncode == 1 and "longer than its header says" in p.stderr, "gzip bomb not refused")
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print("peak RSS of a rank reading the bomb: %.0f MB" % peak_mb)
    check(peak_mb < 700, "reading the bomb took %.0f MB: it was inflated" % peak_mb)

    huge = data_dir(tmp, "huge", 10, 10)
    write_idx(os.path.join(huge, "train-images-idx3-ubyte.gz"), [2000000000, 28, 28], [bytes(784)])
    p = run(["--data", huge, "--no-checkpoint"] + SHORT, tmp)
    check(p.returncode == 1 and "claims 2000000000 items" in p.stderr, "huge header not refused")

    p = run(["--data", data_dir(tmp, "empty-train", 0, 10), "--no-checkpoint"] + SHORT, tmp)
    check(p.returncode == 1 and "training set has no images" in p.stderr, "empty training set not refused")
    p = run(["--data", data_dir(tmp, "empty-test", 10, 0), "--no-checkpoint"] + SHORT, tmp)
    check(p.returncode == 1 and "test set has no images" in p.stderr, "empty test set not refused")
    check("accuracy" not in p.stdout, "an empty test set reported an accuracy")


def test_options(tmp):
    for args, needle in ((["--lr", "nan"], "--lr: nan is not a finite number"),
                         (["--lr", "-1"], "--lr"),
                         (["--momentum", "inf"], "--momentum"),
                         (["--bucket-cap-mb", "nan"], "--bucket-cap-mb"),
                         (["--resume", "--overwrite"], "excludes")):
        p = run(args, tmp)
        check(p.returncode == 2, f"{args}: exit code {p.returncode}, not 2")
        check(needle in p.stderr, f"{args}: no '{needle}' in: {p.stderr}")
        check(len(p.stderr.strip().splitlines()) <= 2, f"{args}: more than a short message: {p.stderr}")
    p = run(["--help"], tmp)
    check(p.returncode == 0 and "--no-gradient-as-bucket-view" in p.stdout, "--help")
    check("{false}" not in p.stdout, "--help shows a default of {false} for a flag that is on")


def test_checkpoints(tmp):
    cwd = os.path.join(tmp, "cwd")
    os.mkdir(cwd)
    p = run(["--data", DATA] + SHORT, cwd)
    check(p.returncode == 0, "first run")
    latest = os.path.join(cwd, "runs", "fashion_mnist_ddp", "latest")
    check(os.path.exists(latest), "no checkpoint under runs/fashion_mnist_ddp by default")
    before = sorted(os.listdir(os.path.dirname(latest)))

    p = run(["--data", DATA] + SHORT, cwd)
    check(p.returncode != 0 and "--resume" in p.stderr and "--overwrite" in p.stderr,
          "a second run without --resume did not refuse")
    check("step 1/" not in p.stdout, "the refused run trained")
    check(sorted(os.listdir(os.path.dirname(latest))) == before, "the refused run touched the checkpoint")
    p = run(["--data", DATA, "--overwrite"] + SHORT, cwd)
    check(p.returncode == 0, "--overwrite was refused")

    blocker = os.path.join(tmp, "a-file")
    open(blocker, "w").close()
    p = run(["--data", DATA, "--checkpoint-dir", os.path.join(blocker, "ckpt")] + SHORT, cwd)
    check(p.returncode != 0 and os.path.join(blocker, "ckpt") in p.stderr, "unwritable directory not reported")
    check("step 1/" not in p.stdout, "training ran before the checkpoint directory was checked")

    # Two ranks save after 10 steps; one rank resumes: it says what changes and where it resumes.
    ckpt = os.path.join(tmp, "ws")
    p = run(["--data", DATA, "--nproc", "2", "--max-steps", "10", "--eval-limit", "10", "--checkpoint-dir", ckpt],
            cwd)
    check(p.returncode == 0, "two-rank run")
    p = run(["--data", DATA, "--nproc", "1", "--max-steps", "12", "--eval-limit", "10", "--checkpoint-dir", ckpt,
             "--resume"], cwd)
    check(p.returncode == 0, "resume at world size 1")
    check("written by 2 rank(s) x batch 64, this run has 1 x 64" in p.stdout, "no notice of the world size change")
    check("resumes at batch 20 (0 sample(s) trained on again)" in p.stdout, "wrong resume position")


def output_on_pty(args, env):
    """The harness's stdout when it is a pseudo-terminal, as a terminal would receive it."""
    master, slave = pty.openpty()
    chunks = []

    def reader():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    t = threading.Thread(target=reader)
    t.start()
    p = subprocess.Popen([BINARY] + args, stdout=slave, stderr=subprocess.DEVNULL, env=env)
    os.close(slave)
    try:
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    t.join(timeout=10)
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_progress(tmp):
    args = ["--data", DATA, "--no-checkpoint", "--max-steps", "3", "--eval-limit", "10"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))}
    env["TERM"] = "xterm"
    tty = output_on_pty(args, env)
    check("\x1b[K" in tty, "no in-place progress line on a terminal: %r" % tty[-300:])
    relayed = output_on_pty(args, dict(env, SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="1"))
    check("step 3/3" in relayed, "no progress under srun: %r" % relayed[-300:])
    check("\x1b[K" not in relayed and "\r" not in relayed.replace("\r\n", "\n"),
          "escape codes or carriage returns under srun: %r" % relayed[-300:])


def main():
    global BINARY
    BINARY = os.path.abspath(sys.argv[1])
    with tempfile.TemporaryDirectory(prefix="fashion-mnist-input-test-") as tmp:
        test_data_files(tmp)
        test_options(tmp)
        test_checkpoints(tmp)
        test_progress(tmp)
    print("OK")


if __name__ == "__main__":
    main()
