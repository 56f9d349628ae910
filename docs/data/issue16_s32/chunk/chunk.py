"""bench serving with every worker's --max-num-batched-tokens set (argv[1]; 0 = default)."""
import sys
from pymooncake.cli import bench_serving
from pymooncake.cli.main import main
budget = int(sys.argv[1])
orig = bench_serving.ClusterSpec
def spec(**kw):
    if budget:
        kw["max_num_batched_tokens"] = budget
    return orig(**kw)
bench_serving.ClusterSpec = spec
sys.exit(main(["bench", "serving", *sys.argv[2:]]))
