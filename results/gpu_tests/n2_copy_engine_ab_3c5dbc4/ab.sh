#!/usr/bin/env bash
# Issue 31's copy-engine A/B at 3c5dbc4 (the commit that hung on 11-24): bounded at $1 s, every process's stack dumped.
cd "$(dirname "$0")"
export PYTHONFAULTHANDLER=1 ODC_RESULTS=$2/old_measured.jsonl
python3 -m pytest tests/test_gpu.py -k "other_gather_modes and copy_engine" -q -s -p no:cacheprovider -p no:timeout > $2/old_copy_engine.log 2>&1 &
pid=$!; t=0
while kill -0 $pid 2>/dev/null && [ $t -lt $1 ]; do sleep 2; t=$((t+2)); done
if kill -0 $pid 2>/dev/null; then
  echo "HUNG after ${t}s: dumping stacks" >> $2/old_copy_engine.log
  pkill -ABRT -P $pid; sleep 5; kill -ABRT $pid; sleep 3; pkill -KILL -P $pid; kill -KILL $pid
else
  wait $pid; echo "exit $? after ${t}s" >> $2/old_copy_engine.log
fi
tail -5 $2/old_copy_engine.log
