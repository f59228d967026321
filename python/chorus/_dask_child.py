"""One rank of chorus.dask.run: `python -m chorus._dask_child PAYLOAD RESULT` unpickles
(fn, args, kwargs), calls fn, and writes {"value": ...} or {"error": "Type: message",
"traceback": ...} to RESULT. Exit status 0 on success, 1 when fn raised."""
import sys
import traceback

import cloudpickle


def main():
    payload_path, result_path = sys.argv[1], sys.argv[2]
    with open(payload_path, "rb") as f:
        fn, args, kwargs = cloudpickle.load(f)
    try:
        outcome = {"value": fn(*args, **kwargs)}
        code = 0
    except BaseException as e:  # noqa: B902  reported to the client, whatever it was
        outcome = {"error": "%s: %s" % (type(e).__name__, e) if str(e) else type(e).__name__,
                   "traceback": traceback.format_exc()}
        code = 1
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        cloudpickle.dump(outcome, f)
    import os
    os.replace(tmp, result_path)
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
