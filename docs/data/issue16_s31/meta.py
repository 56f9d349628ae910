# Session 31 scratch script: the metadata bench alone; expects the Mooncake wheel in /tmp/mcvenv.
import sys, os
sys.path.append("/tmp/mcvenv/lib/python3.11/site-packages")
os.environ["PATH"] = "/tmp/mcvenv/bin:" + os.environ["PATH"]
from pymooncake.bench import store_meta
if __name__ == "__main__":
    rows = store_meta.run(ops=20000, clients=4, repeat=int(sys.argv[1]) if len(sys.argv) > 1 else 5)
    print(store_meta.human(rows))
