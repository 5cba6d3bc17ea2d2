# Runs until killed; writes its pid to $BENCH_TIMES so the benchmark can clean it up.
import os
import time

_out = os.environ.get("BENCH_TIMES")
if _out:
    with open(_out, "a") as f:
        f.write(f"{os.getpid()}\n")
time.sleep(float(os.environ.get("BENCH_SLEEP", "120")))
