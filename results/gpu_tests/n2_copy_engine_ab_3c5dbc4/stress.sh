#!/usr/bin/env bash
# Repeat ab.sh (the copy-engine case at 3c5dbc4) up to $1 times, each bounded at $2 s; stop at the first hang.
for i in $(seq 1 $1); do
  mkdir -p $3/try; bash "$(dirname "$0")/ab.sh" $2 $3/try > /dev/null 2>&1
  r=$(tail -1 $3/try/old_copy_engine.log); echo "try $i: $r" >> $3/stress.txt
  if grep -q HUNG $3/try/old_copy_engine.log; then cp $3/try/old_copy_engine.log $3/hung.log; break; fi
done
cat $3/stress.txt
