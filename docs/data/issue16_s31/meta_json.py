import sys, os, json
sys.path.append("/tmp/mcvenv/lib/python3.11/site-packages")
os.environ["PATH"] = "/tmp/mcvenv/bin:" + os.environ["PATH"]
from pymooncake.bench import store_meta
if __name__ == "__main__":
    rows = store_meta.run(ops=20000, clients=4, repeat=int(sys.argv[1]))
    print(store_meta.human(rows), file=sys.stderr)
    print(json.dumps(rows))
