"""`python -m strata.bench` runs `strata-bench`."""
from strata.bench.cli import main

main(prog_name="strata-bench")
