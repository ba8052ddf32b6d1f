"""`deadpool chaos`: a matrix of fault scenarios against the example GPT, each judged against a failure-free run
(scenarios.py: the matrix as data and its seeded draw; runner.py: the runs; report.py: the verdicts and table)."""
