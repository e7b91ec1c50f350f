#!/bin/bash
# Issue 18 in one call: parity (run_a.sh without the all-reduce timing), then speed (run_b.sh).
D=$OUT; mkdir -p $D/a $D/b
SKIP_AR=1 OUT=$D/a bash docs/results/2026-11-26-x2/run_a.sh
OUT=$D/b bash docs/results/2026-11-26-x2/run_b.sh
