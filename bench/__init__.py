"""numasched.bench: benchmark suites (run with ``numasched bench SUITE``); results under bench/results/."""
