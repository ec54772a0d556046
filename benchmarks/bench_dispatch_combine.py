"""Side-by-side benchmark of moe_comm and the all-to-all baselines (same as `moe-comm bench`).

Usage: python benchmarks/bench_dispatch_combine.py [--tokens 128 4096] [--routing uniform] [--help]
"""

import sys

from moe_comm.tools.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
